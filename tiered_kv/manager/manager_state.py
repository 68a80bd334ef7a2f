"""What the tier manager holds, shared by the parts of :class:`~tiered_kv.manager.TierManager`.

The tier manager is one object assembled from a few parts, each in its own
module: inspection (:mod:`.inspection`), layer-wise and write-through stores
(:mod:`.write_through`), settling of copies (:mod:`.settling`) and the attach
of the tiers below the CPU (:mod:`.tier_attach`).  They all read and write the
state declared here, which :class:`TierManager.__init__` builds; this base
declares it once (for readers and type checkers) and gives the parts the one
lookup of a held request that checks its residency.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, UnknownRequestError
from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.metrics import TierCounters
from tiered_kv.manager.offload import Offloader
from tiered_kv.manager.outcomes import Decision
from tiered_kv.manager.preempt_bounds import PreemptBounds
from tiered_kv.manager.states import Residency
from tiered_kv.manager.swap import SwappedKV, Swapper
from tiered_kv.manager.tier_moves import TierMoves
from tiered_kv.manager.transfers import Transfers
from tiered_kv.tiers.cpu_store import CPUStore


@dataclass(slots=True)
class Held:
    """What the manager holds for one request."""

    request: Request
    residency: Residency
    plan_id: int | None = None
    swapped: SwappedKV | None = None  # the pinned CPU copy while swapped out or swapping in
    num_stored_blocks: int = 0  # write-through progress (prompt blocks)
    layered: bool = False  # a layer-wise swap-in: computing while its KV lands layer by layer
    num_hit_tokens: int = 0  # while LOADING: its prefix found on the GPU at admission (computed already)


class ManagerState:
    """The tier manager's state, declared once; built by :class:`~tiered_kv.manager.TierManager`."""

    gpu: KVCacheManager
    cost_model: CostModel
    num_layers: int
    block_size: int
    caching: bool
    store: CPUStore | None
    offload: str
    evict_window: int
    transfers: Transfers
    _counters: TierCounters  # read through the live ``counters`` property (:mod:`.inspection`)
    decision_log: BoundedLog[Decision]
    _swap: Swapper | None
    _bounds: PreemptBounds
    _off: Offloader | None
    _lower: TierMoves | None
    _held: dict[Hashable, Held]
    _tick: int
    _gpu_evicted_seen: int
    _lock: threading.RLock

    def _get(self, request_id: Hashable, *allowed: Residency) -> Held:
        """The held request, checked to be in one of ``allowed`` (any residency if none are given)."""
        try:
            h = self._held[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not held by this tier manager") from None
        except TypeError:
            raise InvalidArgumentError(f"request_id must be a hashable id, got {checks.describe(request_id)}") from None
        if allowed and h.residency not in allowed:
            want = " or ".join(r.value for r in allowed)
            raise InvalidTransitionError(f"request {request_id!r} is {h.residency.value}, not {want}")
        return h
