"""Attaching tiers below the CPU store (disk, remote) to the tier manager.

What they change (admission finds prefixes below the CPU and stages them up;
blocks leaving the CPU go down) is in :mod:`~tiered_kv.manager.lower_tiers`.
Part of :class:`~tiered_kv.manager.TierManager` (see :mod:`.manager_state`).
"""

from __future__ import annotations

from collections.abc import Mapping

from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError
from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.cost_model import TierLink
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.lower_tiers import LowerTiers
from tiered_kv.manager.manager_state import ManagerState
from tiered_kv.manager.outcomes import LoadDecision
from tiered_kv.tiers.chain import TierChain
from tiered_kv.transfer.engine import CopyEngine


class TierAttach(ManagerState):
    """The attach of the tiers below the CPU store, and what admission decided about them."""

    @exclusive
    def attach_tiers(
        self, chain: TierChain, engines: Mapping[str, CopyEngine], links: Mapping[str, TierLink] | None = None
    ) -> None:
        """Put tiers below the CPU store (disk, remote): prefixes load from them, blocks go down to them.

        How: :mod:`~tiered_kv.manager.lower_tiers`.

        ``chain``: a :class:`tiered_kv.tiers.TierChain` whose first tier is :attr:`store`;
        ``engines``: medium -> its I/O engine; ``links``: medium -> :class:`~.cost_model.TierLink`
        (default :data:`~.cost_model.DEFAULT_TIER_LINKS`).  Raises :class:`InvalidArgumentError`
        (see :func:`~.tier_checks.check_tiers`) or :class:`InvalidTransitionError`; nothing changes then.
        """
        if self._lower is not None:
            raise InvalidTransitionError("tiers below the CPU are attached already")
        if self.store is None or self._off is None or not self.caching:
            raise InvalidArgumentError("tiers below the CPU need a CPU tier (num_cpu_blocks > 0) and prefix caching")
        self._lower = LowerTiers(
            chain, engines, links, self.store, self.transfers, self._off, self.cost_model, self.decision_log.capacity
        )

    @property
    def load_log(self) -> BoundedLog[LoadDecision]:
        """Why admission loaded (or recomputed) what it found below the CPU, one entry per such admission.

        The latest ``log_size`` entries (the manager's argument); ``total`` counts them all.
        """
        return self._lower.decisions if self._lower is not None else BoundedLog(self.decision_log.capacity)
