"""The tier manager's queries: where a request's KV is, what fits, what is in flight, the counters.

Nothing here changes state.  Part of :class:`~tiered_kv.manager.TierManager`
(see :mod:`.manager_state`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.invariants import check_ownership
from tiered_kv.manager.manager_state import ManagerState
from tiered_kv.manager.metrics import MetricsSnapshot, TierCounters, snapshot
from tiered_kv.manager.states import MODES, Residency
from tiered_kv.transfer.plan import TransferHandle, TransferPlan


class Inspection(ManagerState):
    """What a scheduler or a test may ask the tier manager; nothing here changes state."""

    @exclusive
    def residency(self, request_id: Hashable) -> Residency:
        """Where the request's KV is (raises for a request the manager holds nothing for)."""
        return self._get(request_id).residency

    @exclusive
    def holds(self, request_id: Hashable) -> bool:
        """Whether the manager holds anything for the request."""
        return checks.hashable("request_id", request_id) in self._held

    @exclusive
    def requests(self) -> list[Hashable]:
        """Requests the manager holds KV for, in the order it took them."""
        return list(self._held)

    @exclusive
    def gpu_block_ids(self, request_id: Hashable) -> list[int]:
        """The request's GPU block table (append-only while it lives on the GPU)."""
        return self.gpu.get_block_ids(self._get(request_id).request.request_id)

    @exclusive
    def num_gpu_blocks(self, request_id: Hashable) -> int:
        """How many blocks the request's GPU block table holds (``len(gpu_block_ids(...))`` without the list)."""
        return len(self.gpu.get_blocks(self._get(request_id).request.request_id))

    @exclusive
    def cpu_block_ids(self, request_id: Hashable) -> list[int]:
        """The CPU slots of a swapped request's KV, in block order (fixed while it is swapped)."""
        s = self._get(request_id).swapped
        return list(s.spec.block_ids) if s is not None else []

    @exclusive
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.block_pool.get_num_free_blocks()

    @exclusive
    def blocks_short(self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """GPU blocks ``allocate`` would lack right now for these tokens (0 if it fits)."""
        h = self._get(request_id, Residency.GPU, Residency.SWAPPING_IN)
        req = (h if h.layered else self._get(request_id, Residency.GPU)).request
        need = self.gpu.num_blocks_to_allocate(req, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        return max(need - self.gpu.block_pool.get_num_free_blocks(), 0)

    @exclusive
    def blocks_to_resume(self, request_id: Hashable, num_new_tokens: int = 0) -> int:
        """Free GPU blocks that ``resume`` and then ``allocate(num_new_tokens)`` of a swapped request would take now.

        Its blocks still cached on the GPU count only if no one holds them (a
        free cached block leaves the free queue when it is hit again); the rest
        are new blocks.  A scheduler resumes a request only when this fits, as
        vLLM resumes one only with room for the tokens it computes next, so a
        resumed request is not left holding its KV unable to take one step.
        """
        h = self._get(request_id, Residency.CPU)
        checks.count("num_new_tokens", num_new_tokens)
        assert self._swap is not None and h.swapped is not None
        hits = self._swap.gpu_hits(h.request, h.swapped)
        total = -(-(h.swapped.num_tokens + num_new_tokens) // self.block_size)
        return total - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)

    @exclusive
    def blocks_freed_on_completion(self) -> int:
        """GPU blocks that copies in flight will free when they settle (swap-outs, saves before eviction).

        A scheduler that cannot allocate counts these before it preempts anyone:
        waiting for a copy is cheaper than a preemption.
        """
        return self.transfers.blocks_freed_on_completion(self.gpu)

    @exclusive
    def plans_in_flight(self) -> list[TransferPlan]:
        return [t.plan for t in self.transfers]

    @exclusive
    def handle(self, plan_id: int) -> TransferHandle | None:
        t = self.transfers.get(checks.count("plan_id", plan_id))
        return t.handle if t is not None else None

    @exclusive
    def preemption_bounds(
        self, request_ids: Sequence[Hashable], mode: str = "auto", lookups: bool = True
    ) -> list[float]:
        """Cheap lower bounds of the cost-aware key of requests on the GPU, for pruning a ranking.

        For each request, a value never above ``q.cost(mode) / q.blocks_freed``
        of its :meth:`quote` ``q`` now (``inf`` where it frees nothing), from
        counts kept as tables change and a few lookups instead of a scan of its
        table (see :mod:`~tiered_kv.manager.preempt_bounds`).  ``lookups``:
        look up a few of each request's latest blocks in the CPU tier (a
        tighter bound, for a little more).  Raises for a request that is not
        on the GPU.
        """
        checks.choice("mode", mode, MODES)
        checks.flag("lookups", lookups)
        if request_ids.__class__ is not list and request_ids.__class__ is not tuple:
            raise InvalidArgumentError(f"request_ids must be a list or tuple, got {checks.describe(request_ids)}")
        gpu = Residency.GPU
        try:
            held = list(map(self._held.get, request_ids))
        except TypeError:
            held = [None]  # an unhashable id: _get names it
        if any(h is None or h.residency is not gpu for h in held):
            held = [self._get(rid, gpu) for rid in request_ids]  # raises, naming the first not on the GPU
        return self._bounds.lower_bounds([h.request for h in held], mode, self._swap, lookups)  # type: ignore[union-attr]

    @exclusive
    def cpu_room(self) -> int:
        """CPU store blocks a store could take now: free ones plus unpinned cached ones it may evict."""
        return self.store.num_free + self.store.num_evictable if self.store is not None else 0

    @property
    def counters(self) -> TierCounters:
        """The manager's monotonic counters, live: every field reads what has happened so far.

        Most are counted as things happen; the two whose owner is elsewhere are
        read from it here (``plans_submitted`` from the copies in flight,
        ``cpu_blocks_evicted`` from the CPU store's statistics), so no field
        waits for a :meth:`metrics` snapshot.  The object is the manager's own:
        take :meth:`metrics` (or ``counters.copy()``) for values that stay put.
        """
        c = self._counters
        c.plans_submitted = self.transfers.submitted
        if self.store is not None:
            c.cpu_blocks_evicted = self.store.stats.evictions
        return c

    @exclusive
    def metrics(self) -> MetricsSnapshot:
        """Counters (evictions as of the last ``poll``) and the gauges of this instant."""
        residencies = [h.residency for h in self._held.values()]
        t, low, pool = self.transfers, self._lower, self.gpu.block_pool
        lower = (low.counters, low.lost_blocks) if low is not None else ({}, 0)
        return snapshot(self.counters, t.submitted, len(t), pool, self.store, residencies, *lower)

    @exclusive
    def check_invariants(self) -> None:
        """Assert ownership: every GPU ref is a table entry or a copy's hold; every store pin a swap's or a load's.

        With tiers below the CPU: also every store's invariants, and that every
        move of the chain in flight pins its source and keeps its destination pending.
        Also that the per-request counts behind :meth:`preemption_bounds` are
        what a fresh scan of each table finds, and that no request on the GPU
        has its partial tail's key in the CPU store (the bounds assume it).
        """
        swapped = {rid: h.swapped.keys if h.swapped is not None else None for rid, h in self._held.items()}
        low = self._lower
        check_ownership(self.gpu, self.store, self.transfers, swapped, low.cpu_pins() if low is not None else None)
        if low is not None:
            low.check_invariants()
        self._bounds.check()
        if self._swap is not None:
            self._swap.check_tails(h.request for h in self._held.values() if h.residency is Residency.GPU)
