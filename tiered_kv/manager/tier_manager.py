"""TierManager: a prefix-cached GPU pool and a CPU pool under one manager.

A scheduler calls it to admit, grow, preempt, resume and finish requests.  The
manager owns the bookkeeping and emits :class:`~tiered_kv.transfer.TransferPlan`
objects to a copy engine; it never touches tensor data, so every decision here
is tested on the CPU with a copy engine whose completions the test controls.

Ownership is explicit.  Every reference on a block belongs either to a request's
block table in that tier or to an in-flight plan that reads or writes the block
(``_PlanRecord.gpu_holds`` / ``cpu_holds``), so a block is never handed to a new
owner while a copy still uses it, and ``check_invariants`` can verify every
ref count exactly.

Failure keeps data where it was:

* a failed/cancelled swap-out leaves the request RUNNING with its GPU table
  untouched (the GPU blocks were never released) and releases the CPU blocks it
  had reserved;
* a failed swap-in or onboarding releases the GPU blocks it had allocated (they
  were never registered in the prefix cache, so nobody can have hit them) and
  leaves the CPU copy owned by the request, which stays resumable.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tiered_kv import checks
from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.block_pool import BlockPool
from tiered_kv.core.hashing import HashFn
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import (
    ConcurrentUseError,
    InvalidArgumentError,
    InvalidTransitionError,
    PlanError,
    UnknownRequestError,
)
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.metrics import MetricsSnapshot, TierCounters
from tiered_kv.manager.policies import VictimInfo, VictimPolicy, get_policy
from tiered_kv.manager.states import IN_FLIGHT, MODES, PreemptMode, RequestState
from tiered_kv.transfer.coalesce import count_runs
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.plan import CPU, GPU, PlanKind, TransferHandle, TransferPlan, TransferStatus

_F = TypeVar("_F", bound=Callable[..., Any])


def _exclusive(method: _F) -> _F:
    """Refuse entry while another thread is inside this manager.

    The manager is single-threaded by design (one scheduler drives it, as in
    vLLM); copy engines complete handles on their own threads but never call
    the manager.  Two threads interleaving calls would corrupt its books, so a
    second thread entering is an error, not a wait.  The lock is re-entrant:
    the owning thread may call back in (an engine's ``submit`` may poll).
    """

    @functools.wraps(method)
    def guarded(self: TierManager, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if not lock.acquire(False):
            raise ConcurrentUseError(
                f"TierManager.{method.__name__} was called while another thread is inside the manager; "
                "a TierManager is single-threaded: drive it from one thread at a time"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return guarded  # type: ignore[return-value]


OFFLOAD_POLICIES = ("none", "write_through", "on_evict")

# A swap-out layout: (copies as (GPU block, logical index), CPU blocks reused by hash,
# (logical index, CPU block) of those reuses).
_Layout = tuple[list[tuple[KVCacheBlock, int]], list[KVCacheBlock], list[tuple[int, KVCacheBlock]]]


@dataclass(slots=True)
class _Entry:
    """The manager's record of one request."""

    request: Request
    seq: int
    state: RequestState
    last_scheduled: int
    # Logical block index -> CPU block holding that block's KV (None: not on CPU;
    # a full block shared with others on the GPU, to be found again by hash).
    cpu_table: list[KVCacheBlock | None] = field(default_factory=list)
    num_kv_tokens: int = 0  # tokens of KV kept while swapped
    plan_id: int | None = None  # the swap/onboard plan in flight
    num_offloaded_blocks: int = 0  # write-through progress (prompt blocks)
    lost_tokens: int = 0  # computed tokens dropped by recompute preemption, not yet recomputed


@dataclass(slots=True)
class _PlanRecord:
    plan: TransferPlan
    handle: TransferHandle | None
    gpu_holds: list[KVCacheBlock]
    cpu_holds: list[KVCacheBlock]
    # (destination block, hash) to register in the destination tier once the bytes landed.
    cache_on_done: list[tuple[KVCacheBlock, BlockHash]]
    cpu_table: list[KVCacheBlock | None] | None = None  # swap-out: the table to install
    tokens: int = 0  # swap-in/onboard: tokens that become computed
    in_place: bool = False  # GPU holds go back where they were (a save before eviction)


@dataclass(frozen=True, slots=True)
class Quote:
    """What preempting a request would cost, from the cost model.

    Attributes:
        blocks_to_move: GPU blocks a swap-out would copy (exclusive, not already on CPU).
        bytes_to_move: Their bytes.
        blocks_freed: GPU blocks preemption frees (those the request alone holds).
        swap_out_s / swap_in_s: Estimated copy times (coalesced runs included).
        recompute_s: Estimated time to rebuild the request's KV by prefill.
        cpu_blocks_needed / cpu_has_room: CPU blocks a swap-out would take, and whether they fit.
    """

    request_id: Hashable
    blocks_to_move: int
    bytes_to_move: int
    blocks_freed: int
    num_runs: int
    swap_out_s: float
    swap_in_s: float
    recompute_s: float
    cpu_blocks_needed: int
    cpu_has_room: bool


@dataclass(frozen=True, slots=True)
class VictimDecision:
    request_id: Hashable
    mode: PreemptMode
    blocks_freed: int
    swap_cost_s: float
    recompute_cost_s: float
    plan_id: int | None


@dataclass(frozen=True, slots=True)
class PreemptionResult:
    """Victims chosen by ``preempt``.  Swap victims' blocks free when their plans complete."""

    victims: tuple[VictimDecision, ...]
    blocks_freed_now: int
    blocks_freed_on_completion: int
    plans: tuple[TransferPlan, ...]


@dataclass(frozen=True, slots=True)
class DecisionLogEntry:
    """Why a preemption happened the way it did."""

    tick: int
    blocks_needed: int
    policy: str
    mode: str
    candidates: int
    victims: tuple[VictimDecision, ...]


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """Outcome of ``admit``.

    ``runnable`` is False while CPU prefix hits are being onboarded; the
    scheduler computes the request only once ``TierManager.is_runnable`` says
    so, and then calls ``allocate(request_id, n)`` for the tokens of that step
    as for any running request (no new blocks are needed).
    """

    new_blocks: list[KVCacheBlock]
    num_gpu_hit_tokens: int
    num_cpu_hit_tokens: int
    num_new_tokens: int  # tokens scheduled after the hits (<= what was asked)
    plan: TransferPlan | None
    runnable: bool


@dataclass(frozen=True, slots=True)
class ResumeResult:
    plan: TransferPlan | None
    num_restored_tokens: int
    num_lost_tokens: int
    state: RequestState


@dataclass(frozen=True, slots=True)
class Completion:
    plan_id: int
    request_id: Hashable | None
    kind: PlanKind
    ok: bool


class TierManager:
    """GPU and CPU tiers, request states, preemption, resume and the CPU prefix tier.

    Args:
        num_gpu_blocks: GPU pool size, null block included.
        num_cpu_blocks: CPU pool size, null block included (0 = no CPU tier).
        block_size: Tokens per block.
        copy_engine: Executes plans (``submit``/``cancel``).
        cost_model: Swap/recompute estimates; default assumes 128 KiB/token KV.
        policy: Default victim policy (name or instance).
        mode: Default preemption mode: ``"swap"``, ``"recompute"`` or ``"auto"``.
        offload: CPU prefix-tier policy: ``"none"``, ``"write_through"`` (full
            prompt blocks copied once computed) or ``"on_evict"`` (cached GPU
            blocks nearing eviction are copied out first; see ``poll``).
        enable_caching: Prefix caching.  Off: nothing is hashed or cached in
            either tier; swaps still work, per request.  ``offload`` needs it.
        hash_fn / hash_seed: Block hashing (shared by both tiers).
        evict_window: With ``offload="on_evict"``: how many blocks at the
            eviction end of the GPU free queue are kept saved on the CPU.

    A block that a copy reads or writes is never handed to a new owner: every
    plan holds a reference on each GPU and CPU block it touches until it
    settles, and the pools never hand out a held block.  That is what makes
    on-evict offload safe by construction: the blocks it saves are held while
    they are copied, so the allocation that evicts cached data later takes
    other blocks, or takes these only once their contents are on the CPU.

    Not thread-safe: one thread drives a manager; a second thread entering
    while the first is inside raises :class:`~tiered_kv.errors.ConcurrentUseError`.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        copy_engine: CopyEngine,
        *,
        cost_model: CostModel | None = None,
        policy: str | VictimPolicy = "lru",
        mode: str = "auto",
        offload: str = "none",
        enable_caching: bool = True,
        hash_fn: str | HashFn = "sha256",
        hash_seed: int = 0,
        evict_window: int = 64,
    ) -> None:
        checks.choice("mode", mode, MODES)
        checks.choice("offload", offload, OFFLOAD_POLICIES)
        if num_cpu_blocks.__class__ is not int or num_cpu_blocks < 0 or num_cpu_blocks == 1:
            raise InvalidArgumentError(
                f"num_cpu_blocks must be 0 or an int >= 2, got {checks.describe(num_cpu_blocks)}"
            )
        checks.flag("enable_caching", enable_caching)
        checks.count("evict_window", evict_window, 1)
        if offload != "none" and not enable_caching:
            raise InvalidArgumentError(
                f"offload={offload!r} keeps a CPU prefix tier, which needs prefix caching; "
                "use offload='none' with enable_caching=False"
            )
        for name in ("submit", "cancel"):
            if not callable(getattr(copy_engine, name, None)):
                raise InvalidArgumentError(
                    f"copy_engine must have submit() and cancel() (a CopyEngine), got {checks.describe(copy_engine)}"
                )
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise InvalidArgumentError(f"cost_model must be a CostModel, got {checks.describe(cost_model)}")
        if not isinstance(policy, str | VictimPolicy):
            raise InvalidArgumentError(f"policy must be a policy name or a VictimPolicy, got {checks.describe(policy)}")
        self.gpu = KVCacheManager(
            num_gpu_blocks, block_size, enable_caching=enable_caching, hash_fn=hash_fn, hash_seed=hash_seed
        )
        self.gpu_pool = self.gpu.block_pool
        self.cpu_pool: BlockPool | None = BlockPool(num_cpu_blocks, True, medium="CPU") if num_cpu_blocks else None
        self.block_size = block_size
        self.caching = enable_caching
        self.engine = copy_engine
        self.cost_model = cost_model or CostModel(kv_bytes_per_token=128 * 1024, block_size=block_size)
        if self.cost_model.block_size != block_size:
            raise InvalidArgumentError(
                f"cost model block_size {self.cost_model.block_size} != manager block_size {block_size}"
            )
        self.policy = get_policy(policy)
        self.mode = mode
        self.offload = offload if self.cpu_pool is not None else "none"
        self.evict_window = evict_window
        self.counters = TierCounters()
        self.decision_log: list[DecisionLogEntry] = []
        self._entries: dict[Hashable, _Entry] = {}
        self._plans: dict[int, _PlanRecord] = {}
        self._next_plan_id = 1
        self._seq = 0
        self._tick = 0
        self._lock = threading.RLock()

    # ================================================================ lookups
    @property
    def bytes_per_block(self) -> int:
        return self.cost_model.bytes_per_block

    def _entry(self, request_id: Hashable) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not managed by this tier manager") from None
        except TypeError:
            raise InvalidArgumentError(f"request_id must be a hashable id, got {checks.describe(request_id)}") from None

    @_exclusive
    def state(self, request_id: Hashable) -> RequestState:
        return self._entry(request_id).state

    @_exclusive
    def is_runnable(self, request_id: Hashable) -> bool:
        """RUNNING: its KV is on the GPU, and no copy writes it.  Only then may compute touch it."""
        return self._entry(request_id).state is RequestState.RUNNING

    @_exclusive
    def gpu_block_ids(self, request_id: Hashable) -> list[int]:
        return self.gpu.get_block_ids(self._entry(request_id).request.request_id)

    @_exclusive
    def cpu_block_ids(self, request_id: Hashable) -> list[int | None]:
        return [b.block_id if b is not None else None for b in self._entry(request_id).cpu_table]

    @_exclusive
    def requests(self, state: RequestState | None = None) -> list[Hashable]:
        """Managed request ids (in admission order), optionally of one state."""
        if state is not None and not isinstance(state, RequestState):
            raise InvalidArgumentError(f"state must be a RequestState or None, got {checks.describe(state)}")
        return [rid for rid, e in self._entries.items() if state is None or e.state is state]

    @_exclusive
    def blocks_freed_on_completion(self) -> int:
        """GPU blocks that copies in flight hold and will free when they settle.

        Swap-outs free their victims' blocks, and saves before eviction give
        theirs back; a scheduler that cannot allocate counts these before it
        preempts anyone, because waiting for a copy is cheaper than a preemption.
        """
        n = 0
        for r in self._plans.values():
            kind = r.plan.kind
            if kind is PlanKind.SWAP_OUT:
                e = self._entries.get(r.plan.request_id)
                if e is not None:
                    n += sum(1 for b in self.gpu.get_blocks(e.request.request_id) if b.ref_cnt == 1)
            elif kind is PlanKind.OFFLOAD:
                n += sum(1 for b in r.gpu_holds if b.ref_cnt == 1)
        return n

    def _cpu_chain(self, request: Request, start: int, max_blocks: int) -> list[KVCacheBlock]:
        """Continue a prefix lookup on the CPU tier from block ``start``."""
        if self.cpu_pool is None:
            return []
        hashes = request.block_hashes
        out: list[KVCacheBlock] = []
        for i in range(start, min(max_blocks, len(hashes))):
            b = self.cpu_pool.get_cached_block(hashes[i])
            if b is None:
                break
            out.append(b)
        return out

    # ============================================================== admission
    @_exclusive
    def admit(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> AdmitResult | None:
        """Admit a new (or recompute-preempted) request: prefix lookup on GPU then CPU, then allocate.

        GPU hits are touched; CPU hits are onboarded into fresh GPU blocks by an
        ONBOARD plan, and the request is runnable only once it lands.  Returns
        ``None`` with nothing changed when the GPU blocks do not fit.  Every
        argument is checked before anything changes.
        """
        checks.instance("request", request, Request)
        checks.count("num_new_tokens", num_new_tokens, 1)
        checks.count("num_lookahead_tokens", num_lookahead_tokens)
        rid = request.request_id
        existing = self._entries.get(rid)
        if existing is not None and existing.state is not RequestState.PREEMPTED:
            raise InvalidTransitionError(f"request {rid!r} is already {existing.state.value}; cannot admit it")
        if existing is not None and existing.request is not request:
            raise InvalidArgumentError(f"request id {rid!r} is managed with a different Request object")
        if request.num_computed_tokens != 0:
            raise InvalidArgumentError(f"request {rid!r}: a new request must have num_computed_tokens == 0")
        if num_new_tokens > request.num_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: num_new_tokens {num_new_tokens} exceeds its {request.num_tokens} tokens"
            )
        gpu_hits, n_gpu = self.gpu.get_computed_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        cpu_hits = self._cpu_chain(request, len(gpu_hits), max_blocks) if self.caching else []
        n_cpu = len(cpu_hits) * self.block_size
        # New tokens start after every hit; never schedule past the request's tokens.
        n_new = min(num_new_tokens, request.num_tokens - n_gpu - n_cpu)
        need = self.gpu.num_blocks_to_allocate(request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens)
        if need > self.gpu_pool.get_num_free_blocks():
            return None

        e = existing or _Entry(request, self._next_seq(), RequestState.RUNNING, 0)
        self._entries[rid] = e
        if self.cpu_pool is not None and cpu_hits:
            self.cpu_pool.touch(cpu_hits)
        new = self.gpu.allocate_slots(
            request, n_cpu + n_new, n_gpu, gpu_hits, num_lookahead_tokens, delay_cache_blocks=bool(cpu_hits)
        )
        assert new is not None, "allocation was checked to fit"
        self._count_lookup(request, n_gpu, n_cpu)
        if e.lost_tokens:
            self.counters.tokens_recomputed += max(e.lost_tokens - n_gpu - n_cpu, 0)
            e.lost_tokens = 0
        request.num_computed_tokens = n_gpu
        e.state = RequestState.RUNNING
        e.last_scheduled = self._next_tick()
        plan = None
        if cpu_hits:
            table = self.gpu.req_to_blocks[rid]
            dst = table[len(gpu_hits) : len(gpu_hits) + len(cpu_hits)]
            hashes = request.block_hashes[len(gpu_hits) : len(gpu_hits) + len(cpu_hits)]
            record = _PlanRecord(
                self._make_plan(CPU, GPU, cpu_hits, dst, PlanKind.ONBOARD, rid, urgent=True),
                None,
                gpu_holds=[],
                cpu_holds=list(cpu_hits),
                cache_on_done=list(zip(dst, hashes, strict=True)),
                tokens=n_cpu,
            )
            e.state = RequestState.SWAPPING_IN
            e.plan_id = record.plan.plan_id
            plan = record.plan
            self._submit(record)
        return AdmitResult(new, n_gpu, n_cpu, n_new, plan, e.state is RequestState.RUNNING)

    def _count_lookup(self, request: Request, n_gpu: int, n_cpu: int) -> None:
        c = self.counters
        c.gpu_query_tokens += request.num_tokens
        c.gpu_hit_tokens += n_gpu
        if self.cpu_pool is not None:
            c.cpu_query_tokens += request.num_tokens - n_gpu
            c.cpu_hit_tokens += n_cpu

    @_exclusive
    def allocate(
        self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """Grow a runnable request by ``num_new_tokens`` (+ lookahead); ``None`` if it does not fit."""
        try:
            e = self._entries.get(request_id)
        except TypeError:
            e = None  # unhashable: _entry below names the problem
        if e is None or e.state is not RequestState.RUNNING:
            e = self._entry(request_id)
            raise InvalidTransitionError(f"request {request_id!r} is {e.state.value}; only running requests grow")
        new = self.gpu.allocate_slots(e.request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
        if new is not None:
            self._tick += 1
            e.last_scheduled = self._tick
        return new

    @_exclusive
    def mark_scheduled(self, request_id: Hashable) -> None:
        """Record that the request was scheduled now (for LRU) without allocating."""
        self._entry(request_id).last_scheduled = self._next_tick()

    @_exclusive
    def on_tokens_computed(self, request_id: Hashable) -> TransferPlan | None:
        """Tell the manager the step that computed the request's tokens has finished.

        With write-through offload, full prompt blocks computed so far and not yet
        on the CPU are copied there now (their KV is final and written).  Only
        steps that computed prompt tokens can produce such blocks, so schedulers
        may skip the call on decode steps.
        """
        e = self._entry(request_id)
        if self.offload != "write_through" or e.state is not RequestState.RUNNING or self.cpu_pool is None:
            return None
        req = e.request
        n_prompt_blocks = req.num_prompt_tokens // self.block_size
        if e.num_offloaded_blocks >= n_prompt_blocks:
            return None  # decode steps: the whole prompt was handled already
        upto = min(req.num_computed_tokens // self.block_size, n_prompt_blocks)
        if upto <= e.num_offloaded_blocks:
            return None
        if len(req.block_hashes) < upto:
            self.gpu.hasher.update(req)
        table = self.gpu.req_to_blocks[request_id]
        src: list[KVCacheBlock] = []
        hashes: list[BlockHash] = []
        for i in range(e.num_offloaded_blocks, upto):
            h = req.block_hashes[i]
            if self.cpu_pool.get_cached_block(h) is None:
                src.append(table[i])
                hashes.append(h)
        e.num_offloaded_blocks = upto
        return self._offload(src, hashes, request_id)

    def _offload(
        self, src: list[KVCacheBlock], hashes: list[BlockHash], rid: Hashable | None, in_place: bool = False
    ) -> TransferPlan | None:
        """Copy hashed GPU blocks to fresh CPU blocks (best effort: as many as the CPU tier can take).

        The plan holds every source block until it settles, so none can be
        handed out while the copy reads it.  ``in_place``: the holds are given
        back with ``release_in_place``, so holding does not move the blocks in
        the GPU free queue (saves before eviction).
        """
        assert self.cpu_pool is not None
        n = min(len(src), self.cpu_pool.get_num_free_blocks())
        if n == 0:
            return None
        src, hashes = src[:n], hashes[:n]
        dst = self.cpu_pool.get_new_blocks(n)
        self.gpu_pool.touch(src)
        record = _PlanRecord(
            self._make_plan(GPU, CPU, src, dst, PlanKind.OFFLOAD, rid),
            None,
            gpu_holds=list(src),
            cpu_holds=list(dst),
            cache_on_done=list(zip(dst, hashes, strict=True)),
            in_place=in_place,
        )
        self._submit(record)
        return record.plan

    def _save_before_eviction(self) -> TransferPlan | None:
        """On-evict offload: copy the cached blocks nearest eviction to the CPU before they get there.

        The first ``evict_window`` blocks of the GPU free queue are the next
        ones any allocation takes; each of them that carries a hash not yet on
        the CPU is held and copied out now.  Held, it is out of the free queue,
        so no allocation can take it while the copy reads it; when the copy
        settles it is given back in place, and an allocation that later takes it
        evicts data the CPU tier already has.  An allocation that outruns the
        window evicts unsaved cached blocks, which costs a cache miss, never
        correctness.
        """
        cpu = self.cpu_pool
        assert cpu is not None
        window = self.gpu_pool.peek_free_blocks(self.evict_window)
        src: list[KVCacheBlock] = []
        hashes: list[BlockHash] = []
        seen: set[BlockHash] = set()
        for b in window:
            h = b.block_hash
            if h is None or h in seen or cpu.get_cached_block(h) is not None:
                continue
            seen.add(h)
            src.append(b)
            hashes.append(h)
        if not src:
            return None
        # The CPU blocks these copies take are the first free ones, which may evict CPU-cached
        # data.  Never evict the CPU copy of a block in the window: the next top-up would save
        # it again and the two would chase each other forever.
        in_window = {b.block_hash for b in window}
        room = 0
        for c in cpu.peek_free_blocks(len(src)):
            if c.block_hash is not None and c.block_hash in in_window:
                break
            room += 1
        src, hashes = src[:room], hashes[:room]
        return self._offload(src, hashes, None, in_place=True) if src else None

    # ================================================================== quotes
    @_exclusive
    def quote(self, request_id: Hashable) -> Quote:
        """Costs of preempting a running request by swap and by recompute."""
        e = self._entry(request_id)
        if e.state is not RequestState.RUNNING:
            raise InvalidTransitionError(f"request {request_id!r} is {e.state.value}; only running requests are quoted")
        plan = self._swap_out_layout(e)
        copy_src = [s for s, _ in plan[0]]
        n = len(copy_src)
        runs = count_runs([b.block_id for b in copy_src])
        table = self.gpu.req_to_blocks.get(request_id, [])
        freed = sum(1 for b in table if b.ref_cnt == 1)
        cpu_need = n + sum(1 for c in plan[1] if c.ref_cnt == 0)
        cpu_free = self.cpu_pool.get_num_free_blocks() if self.cpu_pool is not None else 0
        cm = self.cost_model
        return Quote(
            request_id,
            blocks_to_move=n,
            bytes_to_move=n * cm.bytes_per_block,
            blocks_freed=freed,
            num_runs=runs,
            swap_out_s=cm.swap_out_time(n, runs),
            swap_in_s=cm.swap_in_time(n, runs),
            recompute_s=cm.recompute_time(e.request.num_computed_tokens),
            cpu_blocks_needed=cpu_need,
            cpu_has_room=self.cpu_pool is not None and cpu_need <= cpu_free,
        )

    def _swap_out_layout(self, e: _Entry) -> _Layout:
        """Which blocks a swap-out copies, which CPU-cached blocks it reuses.

        Returns ``(copies, cpu_hits, cpu_hit_slots)``: ``copies`` are
        ``(gpu block, logical index)`` for exclusive blocks not already on the
        CPU; ``cpu_hits`` are CPU blocks already holding an exclusive block's
        content (found by hash), with their logical index in ``cpu_hit_slots``.
        Shared blocks (ref count above 1) are neither: they stay on the GPU.
        """
        req = e.request
        bs = self.block_size
        n_kv = -(-req.num_computed_tokens // bs)
        full = req.num_computed_tokens // bs if self.caching else 0  # caching off: nothing is found by hash
        if len(req.block_hashes) < full:
            self.gpu.hasher.update(req)
        table = self.gpu.req_to_blocks.get(req.request_id, [])
        copies: list[tuple[KVCacheBlock, int]] = []
        cpu_hits: list[KVCacheBlock] = []
        slots: list[tuple[int, KVCacheBlock]] = []
        cpu = self.cpu_pool
        for i in range(min(n_kv, len(table))):
            b = table[i]
            if b.ref_cnt > 1:
                continue
            if i < full and cpu is not None:
                c = cpu.get_cached_block(req.block_hashes[i])
                if c is not None:
                    cpu_hits.append(c)
                    slots.append((i, c))
                    continue
            copies.append((b, i))
        return copies, cpu_hits, slots

    # ============================================================== preemption
    @_exclusive
    def preempt(
        self,
        num_blocks_needed: int,
        policy: str | VictimPolicy | None = None,
        mode: str | None = None,
        exclude: Iterable[Hashable] = (),
    ) -> PreemptionResult | None:
        """Preempt running requests until at least ``num_blocks_needed`` GPU blocks are (or will be) freed.

        Recompute victims free their blocks now; swap victims free theirs when
        their swap-out plan completes.  Returns ``None`` and changes nothing if
        no choice of victims frees enough.  Every call that preempts appends a
        :class:`DecisionLogEntry`.
        """
        checks.count("num_blocks_needed", num_blocks_needed, 1)
        if policy is not None and not isinstance(policy, str | VictimPolicy):
            raise InvalidArgumentError(f"policy must be a policy name, a VictimPolicy or None, got {policy!r}")
        pol = get_policy(policy) if policy is not None else self.policy
        mode = self.mode if mode is None else checks.choice("mode", mode, MODES)
        if isinstance(exclude, str | bytes) or not isinstance(exclude, Iterable):
            raise InvalidArgumentError(f"exclude must be a collection of request ids, got {checks.describe(exclude)}")
        exclude = list(exclude)
        for rid in exclude:
            checks.hashable("exclude item", rid)
        if mode == "swap" and self.cpu_pool is None:
            return None
        skip = set(exclude)
        cpu_free = self.cpu_pool.get_num_free_blocks() if self.cpu_pool is not None else 0
        infos = [
            VictimInfo(
                rid,
                e.seq,
                e.last_scheduled,
                self.gpu.req_to_blocks.get(rid, ()),
                e.request.num_computed_tokens,
                e.request.num_prompt_tokens,
                self.cost_model,
                cpu_free,
            )
            for rid, e in self._entries.items()
            if e.state is RequestState.RUNNING and rid not in skip
        ]
        # Layouts of swap victims are fixed here, against the refcounts before any victim
        # is touched: a block two victims share is copied by neither (it stays cached on
        # the GPU), and the CPU budget below is exact.
        chosen: list[tuple[VictimInfo, PreemptMode, _Layout | None]] = []
        freed = 0
        cpu_budget = cpu_free
        claimed: set[int] = set()  # free CPU blocks some victim will reuse (touch)
        for choice in pol.iter_rank(infos, mode):
            if freed >= num_blocks_needed:
                break
            info = choice.info
            n_free = info.num_freeable_blocks
            if n_free == 0:
                continue
            m = choice.mode
            layout = None
            if m is PreemptMode.SWAP:
                layout = self._swap_out_layout(self._entries[info.request_id])
                reused = {c.block_id for c in layout[1] if c.ref_cnt == 0} - claimed
                need_cpu = len(layout[0]) + len(reused)
                if need_cpu > cpu_budget:
                    if mode == "swap":
                        continue
                    m, layout = PreemptMode.RECOMPUTE, None
                else:
                    cpu_budget -= need_cpu
                    claimed |= reused
            chosen.append((info, m, layout))
            freed += n_free
        if freed < num_blocks_needed:
            return None

        # Hold every CPU block any victim reuses before any victim allocates CPU blocks,
        # so one victim's allocation cannot evict what another is about to reuse.
        assert self.cpu_pool is not None or not claimed
        for _, _, layout in chosen:
            if layout is not None and self.cpu_pool is not None:
                self.cpu_pool.touch(layout[1])
        decisions: list[VictimDecision] = []
        plans: list[TransferPlan] = []
        now = later = 0
        for info, m, layout in chosen:
            e = self._entries[info.request_id]
            swap_s, rec_s = info.swap_cost_s, info.recompute_cost_s
            plan = None
            if m is PreemptMode.SWAP:
                assert layout is not None
                plan = self._swap_out(e, layout)
                if e.state is RequestState.SWAPPED:
                    now += info.num_freeable_blocks  # nothing to copy: settled at once
                else:
                    later += info.num_freeable_blocks
                if plan is not None:
                    plans.append(plan)
            else:
                self._preempt_recompute(e)
                now += info.num_freeable_blocks
            decisions.append(
                VictimDecision(
                    info.request_id, m, info.num_freeable_blocks, swap_s, rec_s, plan.plan_id if plan else None
                )
            )
        result = PreemptionResult(tuple(decisions), now, later, tuple(plans))
        self.decision_log.append(
            DecisionLogEntry(self._tick, num_blocks_needed, pol.name, mode, len(infos), result.victims)
        )
        return result

    @_exclusive
    def preempt_request(self, request_id: Hashable, mode: str = "recompute") -> VictimDecision:
        """Preempt one named running request (``"swap"`` or ``"recompute"``)."""
        e = self._entry(request_id)
        checks.choice("mode", mode, ("swap", "recompute"))
        if e.state is not RequestState.RUNNING:
            raise InvalidTransitionError(f"request {request_id!r} is {e.state.value}; only running requests preempt")
        q = self.quote(request_id)
        if mode == "swap":
            if not q.cpu_has_room:
                raise InvalidTransitionError(
                    f"request {request_id!r}: CPU tier has no room for {q.cpu_blocks_needed} blocks"
                )
            plan = self._swap_out(e)
            d = VictimDecision(
                request_id,
                PreemptMode.SWAP,
                q.blocks_freed,
                q.swap_out_s + q.swap_in_s,
                q.recompute_s,
                plan.plan_id if plan else None,
            )
        else:
            self._preempt_recompute(e)
            d = VictimDecision(
                request_id, PreemptMode.RECOMPUTE, q.blocks_freed, q.swap_out_s + q.swap_in_s, q.recompute_s, None
            )
        self.decision_log.append(DecisionLogEntry(self._tick, q.blocks_freed, "explicit", mode, 1, (d,)))
        return d

    def _swap_out(self, e: _Entry, layout: _Layout | None = None) -> TransferPlan | None:
        """Reserve CPU blocks and emit GPU->CPU; the GPU blocks stay owned until the plan completes.

        With ``layout`` given, its CPU hits were already touched by the caller.
        """
        assert self.cpu_pool is not None
        req = e.request
        if layout is None:
            layout = self._swap_out_layout(e)
            self.cpu_pool.touch(layout[1])
        copies, cpu_hits, slots = layout
        dst = self.cpu_pool.get_new_blocks(len(copies))
        n_kv = -(-req.num_computed_tokens // self.block_size)
        full = req.num_computed_tokens // self.block_size if self.caching else 0
        cpu_table: list[KVCacheBlock | None] = [None] * n_kv
        for i, c in slots:
            cpu_table[i] = c
        cache_on_done = []
        for (_, i), c in zip(copies, dst, strict=True):
            cpu_table[i] = c
            if i < full:
                cache_on_done.append((c, req.block_hashes[i]))
        self.counters.preemptions_swap += 1
        req.num_preemptions += 1
        e.num_kv_tokens = req.num_computed_tokens
        record = _PlanRecord(
            self._make_plan(GPU, CPU, [b for b, _ in copies], dst, PlanKind.SWAP_OUT, req.request_id),
            None,
            gpu_holds=[],
            cpu_holds=list(cpu_hits) + list(dst),
            cache_on_done=cache_on_done,
            cpu_table=cpu_table,
        )
        e.state = RequestState.SWAPPING_OUT
        e.plan_id = record.plan.plan_id
        if not copies:
            self._settle(record, True)  # everything is already on the CPU or shared: nothing to copy
            return None
        self._submit(record)
        return record.plan

    def _preempt_recompute(self, e: _Entry) -> None:
        """vLLM v1 preemption: free the blocks (hashed ones stay cached) and reset progress."""
        req = e.request
        self.counters.preemptions_recompute += 1
        e.lost_tokens = req.num_computed_tokens
        self.gpu.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        e.state = RequestState.PREEMPTED
        e.num_offloaded_blocks = 0

    # ================================================================== resume
    @_exclusive
    def resume(self, request_id: Hashable) -> ResumeResult | None:
        """Bring a swapped request back: re-hit what is still cached on the GPU, copy the rest in.

        Returns ``None`` with nothing changed when the GPU blocks do not fit.
        If a block shared with others was evicted from both tiers meanwhile,
        the request resumes up to that block and recomputes the rest
        (``num_lost_tokens``); if nothing is restorable it becomes PREEMPTED.
        """
        e = self._entry(request_id)
        if e.state is not RequestState.SWAPPED:
            raise InvalidTransitionError(f"request {request_id!r} is {e.state.value}, not swapped; cannot resume")
        req = e.request
        bs = self.block_size
        n_kv = len(e.cpu_table)
        full = e.num_kv_tokens // bs
        assert self.cpu_pool is not None
        layout: list[tuple[bool, KVCacheBlock]] = []  # (is_gpu_hit, block)
        for i in range(n_kv):
            h = req.block_hashes[i] if i < full and self.caching else None
            g = self.gpu_pool.get_cached_block(h) if h is not None else None
            if g is not None:
                layout.append((True, g))
                continue
            c = e.cpu_table[i]
            if c is None and h is not None:
                c = self.cpu_pool.get_cached_block(h)
            if c is None:
                break
            layout.append((False, c))
        restorable = len(layout)
        tokens = e.num_kv_tokens if restorable == n_kv else restorable * bs
        hits = [b for is_hit, b in layout if is_hit]
        n_copy = restorable - len(hits)
        need = n_copy + sum(1 for b in hits if b.ref_cnt == 0)
        if need > self.gpu_pool.get_num_free_blocks():
            return None

        lost = e.num_kv_tokens - tokens
        if lost:
            # Blocks after the hole cannot be used: give their CPU copies back now.
            tail = [c for c in e.cpu_table[restorable:] if c is not None]
            self.cpu_pool.free_blocks(tail[::-1])
            e.cpu_table = e.cpu_table[:restorable]
            e.num_kv_tokens = tokens
            self.counters.tokens_lost_on_resume += lost
            self.counters.tokens_recomputed += lost
        if restorable == 0:
            self.cpu_pool.free_blocks([c for c in e.cpu_table if c is not None][::-1])
            e.cpu_table = []
            e.state = RequestState.PREEMPTED
            req.num_computed_tokens = 0
            return ResumeResult(None, 0, lost, e.state)

        # Someone else's CPU copies, found by hash: hold them before any GPU allocation,
        # whose on-evict offloads could otherwise evict them from the CPU tier.
        borrowed = [b for i, (is_hit, b) in enumerate(layout) if not is_hit and e.cpu_table[i] is None]
        self.cpu_pool.touch(borrowed)
        self.gpu_pool.touch(hits)
        fresh = iter(self.gpu_pool.get_new_blocks(n_copy))
        table: list[KVCacheBlock] = []
        src: list[KVCacheBlock] = []
        dst: list[KVCacheBlock] = []
        cache_on_done: list[tuple[KVCacheBlock, BlockHash]] = []
        for i, (is_hit, b) in enumerate(layout):
            if is_hit:
                table.append(b)
                continue
            g = next(fresh)
            table.append(g)
            src.append(b)
            dst.append(g)
            if i < full and self.caching:
                cache_on_done.append((g, req.block_hashes[i]))
        self.gpu.req_to_blocks[request_id] = table
        self.gpu.num_cached_block[request_id] = min(full, restorable)
        e.last_scheduled = self._next_tick()
        record = _PlanRecord(
            self._make_plan(CPU, GPU, src, dst, PlanKind.SWAP_IN, request_id, urgent=True),
            None,
            gpu_holds=[],
            cpu_holds=borrowed,
            cache_on_done=cache_on_done,
            tokens=tokens,
        )
        e.state = RequestState.SWAPPING_IN
        e.plan_id = record.plan.plan_id
        if not src:
            self._settle(record, True)
            return ResumeResult(None, tokens, lost, e.state)
        self._submit(record)
        return ResumeResult(record.plan, tokens, lost, e.state)

    @_exclusive
    def drop_swapped(self, request_id: Hashable) -> None:
        """Give up a swapped request's CPU copy and mark it for recompute."""
        e = self._entry(request_id)
        if e.state is not RequestState.SWAPPED:
            raise InvalidTransitionError(f"request {request_id!r} is {e.state.value}, not swapped")
        assert self.cpu_pool is not None
        self.cpu_pool.free_blocks([c for c in e.cpu_table if c is not None][::-1])
        e.cpu_table = []
        e.lost_tokens = e.num_kv_tokens
        e.num_kv_tokens = 0
        e.request.num_computed_tokens = 0
        e.state = RequestState.PREEMPTED
        self.counters.preemptions_recompute += 1

    # ================================================================= finish
    @_exclusive
    def finish(self, request_id: Hashable) -> None:
        """Release everything the request holds in both tiers.  Refused mid-transfer."""
        e = self._entry(request_id)
        if e.state in IN_FLIGHT:
            raise InvalidTransitionError(
                f"request {request_id!r} is {e.state.value} (plan {e.plan_id} in flight); "
                "cancel the plan or wait for it before finishing"
            )
        self.gpu.free(e.request)
        if self.cpu_pool is not None and e.cpu_table:
            self.cpu_pool.free_blocks([c for c in e.cpu_table if c is not None][::-1])
        e.cpu_table = []
        e.state = RequestState.FINISHED
        del self._entries[request_id]

    # ================================================================== plans
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _make_plan(
        self,
        src_medium: str,
        dst_medium: str,
        src: list[KVCacheBlock],
        dst: list[KVCacheBlock],
        kind: PlanKind,
        rid: Hashable | None,
        urgent: bool = False,
        wait_for: Iterable[int] = (),
    ) -> TransferPlan:
        pid = self._next_plan_id
        self._next_plan_id += 1
        return TransferPlan(
            pid,
            src_medium,
            dst_medium,
            tuple(b.block_id for b in src),
            tuple(b.block_id for b in dst),
            kind,
            rid,
            urgent,
            tuple(sorted(wait_for)),
        )

    def _submit(self, record: _PlanRecord) -> None:
        """Hand a plan to the copy engine.

        The engine is foreign code: whatever it raises (our ``PlanError`` or
        anything else) is a failed copy.  The plan stays in flight with a
        handle that is already FAILED, and the next ``poll`` rolls it back and
        reports it like any other failure, so no request is left half-moved.
        """
        self._plans[record.plan.plan_id] = record
        self.counters.plans_submitted += 1
        try:
            handle = self.engine.submit(record.plan)
            if not isinstance(handle, TransferHandle) or handle.plan != record.plan:
                raise PlanError(f"copy engine returned {handle!r} for plan {record.plan.plan_id}, not its handle")
        except Exception as exc:
            handle = TransferHandle(record.plan)
            handle._finish(TransferStatus.FAILED, exc)
        record.handle = handle

    @_exclusive
    def plans_in_flight(self) -> list[TransferPlan]:
        return [r.plan for r in self._plans.values()]

    @_exclusive
    def handle(self, plan_id: int) -> TransferHandle | None:
        checks.count("plan_id", plan_id)
        r = self._plans.get(plan_id)
        return r.handle if r is not None else None

    @_exclusive
    def poll(self) -> list[Completion]:
        """Settle every plan whose handle is final, in plan order; returns what settled.

        With on-evict offload it then tops up the saves before eviction (see
        ``_save_before_eviction``): once per scheduler step is often enough.
        """
        done: list[Completion] = []
        for pid in sorted(self._plans):
            record = self._plans.get(pid)
            if record is not None and record.handle is not None and record.handle.done():
                done.append(self.process_completion(record.handle))
        if self.offload == "on_evict":
            self._save_before_eviction()
        return done

    @_exclusive
    def wait_all(self, timeout: float | None = None) -> list[Completion]:
        """Wait for every plan in flight (real engines) and settle them."""
        timeout = checks.timeout("timeout", timeout)
        for record in list(self._plans.values()):
            if record.handle is not None:
                record.handle.wait(timeout)
        return self.poll()

    @_exclusive
    def process_completion(self, handle: TransferHandle) -> Completion:
        """Act on a final handle: commit on success, roll back on failure or cancel.

        Raises:
            PlanError: the plan is not in flight here (unknown, or settled
                already), is not final yet, or its ids differ from the plan this
                manager emitted under that id.  Nothing changes.
        """
        checks.instance("handle", handle, TransferHandle)
        plan = handle.plan
        record = self._plans.get(plan.plan_id)
        if record is None:
            raise PlanError(f"plan {plan.plan_id} is not in flight (unknown or already completed)")
        if plan != record.plan:
            raise PlanError(
                f"plan {plan.plan_id} does not match the plan emitted for request {record.plan.request_id!r}: "
                f"ids {plan.src_block_ids}->{plan.dst_block_ids} vs "
                f"{record.plan.src_block_ids}->{record.plan.dst_block_ids}"
            )
        if not handle.done():
            raise PlanError(f"plan {plan.plan_id} is not finished yet")
        if handle.status is TransferStatus.CANCELLED:
            self.counters.plans_cancelled += 1
        elif not handle.ok:
            self.counters.plans_failed += 1
        self._settle(record, handle.ok)
        return Completion(plan.plan_id, plan.request_id, plan.kind, handle.ok)

    @_exclusive
    def cancel(self, request_id: Hashable) -> bool:
        """Cancel the request's swap/onboard plan in flight; True only if it was cancelled and rolled back.

        A plan the engine finished first is settled as what it is (a completed
        swap commits, a failed one rolls back) and the answer is False.
        """
        e = self._entry(request_id)
        if e.plan_id is None:
            return False
        record = self._plans[e.plan_id]
        handle = record.handle
        assert handle is not None
        try:
            self.engine.cancel(handle)
        except Exception:  # a foreign engine that cannot cancel: the plan runs on
            pass
        if not handle.done():
            return False
        self.process_completion(handle)
        return handle.status is TransferStatus.CANCELLED

    def _settle(self, record: _PlanRecord, ok: bool) -> None:
        plan = record.plan
        self._plans.pop(plan.plan_id, None)
        kind = plan.kind
        n = plan.num_blocks
        nbytes = n * self.bytes_per_block
        e = self._entries.get(plan.request_id) if plan.request_id is not None else None
        cpu = self.cpu_pool
        if kind is PlanKind.OFFLOAD:
            assert cpu is not None
            if ok:
                cpu.cache_block_hashes([b for b, _ in record.cache_on_done], [h for _, h in record.cache_on_done])
                self.counters.offload_blocks += n
                self.counters.offload_bytes += nbytes
            # Unhashed (failed) CPU blocks go to the front, cached ones to the back (LRU).
            cpu.free_blocks(record.cpu_holds[::-1])
            if record.in_place:
                self.gpu_pool.release_in_place(record.gpu_holds)
            else:
                self.gpu_pool.free_blocks(record.gpu_holds[::-1])
            return
        assert e is not None and e.plan_id == plan.plan_id, f"plan {plan.plan_id} has no owner"
        e.plan_id = None
        if kind is PlanKind.SWAP_OUT:
            assert cpu is not None
            if ok:
                cpu.cache_block_hashes([b for b, _ in record.cache_on_done], [h for _, h in record.cache_on_done])
                assert record.cpu_table is not None
                e.cpu_table = record.cpu_table
                self.gpu.free(e.request)  # exclusive blocks return (hashed ones stay findable)
                e.state = RequestState.SWAPPED
                e.num_offloaded_blocks = 0
                self.counters.swap_out_blocks += n
                self.counters.swap_out_bytes += nbytes
            else:
                # Forward order puts the fresh reservations back at the front exactly as they
                # were taken; CPU-cached blocks it had touched return to the back.
                cpu.free_blocks(record.cpu_holds)
                e.num_kv_tokens = 0
                e.state = RequestState.RUNNING
            return
        # SWAP_IN or ONBOARD: GPU blocks in the request's table are the destination.
        if ok:
            if record.cache_on_done:
                self.gpu_pool.cache_block_hashes(
                    [b for b, _ in record.cache_on_done], [h for _, h in record.cache_on_done]
                )
            if kind is PlanKind.SWAP_IN:
                assert cpu is not None
                cpu.free_blocks([c for c in e.cpu_table if c is not None][::-1] + record.cpu_holds[::-1])
                e.cpu_table = []
                e.request.num_computed_tokens = record.tokens
                self.gpu.num_cached_block[plan.request_id] = record.tokens // self.block_size
                self.counters.swap_in_blocks += n
                self.counters.swap_in_bytes += nbytes
            else:
                assert cpu is not None
                cpu.free_blocks(record.cpu_holds[::-1])
                e.request.num_computed_tokens += record.tokens
                self.gpu.num_cached_block[plan.request_id] = e.request.num_computed_tokens // self.block_size
                self.counters.onboard_blocks += n
                self.counters.onboard_bytes += nbytes
            e.state = RequestState.RUNNING
            return
        # Failed: the fresh GPU blocks were never cached, so nobody read them; release them.
        self.gpu.free(e.request)
        if cpu is not None:
            cpu.free_blocks(record.cpu_holds[::-1])
        if kind is PlanKind.SWAP_IN:
            e.state = RequestState.SWAPPED
        else:
            e.request.num_computed_tokens = 0
            e.state = RequestState.PREEMPTED

    # ================================================================ metrics
    @_exclusive
    def metrics(self) -> MetricsSnapshot:
        by_state: dict[str, int] = {}
        for e in self._entries.values():
            by_state[e.state.value] = by_state.get(e.state.value, 0) + 1
        cpu = self.cpu_pool
        return MetricsSnapshot(
            counters=TierCounters(**{f: getattr(self.counters, f) for f in TierCounters.__dataclass_fields__}),
            gpu_usage=self.gpu_pool.get_usage(),
            cpu_usage=cpu.get_usage() if cpu is not None else 0.0,
            gpu_free_blocks=self.gpu_pool.get_num_free_blocks(),
            cpu_free_blocks=cpu.get_num_free_blocks() if cpu is not None else 0,
            plans_in_flight=len(self._plans),
            requests_by_state=by_state,
        )

    # ============================================================= invariants
    @_exclusive
    def check_invariants(self) -> None:
        """Assert ownership and recoverability (O(blocks); for tests)."""
        self.gpu_pool.check_invariants()
        owners_gpu = [0] * self.gpu_pool.num_blocks
        for rid, blocks in self.gpu.req_to_blocks.items():
            e = self._entries.get(rid)
            assert e is not None, f"GPU table of unmanaged request {rid!r}"
            assert e.state in (RequestState.RUNNING, RequestState.SWAPPING_OUT, RequestState.SWAPPING_IN), (
                f"{rid!r} is {e.state.value} but holds a GPU table"
            )
            for b in blocks:
                owners_gpu[b.block_id] += 1
        for r in self._plans.values():
            for b in r.gpu_holds:
                owners_gpu[b.block_id] += 1
        for b in self.gpu_pool.blocks[1:]:
            assert b.ref_cnt == owners_gpu[b.block_id], (
                f"GPU block {b.block_id}: ref_cnt {b.ref_cnt} but {owners_gpu[b.block_id]} owners"
            )
        if self.cpu_pool is not None:
            self.cpu_pool.check_invariants()
            owners_cpu = [0] * self.cpu_pool.num_blocks
            for e in self._entries.values():
                for c in e.cpu_table:
                    if c is not None:
                        owners_cpu[c.block_id] += 1
            for r in self._plans.values():
                for c in r.cpu_holds:
                    owners_cpu[c.block_id] += 1
            for c in self.cpu_pool.blocks[1:]:
                assert c.ref_cnt == owners_cpu[c.block_id], (
                    f"CPU block {c.block_id}: ref_cnt {c.ref_cnt} but {owners_cpu[c.block_id]} owners"
                )
        bs = self.block_size
        for rid, e in self._entries.items():
            req = e.request
            if e.state in (RequestState.RUNNING, RequestState.SWAPPING_OUT):
                table = self.gpu.req_to_blocks.get(rid, [])
                assert len(table) * bs >= req.num_computed_tokens, f"{rid!r}: computed KV not covered by GPU blocks"
            elif e.state is RequestState.SWAPPED:
                assert len(e.cpu_table) == -(-e.num_kv_tokens // bs), f"{rid!r}: CPU table does not cover its KV"
                for i, c in enumerate(e.cpu_table):
                    # Not on the CPU: a full block shared on the GPU, recoverable by hash or recompute.
                    assert c is not None or i < e.num_kv_tokens // bs, f"{rid!r}: partial block {i} lost"
            elif e.state is RequestState.PREEMPTED:
                assert req.num_computed_tokens == 0 and rid not in self.gpu.req_to_blocks and not e.cpu_table
