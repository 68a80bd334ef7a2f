"""A run's tiers below the CPU: the ``tiers:`` key of a ``runs`` entry, checked and resolved into a :class:`TierSetup`.

::

    runs:
      - name: cpu+disk+remote
        offload: write_through            # the CPU prefix tier feeds the tiers below it
        tiers:
          disk: {capacity_gib: 512}       # or capacity_blocks: N
          remote: {capacity_gib: 4096}
          demote: write_through           # how each tier with one below it hands blocks down
          writeback_reserve: 64           # write_back only: blocks kept clean ahead of eviction

Either medium may be left out; the chain is CPU -> disk -> remote, or a
suffix of the media.  Each medium's speed comes from the hardware profile
(:mod:`~tiered_kv.sim.tier_profiles`); its capacity from the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.cost_model import TierLink
from tiered_kv.sim.schema import Field, choice, integer, non_negative, num, positive
from tiered_kv.sim.tier_profiles import TIER_NAMES, TierMedium, medium_of

GIB = 1 << 30
CAPACITY_SCHEMA = {
    "capacity_gib": num(None, positive, nullable=True),
    "capacity_blocks": Field((int,), None, None, (positive,), nullable=True),
}
RUN_TIERS_SCHEMA: dict[str, Any] = {
    **{name: CAPACITY_SCHEMA for name in TIER_NAMES},
    # write_through: a block goes down as soon as it is stored (nothing is lost to eviction);
    # write_back: only the writeback_reserve least recent blocks of a tier are kept held below.
    "demote": choice("write_through", "write_through", "write_back"),
    "writeback_reserve": integer(64, non_negative),
}
"""The ``tiers:`` key of a run (see :data:`tiered_kv.sim.config_schema.RUN_SCHEMA`)."""


@dataclass(frozen=True, slots=True)
class SimTier:
    """One tier below the CPU in a simulated run.

    Attributes:
        name: ``disk`` or ``remote``; ``medium`` its store medium (``DISK``, ``REMOTE``).
        num_blocks: Blocks it holds.
        capacity_gib: Its KV capacity.
        link: Its read and write links (from the hardware profile, or the manager's defaults).
    """

    name: str
    medium: str
    num_blocks: int
    capacity_gib: float
    link: TierMedium


@dataclass(frozen=True, slots=True)
class TierSetup:
    """The tiers below the CPU of one run, highest first, and how blocks go down between them."""

    tiers: tuple[SimTier, ...]
    demote: str
    writeback_reserve: int

    @property
    def links(self) -> dict[str, TierLink]:
        """Medium -> the link the manager prices loads from it with (its read link)."""
        return {t.medium: t.link.read for t in self.tiers}

    def describe(self) -> str:
        """``DISK 512 GiB + REMOTE 4096 GiB (default link)`` (``""`` without tiers).

        ``(default link)`` marks a medium the hardware profile does not describe.
        """
        return " + ".join(
            f"{t.medium} {t.capacity_gib:.4g} GiB" + (" (default link)" if t.link.source == "default" else "")
            for t in self.tiers
        )


NO_TIERS = TierSetup((), "none", 0)


def resolve_tiers(
    section: Mapping[str, Any],
    media: Mapping[str, TierMedium],
    block_bytes: int,
    num_cpu_blocks: int,
    offload: str,
    key: str,
) -> TierSetup:
    """The run's validated ``tiers:`` section as a :class:`TierSetup`.

    Raises:
        ConfigError: a medium gives both or neither capacity, holds fewer than 2
            blocks, or the run has no CPU prefix tier to feed the tiers (no CPU
            blocks, or ``offload: none``), or a write-back reserve exceeds a tier
            below; the message names the key.
    """
    tiers = []
    for name in TIER_NAMES:
        cap = section[name]
        gib, blocks = cap["capacity_gib"], cap["capacity_blocks"]
        if gib is None and blocks is None:
            continue
        if gib is not None and blocks is not None:
            raise ConfigError(f"{key}.{name}: give capacity_gib or capacity_blocks, not both")
        if blocks is None:
            blocks = int(gib * GIB // block_bytes)
            if blocks < 2:
                raise ConfigError(f"{key}.{name}.capacity_gib: {gib} GiB holds fewer than 2 blocks of {block_bytes} B")
        elif blocks < 2:
            raise ConfigError(f"{key}.{name}.capacity_blocks: must be >= 2, got {blocks}")
        tiers.append(SimTier(name, medium_of(name), blocks, blocks * block_bytes / GIB, media[name]))
    if not tiers:
        return NO_TIERS
    if num_cpu_blocks == 0:
        raise ConfigError(f"{key}: tiers below the CPU stage through a CPU tier, but the run has no CPU blocks")
    if offload == "none":
        raise ConfigError(
            f"{key}: tiers below the CPU are fed by the CPU prefix tier: the run needs offload: write_through "
            "or on_evict"
        )
    reserve = section["writeback_reserve"]
    if section["demote"] == "write_back":
        small = min(tiers, key=lambda t: t.num_blocks)
        if reserve > small.num_blocks:
            raise ConfigError(
                f"{key}.writeback_reserve: {reserve} blocks is more than the {small.name} tier holds "
                f"({small.num_blocks} blocks)"
            )
    return TierSetup(tuple(tiers), section["demote"], reserve)
