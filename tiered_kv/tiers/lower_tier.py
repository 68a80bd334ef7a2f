"""One tier below the CPU as the manager drives it: its store, its I/O engine, its link, how blocks reach it.

:meth:`TierManager.attach_tiers <tiered_kv.manager.TierManager.attach_tiers>`
takes a list of these, from the CPU down, and orders their stores into its
:class:`~tiered_kv.tiers.chain.TierChain` under its own CPU store.  Whoever
made the store and the I/O engine (a :class:`~tiered_kv.tiers.stack.TierStack`,
the simulator, a user's own loop) still owns them: the manager only drives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.write_policy import check_write_policy


@dataclass(frozen=True, slots=True, eq=False)
class LowerTier:
    """A store below the CPU with the engine that moves its bytes and the link that prices its loads.

    Attributes:
        store: The tier's :class:`CPUStore`; its ``medium`` names the tier.
        io: Its I/O engine (``submit`` and ``cancel``): moves blocks between the
            CPU tier's tensor and the store's medium.
        link: How fast its blocks come into the CPU tier (loads are priced with it).
        write_policy: When the blocks of the tier *above* this one are also written
            here (:mod:`~tiered_kv.tiers.write_policy`): the policy belongs to the
            hop into this tier, so the last tier needs none and the CPU tier's
            own hop is its first entry's.
        writeback_reserve: For ``"write_back"``: how many of the tier above's least
            recent evictable blocks are kept held here (at most what this tier holds).
    """

    store: CPUStore
    io: Any
    link: TierLink
    write_policy: str = "write_back"
    writeback_reserve: int = 16

    def __post_init__(self) -> None:
        checks.instance("LowerTier.store", self.store, CPUStore)
        if not all(callable(getattr(self.io, n, None)) for n in ("submit", "cancel")):
            raise InvalidArgumentError(f"LowerTier.io must have submit() and cancel(), got {checks.describe(self.io)}")
        checks.instance("LowerTier.link", self.link, TierLink)
        check_write_policy("LowerTier.write_policy", self.write_policy)
        checks.count("LowerTier.writeback_reserve", self.writeback_reserve)

    @property
    def medium(self) -> str:
        """The store's medium (``"DISK"``, ``"REMOTE"``, ...): the tier's name in counters and plans."""
        return self.store.medium
