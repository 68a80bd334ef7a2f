"""TierManager: where every request's KV lives, across a prefix-cached GPU pool and a CPU store.

A thin front over parts that each own one fact: the GPU pool and block tables
(:class:`~tiered_kv.core.KVCacheManager`), the CPU store keyed by block hash
(:mod:`.store`), the copies in flight and what they hold (:mod:`.transfers`),
and the prices of preemption (:mod:`.pricing`).  It returns outcomes and never
writes a request's progress (the scheduler's) or touches tensor data.

A block that a copy reads or writes is never handed to a new owner: copies hold
the GPU blocks they read, loads pin the store blocks they read, destinations
are fresh blocks nobody can hit until the copy lands, and a failed or
cancelled copy leaves the KV where it was.  Not thread-safe: a second thread
entering raises :class:`~tiered_kv.errors.ConcurrentUseError`.

This module holds the front's verbs that move a request between tiers
(admit, allocate, quote, preempt, resume, drop, free).  The rest of the class
comes from parts over one shared state (:mod:`.manager_state`): queries
(:mod:`.inspection`), write-through stores (:mod:`.write_through`), settling
of final copies (:mod:`.settling`, which ``poll`` and ``cancel`` live in) and
tiers below the CPU store (disk, remote), attached with
:meth:`TierManager.attach_tiers` (:mod:`.tier_attach`; what they change is in
:mod:`~tiered_kv.manager.tier_moves`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.hashing import HashFn
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import ConcurrentUseError, InvalidArgumentError, InvalidTransitionError
from tiered_kv.manager.bounded_log import DEFAULT_LOG_SIZE, BoundedLog
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.inspection import Inspection
from tiered_kv.manager.manager_state import Held
from tiered_kv.manager.metrics import TierCounters
from tiered_kv.manager.offload import Offloader
from tiered_kv.manager.outcomes import Admission, Decision, Preemption, Resumption
from tiered_kv.manager.preempt_bounds import PreemptBounds
from tiered_kv.manager.pricing import Quote, checked_cost_model, price
from tiered_kv.manager.settling import Settling
from tiered_kv.manager.states import IN_FLIGHT, MODES, PreemptMode, Residency
from tiered_kv.manager.swap import Swapper
from tiered_kv.manager.tier_attach import TierAttach
from tiered_kv.manager.tier_moves import TierMoves
from tiered_kv.manager.transfers import Transfer, Transfers
from tiered_kv.manager.write_through import WriteThrough
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.store import RequestContext
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.plan import CPU, GPU

OFFLOAD_POLICIES = ("none", "write_through", "on_evict")
_GPU = Residency.GPU  # read per call of allocate: a module constant is much cheaper than the enum's attribute


def _check_engine_tiers(engine: CopyEngine, num_gpu_blocks: object, num_cpu_blocks: int) -> None:
    """Refuse an engine that cannot execute this manager's plans, before any plan fails for it.

    Plans name their media ``"GPU"`` and ``"CPU"`` and use block ids up to the
    manager's pool sizes; an engine over storages named otherwise, or smaller,
    would fail every copy.  Engines that do not say their sizes
    (``tier_sizes()``) are not checked here; their plans still validate on submit.
    """
    tier_sizes = getattr(engine, "tier_sizes", None)
    sizes = tier_sizes() if callable(tier_sizes) else None
    if not isinstance(sizes, dict):
        return
    needed = {GPU: num_gpu_blocks, CPU: num_cpu_blocks} if num_cpu_blocks else {GPU: num_gpu_blocks}
    for medium, n in needed.items():
        have = sizes.get(medium)
        if have is None:
            raise InvalidArgumentError(
                f"copy_engine has no {medium!r} tier (its tiers: {sorted(map(str, sizes))}); the manager's plans "
                f"name their media {sorted(needed)}: key the engine's storages by those names"
            )
        if not isinstance(have, int) or (isinstance(n, int) and have < n):
            raise InvalidArgumentError(
                f"copy_engine's {medium} tier holds {have!r} blocks, fewer than the manager's {n}-block "
                f"{medium} pool: every copy to or from its last blocks would fail; give the engine a storage "
                f"of at least {n} blocks"
            )


class TierManager(Inspection, WriteThrough, Settling, TierAttach):
    """A prefix-cached GPU pool and a CPU store under one manager.

    Args:
        num_gpu_blocks: GPU pool size, null block included.
        num_cpu_blocks: CPU store size, reserved block 0 included (0: no CPU tier).
        block_size: Tokens per block.
        copy_engine: Executes plans (``submit``/``cancel``).
        kv_spec: The KV geometry of the tiers; bytes per block come from it.
            Default: the copy engine's (``engine.spec``), else the cost model's.
        cost_model: Swap and recompute estimates; refused if built for another
            KV shape.  Default: one built from ``kv_spec``.
        offload: CPU prefix-tier policy: ``"none"``, ``"write_through"`` (full
            prompt blocks stored once computed) or ``"on_evict"`` (cached GPU
            blocks nearing eviction stored first; see :meth:`poll`).
        store_policy: Eviction policy of the CPU store (``"lru"``, ``"arc"``).
        enable_caching: Prefix caching.  Off: nothing is hashed or cached; swaps
            still work, per request.  ``offload`` needs it.
        hash_fn / hash_seed: Block hashing (shared by both tiers).
        evict_window: With ``offload="on_evict"``, how many blocks at the
            eviction end of the GPU free queue are kept stored on the CPU.
        log_size: Entries :attr:`decision_log` and :attr:`load_log` keep: the
            latest ones, so a long run's memory does not grow with its
            requests (each log's ``total`` counts every entry); ``None`` keeps all.

    Attributes:
        decision_log: Why each preemption took its mode (a :class:`~.bounded_log.BoundedLog`
            of :class:`~.outcomes.Decision`, the latest ``log_size``).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        copy_engine: CopyEngine,
        *,
        kv_spec: KVSpec | None = None,
        cost_model: CostModel | None = None,
        offload: str = "none",
        store_policy: str = "lru",
        enable_caching: bool = True,
        hash_fn: str | HashFn = "sha256",
        hash_seed: int = 0,
        evict_window: int = 64,
        log_size: int | None = DEFAULT_LOG_SIZE,
    ) -> None:
        checks.choice("offload", offload, OFFLOAD_POLICIES)
        if num_cpu_blocks.__class__ is not int or num_cpu_blocks < 0 or num_cpu_blocks == 1:
            raise InvalidArgumentError(
                f"num_cpu_blocks must be 0 or an int >= 2, got {checks.describe(num_cpu_blocks)}"
            )
        checks.flag("enable_caching", enable_caching)
        checks.count("evict_window", evict_window, 1)
        if log_size is not None:
            checks.count("log_size", log_size, 1)
        if offload != "none" and not enable_caching:
            raise InvalidArgumentError(f"offload={offload!r} keeps a CPU prefix tier, which needs prefix caching")
        if not all(callable(getattr(copy_engine, n, None)) for n in ("submit", "cancel")):
            raise InvalidArgumentError(
                f"copy_engine must have submit() and cancel(), got {checks.describe(copy_engine)}"
            )
        _check_engine_tiers(copy_engine, num_gpu_blocks, num_cpu_blocks)
        self.gpu = KVCacheManager(
            num_gpu_blocks,
            block_size,
            enable_caching=enable_caching,
            hash_fn=hash_fn,
            hash_seed=hash_seed,
        )
        self.cost_model = checked_cost_model(kv_spec, cost_model, copy_engine, block_size)
        spec = kv_spec if kv_spec is not None else getattr(copy_engine, "spec", None)
        #: KV layers, for layer-wise copies (0: unknown, no kv_spec and an engine without one).
        self.num_layers = spec.num_layers if isinstance(spec, KVSpec) else 0
        self.block_size = block_size
        self.caching = enable_caching
        self.store: CPUStore | None = CPUStore(num_cpu_blocks, store_policy) if num_cpu_blocks else None
        self.offload = offload if self.store is not None else "none"
        self.evict_window = evict_window
        tr = self.transfers = Transfers(copy_engine, self.gpu.block_pool)
        b = self._bounds = PreemptBounds(self.gpu, self.cost_model)  # told of every hold and release
        tr.on_hold, tr.on_release = b.acquired, b.released
        self._swap = Swapper(self.gpu, self.store, tr, enable_caching, b.free_table, b.acquired) if self.store else None
        #: The CPU store's view of each admitted request that has not finished (vLLM 0.33's request scope).
        self._store_requests: dict[Hashable, RequestContext] = {}
        self._off = Offloader(self.gpu, self.store, tr, b.free_table, self._store_requests) if self.store else None
        self._counters = TierCounters()
        self.decision_log: BoundedLog[Decision] = BoundedLog(log_size)
        self._lower: TierMoves | None = None
        self._held: dict[Hashable, Held] = {}
        self._tick = 0
        self._gpu_evicted_seen = 0  # the GPU pool's eviction count at the last poll
        self._lock = threading.RLock()

    # ============================================================ admission
    @exclusive
    def admit(self, request: Request, max_new_tokens: int, num_lookahead_tokens: int = 0) -> Admission | None:
        """First allocation of a request: prefix lookup on the GPU, then the CPU store; ``None`` if it does not fit.

        GPU hits are touched.  CPU hits are pinned and loaded into fresh GPU
        blocks by an ONBOARD plan; the request may run once it lands.  New
        tokens start after every hit and are capped at ``max_new_tokens``.
        Every argument is checked before anything changes.
        """
        checks.instance("request", request, Request)
        checks.count("max_new_tokens", max_new_tokens, 1)
        checks.count("num_lookahead_tokens", num_lookahead_tokens)
        rid = request.request_id
        if rid in self._held:
            raise InvalidTransitionError(f"request {rid!r} is already held ({self._held[rid].residency.value})")
        if request.num_computed_tokens != 0:
            raise InvalidArgumentError(
                f"request {rid!r}: a request to admit has no computed tokens, got {request.num_computed_tokens}"
            )
        gpu_hits, n_gpu = self.gpu.get_computed_blocks(request)
        lower = self._lower
        found = lower.find(request, len(gpu_hits), n_gpu) if lower is not None else None
        if found is not None:
            keys = found.keys
        else:
            keys = self._off.cpu_hits(request, len(gpu_hits)) if self._off is not None and self.caching else []
        n_cpu = len(keys) * self.block_size
        n_new = min(max_new_tokens, request.num_tokens - n_gpu - n_cpu)
        need = self.gpu.num_blocks_to_allocate(request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens)
        if need > self.gpu.block_pool.get_num_free_blocks():
            return None
        if found is not None:  # fits: pin and stage now (fewer blocks need no more room)
            reserved = lower.reserve(found)  # type: ignore[union-attr]
            keys, n_cpu = reserved.keys, len(reserved.keys) * self.block_size
            n_new = min(max_new_tokens, request.num_tokens - n_gpu - n_cpu)
        new = self.gpu.allocate_slots(
            request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens, num_external_computed_tokens=n_cpu
        )
        assert new is not None, "allocation was checked to fit"
        if gpu_hits:
            self._bounds.acquired(gpu_hits)
        h = self._held[rid] = Held(request, Residency.GPU)
        self._open_in_store(request)
        self._counters.count_lookup(request.num_tokens, n_gpu, n_cpu, self.store is not None)
        plan = None
        if keys:
            assert self._off is not None
            dst = list(self.gpu.get_blocks(rid)[len(gpu_hits) : len(gpu_hits) + len(keys)])
            if found is not None:  # staging through the CPU tier: nothing to cancel until the GPU copy starts
                t, staging = lower.start(reserved, dst, n_gpu)  # type: ignore[union-attr]
            else:
                t, staging = self._off.start_load(request, keys, dst, n_gpu + n_cpu), False
            h.residency, h.plan_id, plan = Residency.LOADING, None if staging else t.plan.plan_id, t.plan
            h.num_hit_tokens = n_gpu
        self._tick += 1
        return Admission(new, n_gpu, n_cpu, n_new, plan)

    def allocate(
        self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """Grow a request whose KV is on the GPU; ``None`` (nothing changed) if it does not fit.

        A request in a layer-wise swap-in may grow too (it computes while its KV
        lands); nothing of it is cached until the load has landed.
        """
        # The per-token hot path of every step: the entry guard and the lookup are inlined.
        lock = self._lock
        if not lock.acquire(False):
            raise ConcurrentUseError(
                "TierManager.allocate was called while another thread is inside it; "
                "a TierManager is single-threaded: drive it from one thread at a time"
            )
        try:
            try:
                h = self._held.get(request_id)
            except TypeError:
                h = None  # unhashable: _get names the problem
            if h is None or h.residency is not _GPU:
                h = self._get(request_id, Residency.GPU, Residency.SWAPPING_IN)
                if not h.layered:
                    h = self._get(request_id, Residency.GPU)  # names the state it is in
                # Its restored blocks are being written: cache nothing until the load lands.
                return self.gpu.allocate_slots(
                    h.request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens, delay_cache_blocks=True
                )
            return self.gpu.allocate_slots(h.request, num_new_tokens, 0, None, num_lookahead_tokens)
        finally:
            lock.release()

    @exclusive
    def quiet_tokens(self, request_id: Hashable) -> int:
        """The most tokens (computed plus new) ``allocate`` serves for the request without changing anything.

        ``allocate(request_id, n)`` with ``num_computed_tokens + n`` at most
        this value returns ``[]`` and changes no state, so a scheduler may skip
        it.  Valid until the request's KV leaves the GPU or a copy of it
        settles (a layer-wise load landing starts caching), whichever is first.
        Raises as ``allocate`` does for a request not on the GPU.
        """
        h = self._get(request_id, Residency.GPU, Residency.SWAPPING_IN)
        if h.residency is not _GPU:
            if not h.layered:
                self._get(request_id, Residency.GPU)  # raises, naming the state it is in
            return self.gpu.num_quiet_tokens(request_id, delay_cache_blocks=True)
        return self.gpu.num_quiet_tokens(request_id)

    # =========================================================== preemption
    @exclusive
    def quote(self, request_id: Hashable) -> Quote:
        """What preempting a request whose KV is on the GPU would cost, by swap and by recompute."""
        req = self._get(request_id, Residency.GPU).request
        if self._swap is None:
            table = self.gpu.get_blocks(request_id)
            freed = [b.block_id for b in table if b.ref_cnt == 1]
            return price(self.cost_model, request_id, req.num_computed_tokens, len(table), freed, [], 0, False, False)
        return self._swap.quote(req, self.cost_model)

    @exclusive
    def preempt(self, request_id: Hashable, mode: str = "auto") -> Preemption | None:
        """Preempt one request whose KV is on the GPU, by the mode its quote chooses under ``mode``.

        Recompute frees its GPU blocks now and forgets the request; swap starts
        a swap-out whose GPU blocks free when it lands.  ``mode="swap"`` where
        no swap is possible (no CPU tier, no room on it, or no computed token:
        nothing to swap) returns ``None`` and changes nothing; ``"auto"`` then
        recomputes and the decision log says why.
        """
        checks.choice("mode", mode, MODES)
        h = self._get(request_id, Residency.GPU)
        q = self.quote(request_id)
        chosen, reason = q.choose(mode)
        if chosen is None:
            return None
        if chosen is PreemptMode.SWAP and q.num_tokens == 0:
            if mode == "swap":  # forced, and impossible: refused like any other impossible swap
                return None
            chosen, reason = PreemptMode.RECOMPUTE, f"nothing is computed yet, so there is nothing to swap; {reason}"
        plan = None
        if chosen is PreemptMode.SWAP:
            assert self._swap is not None
            out = self._swap.start_out(h.request, q.num_tokens)
            if out is None:  # the quote said there was room: only an inconsistent store gets here
                return None
            if isinstance(out, Transfer):
                h.residency, h.plan_id, plan = Residency.SWAPPING_OUT, out.plan.plan_id, out.plan
            else:  # every block already on the CPU: swapped at once
                h.residency, h.swapped, h.num_stored_blocks = Residency.CPU, out, 0
            self._counters.preemptions_swap += 1
            now, later = (0, q.blocks_freed) if plan is not None else (q.blocks_freed, 0)
        else:
            self._forget(h)
            self._counters.preemptions_recompute += 1
            now, later = q.blocks_freed, 0
        self._tick += 1
        self.decision_log.append(Decision(self._tick, request_id, mode, chosen, reason, q))
        res = h.residency if request_id in self._held else None
        return Preemption(request_id, chosen, reason, plan, now, later, res)

    @exclusive
    def resume(self, request_id: Hashable, layered: bool = False) -> Resumption | None:
        """Bring a swapped request back: re-hit what is still cached on the GPU, copy the rest in.

        ``layered``: copy layer by layer, one completion per layer, so the
        request can compute while its KV lands (layer ``i``'s attention waits
        for layer ``i`` only); it may :meth:`allocate` while SWAPPING_IN, and
        a failed load rolls back whatever it grew.  ``None`` (nothing changed)
        when the GPU blocks do not fit.
        """
        h = self._get(request_id, Residency.CPU)
        checks.flag("layered", layered)
        if layered and not self.num_layers:
            raise InvalidArgumentError("a layer-wise swap-in needs the KV's layer count: give the manager kv_spec=")
        assert self._swap is not None and h.swapped is not None
        out = self._swap.start_in(h.request, h.swapped, self.num_layers if layered else 0)
        if out is None:
            return None
        self._tick += 1
        if isinstance(out, Transfer):
            h.residency, h.plan_id, h.layered = Residency.SWAPPING_IN, out.plan.plan_id, layered
            return Resumption(request_id, h.swapped.num_tokens, out.plan)
        n = h.swapped.num_tokens
        self._swap.finish_in(h.request, h.swapped)
        h.residency, h.swapped = Residency.GPU, None
        return Resumption(request_id, n, None)

    @exclusive
    def drop_swapped(self, request_id: Hashable) -> None:
        """Give up a swapped request's CPU copy: it will be recomputed (the scheduler resets its progress)."""
        self._forget(self._get(request_id, Residency.CPU))
        self._counters.swaps_dropped += 1

    @exclusive
    def free(self, request_id: Hashable) -> None:
        """Release everything the request holds in both tiers (finished or aborted).  Refused mid-copy."""
        h = self._get(request_id)
        if h.residency in IN_FLIGHT:
            raise InvalidTransitionError(
                f"request {request_id!r} is {h.residency.value} (plan {h.plan_id} in flight); "
                "cancel the copy or wait for it before freeing"
            )
        self._forget(h)
        ctx = self._store_requests.pop(request_id, None)
        if ctx is not None:  # finished: the store commits the request's recency (its copies may still land)
            self.store.on_request_finished(ctx)  # type: ignore[union-attr]

    def _open_in_store(self, request: Request) -> None:
        """Admission is a new request for the CPU store; a re-admission (after a preemption) is the same one.

        Positions are each prompt block's end token, so the store ranks a
        request's tail before its head.
        """
        store = self.store
        if store is None:
            return
        rid = request.request_id
        ctx = self._store_requests.get(rid)
        if ctx is None:
            ctx = RequestContext(rid)
            store.on_new_request(ctx)
            self._store_requests[rid] = ctx
        if request.block_hashes:
            ctx.set_positions(list(request.block_hashes), self.block_size, self.block_size)

    @exclusive
    def on_schedule_end(self, new_req_ids: list[Hashable], preempted_req_ids: list[Hashable]) -> None:
        """The end of a scheduler step: the CPU store's ``on_schedule_end`` (vLLM 0.33's step hook)."""
        if self.store is not None:
            self.store.on_schedule_end(new_req_ids, preempted_req_ids)

    def _forget(self, h: Held) -> None:
        self._bounds.free_table(h.request)
        if h.swapped is not None:
            assert self._swap is not None
            self._swap.release(h.swapped)
        del self._held[h.request.request_id]
