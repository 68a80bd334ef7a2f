"""Attaching tiers below the CPU store (disk, remote) to the tier manager.

What they change (admission finds prefixes below the CPU and stages them up;
blocks leaving the CPU go down) is in :mod:`~tiered_kv.manager.tier_moves`.
Part of :class:`~tiered_kv.manager.TierManager` (see :mod:`.manager_state`).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError
from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.manager_state import ManagerState
from tiered_kv.manager.outcomes import LoadDecision
from tiered_kv.manager.tier_moves import TierMoves
from tiered_kv.tiers.lower_tier import LowerTier


class TierAttach(ManagerState):
    """The attach of the tiers below the CPU store, and what admission decided about them."""

    @exclusive
    def attach_tiers(self, tiers: Sequence[LowerTier]) -> None:
        """Put tiers below the CPU store: prefixes load from them, blocks go down to them.

        ``tiers``: :class:`~tiered_kv.tiers.lower_tier.LowerTier` entries from the
        CPU down (each its store, I/O engine, link and the write policy of the hop
        into it).  The manager orders the stores under :attr:`store` into its chain
        (how: :mod:`~tiered_kv.manager.tier_moves`); the caller keeps owning them
        (a :class:`~tiered_kv.tiers.stack.TierStack` closes what it built).

        Raises:
            InvalidArgumentError: a bad entry list (see :func:`~.tier_checks.chain_of`),
                or no CPU tier or no prefix caching to stage through.
            InvalidTransitionError: tiers are attached already.
            Nothing changes then.
        """
        if self._lower is not None:
            raise InvalidTransitionError("tiers below the CPU are attached already")
        if self.store is None or self._off is None or not self.caching:
            raise InvalidArgumentError("tiers below the CPU need a CPU tier (num_cpu_blocks > 0) and prefix caching")
        self._lower = TierMoves(
            tiers, self.store, self.transfers, self._off, self.cost_model, self.decision_log.capacity
        )

    @property
    def load_log(self) -> BoundedLog[LoadDecision]:
        """Why admission loaded (or recomputed) what it found below the CPU, one entry per such admission.

        The latest ``log_size`` entries (the manager's argument); ``total`` counts them all.
        """
        return self._lower.decisions if self._lower is not None else BoundedLog(self.decision_log.capacity)
