"""Kinds of tier below the CPU: each says in its own module how it is configured, validated, built and simulated.

A kind is a frozen dataclass that subclasses :class:`TierConfig` and is
registered with :func:`register_tier_kind` under a ``type`` name, the word a
simulator config uses (``- {type: disk, capacity_gib: 32}``).  Its module says
everything about it: its fields and their checks (``__post_init__``), its
medium and default link, and :meth:`TierConfig.build` (its store and I/O
engine).  The simulator needs no more than that: it keeps the chain's
bookkeeping of the kind's medium and runs its copies on the kind's link.

How kinds are found: a ``type`` not registered yet is looked for in the module
``tiered_kv.tiers.kinds.<type>``, where the package's own kinds live
(:mod:`~tiered_kv.tiers.kinds.disk`, :mod:`~tiered_kv.tiers.kinds.redis`), so no
central list names them and a new kind is one new file.  A kind defined elsewhere registers itself before it
is used.  A registry keyed by a short name, rather than vLLM's
``module.path:Class`` spelling, keeps configs short and lets an unknown name be
answered with the names that do exist.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.write_policy import check_write_policy

if TYPE_CHECKING:
    from tiered_kv.storage.kv_storage import KVStorage

KINDS_PACKAGE = "tiered_kv.tiers.kinds"
_KINDS: dict[str, type[TierConfig]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class TierConfig:
    """What every kind of tier below the CPU is configured with; a kind adds its own fields.

    Class attributes (set by each kind):
        type: The kind's name in configs.
        medium: Its store's medium (``"DISK"``): the tier's name in counters,
            plans and a hardware profile's ``tiers:`` section (lowercased).
        default_link: The link its loads are priced with when none is given.

    Attributes:
        write_policy: When the blocks of the tier above are also written here
            (:mod:`~tiered_kv.tiers.write_policy`).
        writeback_reserve: For ``"write_back"``: the tier above's least recent
            evictable blocks kept held here (the builder caps it at what this tier holds).
        link: This tier's link (``None``: :attr:`default_link`).
    """

    type: ClassVar[str] = ""
    medium: ClassVar[str] = ""
    default_link: ClassVar[TierLink]

    write_policy: str = "write_back"
    writeback_reserve: int = 16
    link: TierLink | None = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_write_policy(f"{name}.write_policy", self.write_policy)
        checks.count(f"{name}.writeback_reserve", self.writeback_reserve)
        if self.link is not None:
            checks.instance(f"{name}.link", self.link, TierLink)

    @property
    def effective_link(self) -> TierLink:
        """The link loads from this tier are priced with."""
        return self.link if self.link is not None else self.default_link

    def build(self, namespace: KVNamespace, cpu_storage: KVStorage) -> tuple[CPUStore, Any]:
        """Open the tier: its store and its I/O engine (which stages through ``cpu_storage``).

        The caller owns both (it closes the engine, then the store when the
        store has ``close``).  Whatever fails, nothing stays open.
        """
        raise NotImplementedError(f"{type(self).__name__} does not say how it is built")


K = TypeVar("K", bound=type[TierConfig])


def register_tier_kind(kind: K) -> K:
    """Make ``kind`` known under its ``type`` (a class decorator); registering it again is harmless.

    Raises:
        InvalidArgumentError: not a :class:`TierConfig` subclass, no ``type`` or ``medium``
            or ``default_link``, or its ``type`` is another kind's.
    """
    if not (isinstance(kind, type) and issubclass(kind, TierConfig)) or kind is TierConfig:
        raise InvalidArgumentError(f"a tier kind must subclass TierConfig, got {checks.describe(kind)}")
    name = kind.type
    if name.__class__ is not str or not name.isidentifier() or not kind.medium:
        raise InvalidArgumentError(f"tier kind {kind.__name__} needs a type (an identifier) and a medium")
    checks.instance(f"{kind.__name__}.default_link", getattr(kind, "default_link", None), TierLink)
    known = _KINDS.get(name)
    if known is not None and known is not kind:
        raise InvalidArgumentError(f"tier type {name!r} is already {known.__name__}'s")
    _KINDS[name] = kind
    return kind


def known_tier_types() -> list[str]:
    """Every type that can be named: those registered and the modules of :data:`KINDS_PACKAGE`."""
    package = importlib.import_module(KINDS_PACKAGE)
    return sorted({*_KINDS, *(m.name for m in pkgutil.iter_modules(package.__path__))})


def find_tier_kind(type_name: object) -> type[TierConfig]:
    """The kind registered as ``type_name``, importing the package's module for it if need be.

    Raises:
        InvalidArgumentError: no kind has that type (the message lists those that do).
    """
    if type_name.__class__ is not str:
        raise InvalidArgumentError(f"a tier type must be a string, got {checks.describe(type_name)}")
    name: str = type_name
    if name not in _KINDS and name.isidentifier():
        module = f"{KINDS_PACKAGE}.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    kind = _KINDS.get(name)
    if kind is None:
        raise InvalidArgumentError(f"unknown tier type {name!r}; known types: {known_tier_types()}")
    return kind
