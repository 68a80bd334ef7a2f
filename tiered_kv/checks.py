"""Argument checks shared by every public call (standard library only, below every layer).

The rule they enforce, "validate, then mutate": a public call checks
every argument, types included, before it changes anything, and a bad one raises
:class:`~tiered_kv.errors.InvalidArgumentError` naming the argument.

Counts are plain ``int`` only.  ``bool`` is refused although it subclasses
``int`` (``preempt(True)`` is a bug, not a request for one block), and so are
``float`` and NumPy integers: a count that is not a Python ``int`` usually means
the caller computed it in the wrong unit, and accepting it would only move the
failure somewhere less clear.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import Any

from tiered_kv.errors import InvalidArgumentError


def describe(value: object) -> str:
    """``repr`` plus the type when the repr alone does not show it (``2.5``, ``True`` and ``'3'`` do)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def count(name: str, value: object, minimum: int = 0) -> int:
    """Return ``value`` if it is a plain ``int`` >= ``minimum``; else raise naming ``name``."""
    if value.__class__ is not int or value < minimum:  # type: ignore[operator]
        bound = "> 0" if minimum == 1 else f">= {minimum}"
        raise InvalidArgumentError(f"{name} must be an int {bound}, got {describe(value)}")
    return value  # type: ignore[return-value]


def flag(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``."""
    if value.__class__ is not bool:
        raise InvalidArgumentError(f"{name} must be True or False, got {describe(value)}")
    return value  # type: ignore[return-value]


def choice(name: str, value: object, choices: Collection[Any]) -> Any:
    """Return ``value`` if it is one of ``choices`` (compared with ``==``, strings and enums alike)."""
    try:
        ok = value in choices
    except TypeError:  # unhashable value against a set
        ok = False
    if not ok or value.__class__ is bool:
        raise InvalidArgumentError(f"{name} must be one of {sorted(map(str, choices))}, got {describe(value)}")
    return value


def hashable(name: str, value: object) -> Hashable:
    """Return ``value`` if it can be a dict key (request ids); ``None`` is refused too."""
    if value is None:
        raise InvalidArgumentError(f"{name} must be a hashable id, got None")
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a hashable id, got {describe(value)}") from None
    return value  # type: ignore[return-value]


def instance(name: str, value: object, cls: type | tuple[type, ...]) -> Any:
    """Return ``value`` if it is an instance of ``cls``."""
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise InvalidArgumentError(f"{name} must be a {names}, got {describe(value)}")
    return value


def timeout(name: str, value: object) -> float | None:
    """``None`` (wait forever) or a finite number of seconds >= 0."""
    if value is None:
        return None
    if value.__class__ not in (int, float) or not 0 <= value < float("inf"):  # type: ignore[operator]
        raise InvalidArgumentError(f"{name} must be None or a number of seconds >= 0, got {describe(value)}")
    return float(value)  # type: ignore[arg-type]
