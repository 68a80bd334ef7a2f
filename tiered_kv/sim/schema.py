"""A small declarative validator for YAML configs: every error names the key it is about.

A schema maps keys to :class:`Field` (a leaf) or to a nested schema (a mapping).
``validate`` returns a new dict with defaults filled in, or raises
:class:`~tiered_kv.errors.ConfigError` with messages such as
``workload.arrival.rate: must be > 0, got -1``.  A key without a default is
required; the keys that were given are checked first, then every missing one
is named in one message.

Numbers are finite unless a field says otherwise: a NaN compares false with
everything, so one NaN arrival rate or step time would stall the simulated
clock forever; infinity is allowed only where it means something (a link with
infinite bandwidth is a free link).

Why a validator of its own rather than pydantic (vLLM's config is on pydantic): three
sections (``memory``, ``scheduler``, ``link``) ported to pydantic 2.14 models gave the same
messages and documents on 18 good and bad inputs, in 35 lines of declarations where the
schema takes 46; but keeping the messages (the key's full path and the fix, wrong values
before missing keys, retired keys' explanations, the YAML exponent hint, "known keys here")
took a formatter of 80 lines that reads pydantic's error locations, whose labels for union
members and validators are no documented interface, where this module's code is 107 lines
and covers more (choices, defaults computed per key).  At that rate the whole schema would
save about 60 of the 334 lines of code of this module and ``config_schema`` at best (under
20%): not enough to pay for a compiled dependency in the ``sim`` extra and messages tied to
another library's internals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.errors import ConfigError

REQUIRED = object()
Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Field:
    """A leaf: allowed types, default, choices and extra checks (each returns an error or None).

    ``allow_inf`` admits ``.inf`` in a numeric field; NaN is never admitted.
    """

    types: tuple[type, ...]
    default: Any = REQUIRED
    choices: tuple[Any, ...] | None = None
    checks: tuple[Check, ...] = field(default_factory=tuple)
    nullable: bool = False
    allow_inf: bool = False

    def type_name(self) -> str:
        names = {
            bool: "a boolean",
            int: "an integer",
            float: "a number",
            str: "a string",
            list: "a list",
            dict: "a mapping",
        }
        return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in self.types))


@dataclass(frozen=True)
class Retired:
    """A key that was renamed or removed: refused with ``explain(value)``, which names what to write instead.

    Old names are never aliased: a config that still says ``policy: lru`` on a
    run meant the victim policy, and reading it under the key's new meaning
    (the scheduling order) would run something else without a word.
    """

    explain: Callable[[Any], str]


def positive(v: Any) -> str | None:
    return None if v > 0 else f"must be > 0, got {v}"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v}"


def fraction(v: Any) -> str | None:
    return None if 0 < v <= 1 else f"must be in (0, 1], got {v}"


def probability(v: Any) -> str | None:
    return None if 0 <= v <= 1 else f"must be in [0, 1], got {v}"


def power_of_two(v: Any) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"must be a power of two, got {v}"


NUM = (int, float)


def num(default: Any = REQUIRED, *checks: Check, nullable: bool = False, allow_inf: bool = False) -> Field:
    return Field(NUM, default, None, checks, nullable, allow_inf)


def integer(default: Any = REQUIRED, *checks: Check) -> Field:
    return Field((int,), default, None, checks)


def choice(default: Any, *choices: Any) -> Field:
    return Field((str,), default, tuple(choices))


def _is_type(v: Any, types: tuple[type, ...]) -> bool:
    if isinstance(v, bool):
        return bool in types
    if isinstance(v, int) and float in types:
        return True
    return isinstance(v, types)


def validate(data: Any, schema: Mapping[str, Any], path: str = "") -> dict[str, Any]:
    """Check ``data`` against ``schema``; return it with defaults filled in.

    Every given key is checked first (its type, range and choices); then the
    required keys that are missing, at any depth, are named in one message.
    """
    missing: list[str] = []
    out = _validate(data, schema, path, missing)
    if missing:
        also = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise ConfigError(f"{missing[0]}: required key is missing{also}")
    return out


def _validate(data: Any, schema: Mapping[str, Any], path: str, missing: list[str]) -> dict[str, Any]:
    where = path or "config"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    for key, spec in schema.items():
        if isinstance(spec, Retired) and key in data:
            raise ConfigError(f"{f'{path}.{key}' if path else key}: {spec.explain(data[key])}")
    known = sorted(k for k, spec in schema.items() if not isinstance(spec, Retired))
    unknown = sorted(set(data) - set(schema))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(f"{key}: unknown key (known keys here: {', '.join(known)})")
    out: dict[str, Any] = {}
    for key, spec in schema.items():
        if isinstance(spec, Retired):
            continue
        full = f"{path}.{key}" if path else key
        if isinstance(spec, Mapping):
            out[key] = _validate(data.get(key), spec, full, missing)
            continue
        if key not in data or (data[key] is None and spec.nullable):
            if key not in data and spec.default is REQUIRED:
                missing.append(full)  # reported after the keys that were given: a wrong value is the likelier typo
                continue
            out[key] = None if key in data else spec.default
            continue
        v = data[key]
        if not _is_type(v, spec.types):
            hint = ""
            if isinstance(v, str) and float in spec.types:
                try:
                    float(v)
                    hint = " (YAML reads an exponent without a sign as text: write 8.0e+9, not 8.0e9)"
                except ValueError:
                    pass
            raise ConfigError(f"{full}: expected {spec.type_name()}, got {type(v).__name__} {v!r}{hint}")
        if isinstance(v, float) and not math.isfinite(v) and (math.isnan(v) or not spec.allow_inf):
            raise ConfigError(f"{full}: must be a finite number, got {v}")
        if spec.choices is not None and v not in spec.choices:
            raise ConfigError(f"{full}: must be one of {list(spec.choices)}, got {v!r}")
        for check in spec.checks:
            msg = check(v)
            if msg:
                raise ConfigError(f"{full}: {msg}")
        out[key] = float(v) if float in spec.types and int not in spec.types and isinstance(v, int) else v
    return out
