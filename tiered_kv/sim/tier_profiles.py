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
the same arithmetic.  A medium the profile leaves out gets the manager's
defaults (:data:`~tiered_kv.manager.cost_model.DEFAULT_TIER_LINKS`, measured here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.cost_model import DEFAULT_TIER_LINKS, TierLink
from tiered_kv.sim.schema import non_negative, num, positive

GB = 1e9
TIER_NAMES = ("disk", "remote")
"""The media a run may put below the CPU tier, highest first (the chain's order)."""

MEDIUM_SCHEMA = {
    "bandwidth_gbps": num(None, positive, nullable=True),
    "write_gbps": num(None, positive, nullable=True),
    "block_latency_us": num(None, non_negative, nullable=True),
}
TIERS_SCHEMA = {name: MEDIUM_SCHEMA for name in TIER_NAMES}
"""The ``tiers:`` section of a hardware profile (see :data:`tiered_kv.sim.profiles.HARDWARE_SCHEMA`)."""


def medium_of(name: str) -> str:
    """The store medium of a tier name (``disk`` -> ``DISK``), as the manager's links are keyed."""
    return name.upper()


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


def tier_media(section: Mapping[str, Any], key: str = "hardware.tiers") -> Mapping[str, TierMedium]:
    """Tier name -> :class:`TierMedium` from a validated ``tiers:`` section (left-out media get the defaults).

    Raises:
        ConfigError: a described medium lacks its bandwidth or its latency (the message names the key).
    """
    out: dict[str, TierMedium] = {}
    for name in TIER_NAMES:
        medium = _medium(name, section.get(name) or {}, key)
        if medium is None:
            link = DEFAULT_TIER_LINKS[medium_of(name)]
            medium = TierMedium(link, link, "default")
        out[name] = medium
    return out  # a plain dict: a profile travels to worker processes, and a mapping proxy does not pickle
