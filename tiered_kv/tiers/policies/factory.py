"""Cache policies by name (vLLM 0.33.0's ``kv_offload/cpu/policies/factory.py``).

The built-in policies are ``"lru"`` and ``"arc"``.  A user's policy either
registers a name up front (:func:`register_cache_policy`) or is named together
with the module that defines it (``module_path``, vLLM's
``cache_policy_module_path``): then the name is the class's name in that module,
and nothing inside the package has to change.
"""

from __future__ import annotations

import importlib

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.policies.arc import ARCPolicy
from tiered_kv.tiers.policies.base import CachePolicy, Predicate
from tiered_kv.tiers.policies.lru import LRUPolicy


def _text(name: str, value: object) -> str:
    if value.__class__ is not str or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty str, got {checks.describe(value)}")
    return value  # type: ignore[return-value]


CACHE_POLICIES: dict[str, type[CachePolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}
"""Registered policies by name."""


def register_cache_policy(name: str, cls: type[CachePolicy]) -> None:
    """Register ``cls`` under ``name``.

    Raises:
        InvalidArgumentError: ``name`` is taken, or ``cls`` is not a :class:`CachePolicy` subclass.
    """
    _text("name", name)
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise InvalidArgumentError(f"cls must be a CachePolicy subclass, got {checks.describe(cls)}")
    if name in CACHE_POLICIES:
        raise InvalidArgumentError(f"cache policy {name!r} is already registered")
    CACHE_POLICIES[name] = cls


def get_cache_policy_cls(name: str, module_path: str | None = None) -> type[CachePolicy]:
    """The policy class registered as ``name``; else, with ``module_path``, the class ``name`` of that module.

    Raises:
        InvalidArgumentError: ``name`` is unknown (the message lists the known
            names), or the module lacks it, or it is not a :class:`CachePolicy`.
    """
    cls = CACHE_POLICIES.get(name) if name.__class__ is str else None
    if cls is not None:
        return cls
    if module_path is None or name.__class__ is not str or not name:
        raise InvalidArgumentError(
            f"policy must be one of {sorted(CACHE_POLICIES)}, got {checks.describe(name)} "
            "(for a policy of your own, register it or give the module that defines it)"
        )
    _text("module_path", module_path)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise InvalidArgumentError(f"cannot import cache policy module {module_path!r}: {e}") from e
    found = getattr(module, name, None)
    if not (isinstance(found, type) and issubclass(found, CachePolicy)):
        raise InvalidArgumentError(f"{module_path}.{name} is not a CachePolicy subclass, got {checks.describe(found)}")
    return found


def make_cache_policy(name: str, capacity: int, is_ready: Predicate, module_path: str | None = None) -> CachePolicy:
    """A new, empty policy by name (see :func:`get_cache_policy_cls`)."""
    return get_cache_policy_cls(name, module_path)(capacity, is_ready)
