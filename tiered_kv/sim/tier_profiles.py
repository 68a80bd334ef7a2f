"""The tiers below the CPU in a hardware profile: how fast each medium moves blocks to and from the CPU tier.

A hardware profile's optional ``tiers:`` section names each medium a run may
put below the CPU tier (``disk``, ``remote``) with the numbers of its link into
the CPU tier (the staging area of every load and store below it)::

    tiers:
      disk:   {bandwidth_gbps: 6.4, write_gbps: 3.8, block_latency_us: 40}
      remote: {bandwidth_gbps: 25.0, block_latency_us: 50}

``bandwidth_gbps`` is GB/s (1e9 bytes/s, as ``link.h2d_gbps``): the sustained
read bandwidth; ``write_gbps`` the write bandwidth (default: the read one);
``block_latency_us`` the fixed cost of one block (a file open, a server round
trip), amortised over the I/O engine's parallel requests.  Each direction is a
:class:`~tiered_kv.manager.cost_model.TierLink`, the manager's own model of a
link below the CPU, so the simulator's copies and the manager's load prices are
the same arithmetic.  A medium the profile leaves out gets the default link of
the tier kind a run puts there (:attr:`~tiered_kv.tiers.tier_kind.TierConfig.default_link`,
measured here).  The media a profile may name are those of the known tier kinds
(:func:`~tiered_kv.tiers.tier_kind.known_tier_types`), lowercased.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.schema import Field, non_negative, num, positive, validate
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.tier_kind import TierConfig, find_tier_kind, known_tier_types

GB = 1e9

MEDIUM_SCHEMA = {
    "bandwidth_gbps": num(None, positive, nullable=True),
    "write_gbps": num(None, positive, nullable=True),
    "block_latency_us": num(None, non_negative, nullable=True),
}
TIERS_SCHEMA = Field((dict,), None, nullable=True)
"""The ``tiers:`` section of a hardware profile (see :data:`tiered_kv.sim.profiles.HARDWARE_SCHEMA`):
medium name -> :data:`MEDIUM_SCHEMA`, checked by :func:`tier_media`."""


def profile_name(kind: type[TierConfig]) -> str:
    """The name of a tier kind's medium in a hardware profile (``DISK`` -> ``disk``)."""
    return kind.medium.lower()


@dataclass(frozen=True, slots=True)
class TierMedium:
    """One medium below the CPU tier: its link for loads (into the CPU tier) and for stores (out of it).

    Attributes:
        read: Loads, medium -> CPU tier; also what the manager prices a load with.
        write: Stores, CPU tier -> medium.
        source: ``"profile"`` (the hardware profile gives it) or ``"default"`` (the manager's default).
    """

    read: TierLink
    write: TierLink
    source: str = "profile"


def _medium(name: str, d: Mapping[str, Any], key: str) -> TierMedium | None:
    given = {k: v for k, v in d.items() if v is not None}
    if not given:
        return None
    for need in ("bandwidth_gbps", "block_latency_us"):
        if need not in given:
            raise ConfigError(f"{key}.{name}.{need}: required when the {name} tier is described")
    latency = given["block_latency_us"] * 1e-6
    read = TierLink(given["bandwidth_gbps"] * GB, latency)
    write = TierLink(given.get("write_gbps", given["bandwidth_gbps"]) * GB, latency)
    return TierMedium(read, write)


def tier_media(section: Mapping[str, Any] | None, key: str = "hardware.tiers") -> Mapping[str, TierMedium]:
    """Medium name -> :class:`TierMedium` from a ``tiers:`` section (only the media it describes).

    Raises:
        ConfigError: a name is no known kind's medium, a key is unknown, or a described
            medium lacks its bandwidth or its latency (the message names the key).
    """
    names = {profile_name(find_tier_kind(t)) for t in known_tier_types()}
    out: dict[str, TierMedium] = {}
    for name, d in (section or {}).items():
        if name not in names:
            raise ConfigError(f"{key}.{name}: unknown key (known keys here: {', '.join(sorted(names))})")
        medium = _medium(name, validate(d, MEDIUM_SCHEMA, f"{key}.{name}"), key)
        if medium is not None:
            out[name] = medium
    return out  # a plain dict: a profile travels to worker processes, and a mapping proxy does not pickle


def medium_for(kind: type[TierConfig], media: Mapping[str, TierMedium]) -> TierMedium:
    """The profile's :class:`TierMedium` for a kind's medium, or the kind's default link both ways."""
    medium = media.get(profile_name(kind))
    if medium is None:
        medium = TierMedium(kind.default_link, kind.default_link, "default")
    return medium
