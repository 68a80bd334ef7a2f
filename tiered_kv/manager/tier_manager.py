"""TierManager: where every request's KV lives, across a prefix-cached GPU pool and a CPU store.

A thin front over four parts, each the one owner of its fact:

* the GPU pool and block tables (:class:`~tiered_kv.core.KVCacheManager`);
* the CPU tier, a hash-keyed store (:mod:`tiered_kv.manager.store`);
* the copies in flight and the blocks they hold (:mod:`.transfers`);
* the prices of preemption (:mod:`.pricing`).

It returns outcomes and never writes a request's progress: the scheduler is
the one owner of ``num_computed_tokens`` and applies what comes back.  It
never touches tensor data either, so every decision is tested on the CPU with
a copy engine whose completions the test controls.

A block that a copy reads or writes is never handed to a new owner: copies hold
the GPU blocks they read, loads pin the store blocks they read, and destinations
are fresh blocks nobody can hit until the copy has landed.  A failed or
cancelled copy leaves the request's KV where it was.

Not thread-safe: one thread drives a manager; a second thread entering while the
first is inside raises :class:`~tiered_kv.errors.ConcurrentUseError`.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.hashing import HashFn
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, UnknownRequestError
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.cpu_store import CPUStore
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.metrics import MetricsSnapshot, TierCounters
from tiered_kv.manager.offload import Offloader
from tiered_kv.manager.outcomes import Admission, Completion, Decision, Preemption, Resumption
from tiered_kv.manager.pricing import Quote, price
from tiered_kv.manager.states import IN_FLIGHT, MODES, PreemptMode, Residency
from tiered_kv.manager.swap import SwappedKV, Swapper
from tiered_kv.manager.transfers import Transfer, Transfers
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan

OFFLOAD_POLICIES = ("none", "write_through", "on_evict")


@dataclass(slots=True)
class _Held:
    """What the manager holds for one request."""

    request: Request
    residency: Residency
    plan_id: int | None = None
    swapped: SwappedKV | None = None  # the pinned CPU copy while swapped out or swapping in
    num_stored_blocks: int = 0  # write-through progress (prompt blocks)


class TierManager:
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
    ) -> None:
        checks.choice("offload", offload, OFFLOAD_POLICIES)
        if num_cpu_blocks.__class__ is not int or num_cpu_blocks < 0 or num_cpu_blocks == 1:
            raise InvalidArgumentError(
                f"num_cpu_blocks must be 0 or an int >= 2, got {checks.describe(num_cpu_blocks)}"
            )
        checks.flag("enable_caching", enable_caching)
        checks.count("evict_window", evict_window, 1)
        if offload != "none" and not enable_caching:
            raise InvalidArgumentError(f"offload={offload!r} keeps a CPU prefix tier, which needs prefix caching")
        if not all(callable(getattr(copy_engine, n, None)) for n in ("submit", "cancel")):
            raise InvalidArgumentError(
                f"copy_engine must have submit() and cancel(), got {checks.describe(copy_engine)}"
            )
        self.gpu = KVCacheManager(
            num_gpu_blocks, block_size, enable_caching=enable_caching, hash_fn=hash_fn, hash_seed=hash_seed
        )
        self.cost_model = _checked_cost_model(kv_spec, cost_model, copy_engine, block_size)
        self.block_size = block_size
        self.caching = enable_caching
        self.store: CPUStore | None = CPUStore(num_cpu_blocks, store_policy) if num_cpu_blocks else None
        self.offload = offload if self.store is not None else "none"
        self.evict_window = evict_window
        self.transfers = Transfers(copy_engine, self.gpu.block_pool)
        self._swap = Swapper(self.gpu, self.store, self.transfers, enable_caching) if self.store else None
        self._off = Offloader(self.gpu, self.store, self.transfers) if self.store else None
        self.counters = TierCounters()
        self.decision_log: list[Decision] = []
        self._held: dict[Hashable, _Held] = {}
        self._tick = 0
        self._lock = threading.RLock()

    # ============================================================ inspection
    def _get(self, request_id: Hashable, *allowed: Residency) -> _Held:
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
        req = self._get(request_id, Residency.GPU).request
        need = self.gpu.num_blocks_to_allocate(req, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        return max(need - self.gpu.block_pool.get_num_free_blocks(), 0)

    @exclusive
    def blocks_freed_on_completion(self) -> int:
        """GPU blocks that copies in flight will free when they settle (swap-outs, saves before eviction).

        A scheduler that cannot allocate counts these before it preempts anyone:
        waiting for a copy is cheaper than a preemption.
        """
        n = 0
        for t in self.transfers:
            if t.plan.kind is PlanKind.SWAP_OUT:
                n += sum(1 for b in self.gpu.get_blocks(t.plan.request_id) if b.ref_cnt == 1)
            else:
                n += sum(1 for b in t.gpu_holds if b.ref_cnt == 1)
        return n

    @exclusive
    def plans_in_flight(self) -> list[TransferPlan]:
        return [t.plan for t in self.transfers]

    @exclusive
    def handle(self, plan_id: int) -> TransferHandle | None:
        t = self.transfers.get(checks.count("plan_id", plan_id))
        return t.handle if t is not None else None

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
        keys: list = []
        if self.store is not None and self.caching:
            last = (request.num_tokens - 1) // self.block_size  # the last prompt token is always computed
            rest = request.block_hashes[len(gpu_hits) : last]
            keys = list(rest[: self.store.lookup_prefix(rest)])
        n_cpu = len(keys) * self.block_size
        n_new = min(max_new_tokens, request.num_tokens - n_gpu - n_cpu)
        need = self.gpu.num_blocks_to_allocate(request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens)
        if need > self.gpu.block_pool.get_num_free_blocks():
            return None
        new = self.gpu.allocate_slots(
            request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens, num_external_computed_tokens=n_cpu
        )
        assert new is not None, "allocation was checked to fit"
        h = self._held[rid] = _Held(request, Residency.GPU)
        self.counters.count_lookup(request.num_tokens, n_gpu, n_cpu, self.store is not None)
        plan = None
        if keys:
            assert self._off is not None
            dst = self.gpu.get_blocks(rid)[len(gpu_hits) : len(gpu_hits) + len(keys)]
            t = self._off.start_load(request, keys, list(dst), n_gpu + n_cpu)
            h.residency, h.plan_id, plan = Residency.LOADING, t.plan.plan_id, t.plan
        self._tick += 1
        return Admission(new, n_gpu, n_cpu, n_new, plan)

    @exclusive
    def allocate(
        self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """Grow a request whose KV is on the GPU; ``None`` (nothing changed) if it does not fit."""
        h = self._get(request_id, Residency.GPU)
        new = self.gpu.allocate_slots(h.request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        self._tick += 1
        return new

    @exclusive
    def on_tokens_computed(self, request_id: Hashable) -> TransferPlan | None:
        """The step that computed the request's tokens finished: with write-through, store its new full prompt blocks.

        Only steps that computed prompt tokens can complete such blocks, so a
        scheduler may skip the call on decode steps.
        """
        h = self._get(request_id, Residency.GPU)
        if self.offload != "write_through":
            return None
        req = h.request
        upto = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        if upto <= h.num_stored_blocks:
            return None
        assert self._off is not None
        t = self._off.write_through(req, h.num_stored_blocks, upto)
        h.num_stored_blocks = upto
        return t.plan if t is not None else None

    # =========================================================== preemption
    @exclusive
    def quote(self, request_id: Hashable) -> Quote:
        """What preempting a request whose KV is on the GPU would cost, by swap and by recompute."""
        h = self._get(request_id, Residency.GPU)
        req = h.request
        table = self.gpu.get_blocks(req.request_id)
        n_tok = req.num_computed_tokens
        freed = [b.block_id for b in table if b.ref_cnt == 1]
        if self._swap is None:
            return price(self.cost_model, req.request_id, n_tok, len(table), freed, [], 0, False, False)
        assert self.store is not None
        keys, _ = self._swap.kv_keys(req, n_tok)
        moved = [table[i].block_id for i, k in enumerate(keys) if not self.store.contains(k)]
        room = self.store.room_for(keys) >= len(moved)
        return price(self.cost_model, req.request_id, n_tok, len(table), freed, moved, len(moved), room, True)

    @exclusive
    def preempt(self, request_id: Hashable, mode: str = "auto") -> Preemption | None:
        """Preempt one request whose KV is on the GPU, by the mode its quote chooses under ``mode``.

        Recompute frees its GPU blocks now and forgets the request; swap starts
        a swap-out whose GPU blocks free when it lands.  ``mode="swap"`` where
        no swap is possible returns ``None`` and changes nothing; ``"auto"``
        then recomputes and the decision log says why.
        """
        checks.choice("mode", mode, MODES)
        h = self._get(request_id, Residency.GPU)
        q = self.quote(request_id)
        chosen, reason = q.choose(mode)
        if chosen is None:
            return None
        if chosen is PreemptMode.SWAP and q.num_tokens == 0:
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
            self.counters.preemptions_swap += 1
            now, later = (0, q.blocks_freed) if plan is not None else (q.blocks_freed, 0)
        else:
            self._forget(h)
            self.counters.preemptions_recompute += 1
            now, later = q.blocks_freed, 0
        self._tick += 1
        self.decision_log.append(Decision(self._tick, request_id, mode, chosen, reason, q))
        res = h.residency if request_id in self._held else None
        return Preemption(request_id, chosen, reason, plan, now, later, res)

    @exclusive
    def resume(self, request_id: Hashable) -> Resumption | None:
        """Bring a swapped request back: re-hit what is still cached on the GPU, copy the rest in.

        ``None`` (nothing changed) when the GPU blocks do not fit.
        """
        h = self._get(request_id, Residency.CPU)
        assert self._swap is not None and h.swapped is not None
        out = self._swap.start_in(h.request, h.swapped)
        if out is None:
            return None
        self._tick += 1
        if isinstance(out, Transfer):
            h.residency, h.plan_id = Residency.SWAPPING_IN, out.plan.plan_id
            return Resumption(request_id, h.swapped.num_tokens, out.plan)
        n = h.swapped.num_tokens
        self._swap.finish_in(h.request, h.swapped)
        h.residency, h.swapped = Residency.GPU, None
        return Resumption(request_id, n, None)

    @exclusive
    def drop_swapped(self, request_id: Hashable) -> None:
        """Give up a swapped request's CPU copy: it will be recomputed (the scheduler resets its progress)."""
        self._forget(self._get(request_id, Residency.CPU))
        self.counters.swaps_dropped += 1

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

    def _forget(self, h: _Held) -> None:
        self.gpu.free(h.request)
        if h.swapped is not None:
            assert self._swap is not None
            self._swap.release(h.swapped)
        del self._held[h.request.request_id]

    # =============================================================== copies
    @exclusive
    def poll(self) -> list[Completion]:
        """Settle every copy whose handle is final, in plan order; return what settled.

        With on-evict offload it then tops up the saves before eviction: once
        per scheduler step is often enough.
        """
        done = [self._settle(t) for t in self.transfers.finished()]
        if self.offload == "on_evict":
            assert self._off is not None
            self._off.save_window(self.evict_window)
        return done

    @exclusive
    def process_completion(self, handle: TransferHandle) -> Completion:
        """Settle one final handle now (instead of at the next ``poll``).

        Raises:
            PlanError: unknown, settled already, not final, or not the plan this
                manager emitted under its id.  Nothing changes.
        """
        return self._settle(self.transfers.take(checks.instance("handle", handle, TransferHandle)))

    @exclusive
    def cancel(self, request_id: Hashable) -> bool:
        """Cancel the request's copy in flight; True only if it was cancelled, and then it is rolled back now.

        A copy the engine finished first is left for ``poll`` to settle as what
        it is, and the answer is False.
        """
        h = self._get(request_id)
        if h.plan_id is None:
            return False
        self.transfers.cancel(h.plan_id)
        t = self.transfers.get(h.plan_id)
        assert t is not None
        if not t.cancelled:
            return False
        self._settle(self.transfers.take(t.handle))
        return True

    @exclusive
    def cpu_room(self) -> int:
        """CPU store blocks a store could take now: free ones plus unpinned cached ones it may evict."""
        return self.store.num_free + self.store.num_evictable if self.store is not None else 0

    @exclusive
    def wait(self, timeout: float | None = None) -> bool:
        """Block until some copy in flight is final (real engines); False if nothing is in flight."""
        return self.transfers.wait(checks.timeout("timeout", timeout))

    def _settle(self, t: Transfer) -> Completion:
        kind, rid = t.plan.kind, t.plan.request_id
        ok, n_tok = t.ok, 0
        if kind is PlanKind.OFFLOAD:
            assert self._off is not None
            self._off.settle_store(t)
        else:
            h = self._held[rid]
            h.plan_id = None
            if kind is PlanKind.ONBOARD:
                assert self._off is not None
                n_tok = self._off.settle_load(h.request, t)
                if ok:
                    h.residency = Residency.GPU
                else:
                    del self._held[rid]
            elif kind is PlanKind.SWAP_OUT:
                assert self._swap is not None
                swapped = self._swap.settle_out(t)
                ok = swapped is not None  # a copy that landed but left the KV incomplete on the CPU rolls back
                if ok:
                    h.residency, h.swapped, h.num_stored_blocks = Residency.CPU, swapped, 0
                else:
                    h.residency = Residency.GPU
            else:  # SWAP_IN
                assert self._swap is not None and h.swapped is not None
                if self._swap.settle_in(h.request, t):
                    n_tok, h.residency, h.swapped = h.swapped.num_tokens, Residency.GPU, None
                else:
                    h.residency = Residency.CPU
        n = t.plan.num_blocks
        self.counters.count_copy(kind, n, n * self.cost_model.bytes_per_block, ok, t.cancelled)
        p, hd = t.plan, t.handle
        res = self._held[rid].residency if rid in self._held else None
        return Completion(p.plan_id, rid, kind, ok, n_tok, res, hd.num_bytes, hd.elapsed_s)

    # ============================================================== metrics
    @exclusive
    def metrics(self) -> MetricsSnapshot:
        by_residency: dict[str, int] = {}
        for h in self._held.values():
            by_residency[h.residency.value] = by_residency.get(h.residency.value, 0) + 1
        pool, store = self.gpu.block_pool, self.store
        counters = self.counters.copy()
        counters.plans_submitted = self.transfers.submitted
        return MetricsSnapshot(
            counters=counters,
            gpu_blocks=pool.num_blocks - 1,
            cpu_blocks=store.num_blocks - 1 if store is not None else 0,
            gpu_usage=pool.get_usage(),
            cpu_usage=store.usage if store is not None else 0.0,
            gpu_free_blocks=pool.get_num_free_blocks(),
            cpu_free_blocks=store.num_free if store is not None else 0,
            cpu_cached_blocks=store.num_used if store is not None else 0,
            cpu_pinned_blocks=store.num_pinned + store.num_pending if store is not None else 0,
            plans_in_flight=len(self.transfers),
            requests_by_residency=by_residency,
        )

    @exclusive
    def check_invariants(self) -> None:
        """Assert ownership: every GPU ref is a table entry or a copy's hold; every store pin a swap's or a load's."""
        pool = self.gpu.block_pool
        pool.check_invariants()
        owners = [0] * pool.num_blocks
        for rid, h in self._held.items():
            table = self.gpu.get_blocks(rid)
            if h.residency is Residency.CPU:
                assert not table, f"{rid!r} is swapped out but holds a GPU table"
            for b in table:
                owners[b.block_id] += 1
        for bid, n in self.transfers.gpu_hold_counts().items():
            owners[bid] += n
        for b in pool.blocks[1:]:
            assert b.ref_cnt == owners[b.block_id], (
                f"GPU block {b.block_id}: {b.ref_cnt} refs, {owners[b.block_id]} owners"
            )
        if self.store is None:
            return
        self.store.check_invariants()
        pins: dict[object, int] = {}
        for h in self._held.values():
            for k in h.swapped.keys if h.swapped is not None else ():
                pins[k] = pins.get(k, 0) + 1
        for t in self.transfers:
            loading = getattr(t.payload, "keys", ()) if t.plan.kind is PlanKind.ONBOARD else ()
            for k in (*loading, *getattr(t.payload, "pinned", ())):
                pins[k] = pins.get(k, 0) + 1
        for e in self.store.entries():
            if e.ready:
                assert e.ref_cnt == pins.get(e.key, 0), (
                    f"store key {e.key!r}: {e.ref_cnt} pins, {pins.get(e.key)} owners"
                )


def _checked_cost_model(
    spec: KVSpec | None, cost_model: CostModel | None, engine: object, block_size: int
) -> CostModel:
    """The cost model, checked against the KV geometry of the storage in use."""
    if spec is None:
        spec = getattr(engine, "spec", None) if isinstance(getattr(engine, "spec", None), KVSpec) else None
    if spec is not None:
        checks.instance("kv_spec", spec, KVSpec)
        if spec.block_size != block_size:
            raise InvalidArgumentError(f"kv_spec block_size {spec.block_size} != manager block_size {block_size}")
    if cost_model is None:
        if spec is None:
            raise InvalidArgumentError("give kv_spec= or a cost_model: the manager will not guess KV sizes")
        return CostModel(kv_bytes_per_token=spec.bytes_per_token, block_size=block_size)
    checks.instance("cost_model", cost_model, CostModel)
    if cost_model.block_size != block_size:
        raise InvalidArgumentError(f"cost model block_size {cost_model.block_size} != manager block_size {block_size}")
    if spec is not None and cost_model.kv_bytes_per_token != spec.bytes_per_token:
        raise InvalidArgumentError(
            f"the cost model was built for {cost_model.kv_bytes_per_token} KV bytes per token, but the storage in "
            f"use holds {spec.bytes_per_token} ({spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
            f"{spec.head_dim} x {spec.dtype}); build the cost model for this KV shape"
        )
    return cost_model
