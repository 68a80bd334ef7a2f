"""TierManager: where every request's KV lives, across a prefix-cached GPU pool and the tiers below it.

One class, in the order a request meets it: the constructor (the one place the
manager's state is declared), the verbs that move a request between tiers
(admit, allocate, quote, preempt, resume, drop, free), write-through of
computed prompt blocks, the settling of final copies (``poll``, ``cancel``),
the attach of the tiers below the CPU store, then the queries.  It returns
outcomes and never writes a request's progress (the scheduler's) or touches
tensor data.

The parts that have their own state are their own classes, which the manager
drives: the GPU pool and block tables (:class:`~tiered_kv.core.KVCacheManager`),
the copies in flight, what they hold and the swaps among them (:mod:`.transfers`),
the prices of preemption and of loads (:mod:`.pricing`), the CPU prefix tier's
stores and loads (:mod:`.offload`), the tiers below the CPU store
(:mod:`.tier_moves`), the stores themselves (:mod:`tiered_kv.tiers`), and the
victim policies with the per-request bounds behind cost-aware ranking
(:mod:`.victim_policy`).  The manager alone moves a residency, by
:data:`~.states.TRANSITIONS` (:func:`move`), and counts what each settled copy moved.

A block that a copy reads or writes is never handed to a new owner: copies hold
the GPU blocks they read, loads pin the store blocks they read, destinations
are fresh blocks nobody can hit until the copy lands, and a failed or
cancelled copy leaves the KV where it was.  Not thread-safe: a second thread
entering raises :class:`~tiered_kv.errors.ConcurrentUseError`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import ConcurrentUseError, InvalidArgumentError, InvalidTransitionError, UnknownRequestError
from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.manager_config import ManagerConfig
from tiered_kv.manager.metrics import MetricsSnapshot, TierCounters, snapshot
from tiered_kv.manager.offload import Offloader
from tiered_kv.manager.outcomes import Admission, Completion, Decision, LoadDecision, Preemption, Resumption, Room
from tiered_kv.manager.pricing import CostModel, Quote, checked_cost_model
from tiered_kv.manager.states import FROM, IN_FLIGHT, MODES, TRANSITIONS, KVState, PreemptMode, Residency
from tiered_kv.manager.tier_moves import Reserved, TierMoves
from tiered_kv.manager.transfers import SwappedKV, Swapper, Transfer, Transfers
from tiered_kv.manager.victim_policy import (
    Candidate,
    CandidatePrices,
    PreemptBounds,
    VictimPolicy,
    get_victim_policy,
)
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.engine import CopyEngine, GatedCopyEngine
from tiered_kv.transfer.plan import CPU, GPU, PlanKind, TransferHandle, TransferPlan

EMPTY_PROMPT = (
    "the prompt is empty: there is nothing to prefill and nothing to sample from; give it at least one "
    "token (vLLM refuses it too: 'The decoder prompt cannot be empty')"
)
"""Why a request with an empty prompt cannot be served (vLLM 0.33's input processor refuses one)."""

_GPU = Residency.GPU  # read per call of allocate: a module constant is much cheaper than the enum's attribute

_End = TypeVar("_End", Residency, None, Residency | None)


def move(verb: str, start: Residency | None, end: _End) -> _End:
    """``end``, checked to be a transition of :data:`~.states.TRANSITIONS` (the manager moves a residency only here).

    An internal invariant: a move outside the table is a bug of the manager,
    never a caller's misuse (which the manager refuses before it changes anything).
    """
    assert end in TRANSITIONS[verb].get(start, ()), f"{verb}: no transition {_name(start)} -> {_name(end)}"
    return end


def _name(state: Residency | None) -> str:
    return "none" if state is None else state.value


F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """Guard a public method: a second thread entering while another is inside raises ``ConcurrentUseError``.

    The manager is driven by one scheduler, as in vLLM; copy engines finish
    handles on their own threads but never call it.  Two threads interleaving
    calls would corrupt its books silently, so the entry is refused instead of
    serialised.  The lock is re-entrant: the owning thread may call back in
    (an engine's ``submit`` may poll, a public method may call another).
    """

    @functools.wraps(method)
    def guarded(self: TierManager, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if not lock.acquire(False):
            raise ConcurrentUseError(
                f"{type(self).__name__}.{method.__name__} was called while another thread is inside it; "
                f"a {type(self).__name__} is single-threaded: drive it from one thread at a time"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return cast(F, guarded)


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


class TierManager:
    """A prefix-cached GPU pool and a CPU store under one manager.

    Args:
        config: Tier sizes and policies (:class:`~.manager_config.ManagerConfig`).
        copy_engine: Executes plans (``submit``/``cancel``).
        kv_spec: The KV geometry of the tiers; bytes per block come from it.
            Default: the copy engine's (``engine.spec``), else the cost model's.
        cost_model: Swap and recompute estimates; refused if built for another
            KV shape.  Default: one built from ``kv_spec``.

    Attributes:
        config: The settings it was built from.
        decision_log: Why each preemption took its mode (a :class:`~.bounded_log.BoundedLog`
            of :class:`~.outcomes.Decision`, the latest ``config.log_size``).
    """

    def __init__(
        self,
        config: ManagerConfig,
        copy_engine: CopyEngine,
        *,
        kv_spec: KVSpec | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        cfg = checks.instance("config", config, ManagerConfig)
        if not all(callable(getattr(copy_engine, n, None)) for n in ("submit", "cancel")):
            raise InvalidArgumentError(
                f"copy_engine must have submit() and cancel(), got {checks.describe(copy_engine)}"
            )
        block_size, enable_caching = cfg.block_size, cfg.enable_caching
        _check_engine_tiers(copy_engine, cfg.num_gpu_blocks, cfg.num_cpu_blocks)
        self.config: ManagerConfig = cfg
        #: The GPU pool and every request's block table.
        self.gpu: KVCacheManager = KVCacheManager(
            cfg.num_gpu_blocks,
            block_size,
            enable_caching=enable_caching,
            hash_fn=cfg.hash_fn,
            hash_seed=cfg.hash_seed,
            watermark=cfg.watermark,
        )
        self.cost_model: CostModel = checked_cost_model(kv_spec, cost_model, copy_engine, block_size)
        spec = kv_spec if kv_spec is not None else getattr(copy_engine, "spec", None)
        #: KV layers, for layer-wise copies (0: unknown, no kv_spec and an engine without one).
        self.num_layers: int = spec.num_layers if isinstance(spec, KVSpec) else 0
        self.block_size: int = block_size
        self.caching: bool = enable_caching
        #: The CPU tier; without one (``num_cpu_blocks=0``) an empty store, which refuses every store,
        #: so every path runs the same way and nothing asks whether the tier exists.
        self.store: CPUStore = CPUStore(max(cfg.num_cpu_blocks, 1), cfg.store_policy)
        #: Whether there is a CPU tier to swap and offload to.
        self.has_cpu_tier: bool = cfg.num_cpu_blocks > 0
        self.offload: str = cfg.offload if self.has_cpu_tier else "none"
        self.evict_window: int = cfg.evict_window
        #: The copies in flight and the blocks each holds.
        self.transfers: Transfers = Transfers(copy_engine, self.gpu.block_pool)
        tr = self.transfers
        # Told of every hold and release of a GPU block, by the manager alone (its parts never call up).
        self._bounds: PreemptBounds = PreemptBounds(self.gpu, self.cost_model)
        self._swap: Swapper = Swapper(self.gpu, self.store, tr, enable_caching)
        #: The CPU store's view of each admitted request that has not finished (vLLM 0.33's request scope).
        self._store_requests: dict[Hashable, RequestContext] = {}
        self._off: Offloader = Offloader(self.gpu, self.store, tr, self._store_requests)
        self._counters: TierCounters = TierCounters()  # read through the live ``counters`` property
        self.decision_log: BoundedLog[Decision] = BoundedLog(cfg.log_size)
        self._lower: TierMoves | None = None  # the tiers below the CPU store, once attached
        self._held: dict[Hashable, Held] = {}
        # Requests given GPU blocks for the current step (admitted, or allocated) -> the progress they reach
        # once the step is computed: no victims before they reach it, within the step (see ``preempt``).  A
        # step ends at ``poll`` (a scheduler's first call of a step) or ``on_schedule_end``; never iterated.
        self._batched: dict[Hashable, int] = {}
        self._tick: int = 0
        self._gpu_evicted_seen: int = 0  # the GPU pool's eviction count at the last poll
        self._lock: threading.RLock = threading.RLock()  # the entry guard (see ``exclusive``)

    # ============================================================ admission
    @exclusive
    def admit(
        self,
        request: Request,
        max_new_tokens: int,
        num_lookahead_tokens: int = 0,
        *,
        chunked: bool = True,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> Admission | None:
        """First allocation of a request: prefix lookup on the GPU, then the CPU store; ``None`` if it does not fit.

        GPU hits are touched.  CPU hits are pinned and loaded into fresh GPU
        blocks by an ONBOARD plan; the request may run once it lands.  New
        tokens start after every hit and are capped at ``max_new_tokens``.
        Every argument is checked before anything changes.

        The gates of vLLM 0.33's waiting loop, each a refusal (``None``, nothing
        changed) as in vLLM: ``chunked=False`` refuses a request whose tokens
        left after its hits exceed ``max_new_tokens`` (a prefill that must fit
        one step); ``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl``)
        refuses one whose whole sequence the pool could not hold now; and while
        ``has_scheduled_reqs`` (other requests are running) the admission must
        leave :attr:`watermark_blocks` free.  A load from below the CPU tier
        that comes out shorter than found leaves more to compute, chunked at
        ``max_new_tokens`` even with ``chunked=False``.
        """
        checks.instance("request", request, Request)
        checks.count("max_new_tokens", max_new_tokens, 1)
        checks.count("num_lookahead_tokens", num_lookahead_tokens)
        checks.flag("chunked", chunked)
        checks.flag("full_sequence_must_fit", full_sequence_must_fit)
        checks.flag("has_scheduled_reqs", has_scheduled_reqs)
        rid = request.request_id
        if rid in self._held:
            raise InvalidTransitionError(f"request {rid!r} is already held ({self._held[rid].residency.value})")
        if request.num_prompt_tokens == 0:
            raise InvalidArgumentError(f"request {rid!r}: {EMPTY_PROMPT}")
        if request.num_computed_tokens != 0:
            raise InvalidArgumentError(
                f"request {rid!r}: a request to admit has no computed tokens, got {request.num_computed_tokens}"
            )
        gpu_hits, n_gpu = self.gpu.get_computed_blocks(request)
        lower = self._lower
        found = lower.find(request, len(gpu_hits), n_gpu) if lower is not None else None
        if found is not None:
            keys = found.keys
        elif self.has_cpu_tier and self.caching:
            keys = self._off.cpu_hits(request, len(gpu_hits))
        else:  # no CPU tier (its store is empty: a lookup cannot hit) or no prefix caching
            keys = []
        n_cpu = len(keys) * self.block_size
        rest = request.num_tokens - n_gpu - n_cpu
        if not chunked and rest > max_new_tokens:
            return None
        n_new = min(max_new_tokens, rest)
        need = self.gpu.num_free_blocks_required(
            request,
            n_cpu + n_new,
            n_gpu,
            gpu_hits,
            num_lookahead_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        if need > self.gpu.block_pool.get_num_free_blocks():
            return None
        staged: tuple[TierMoves, Reserved] | None = None
        if found is not None:  # fits: pin and stage now (fewer blocks need no more room)
            assert lower is not None, "only the tiers below the CPU find prefixes there"
            staged = lower, lower.reserve(found)
            keys, n_cpu = staged[1].keys, len(staged[1].keys) * self.block_size
            n_new = min(max_new_tokens, request.num_tokens - n_gpu - n_cpu)
        new = self.gpu.allocate_slots(
            request,
            n_cpu + n_new,
            n_gpu,
            gpu_hits,
            num_lookahead_tokens,
            num_external_computed_tokens=n_cpu,
            full_sequence_must_fit=full_sequence_must_fit,
            has_scheduled_reqs=has_scheduled_reqs,
        )
        assert new is not None, "allocation was checked to fit"
        if gpu_hits:
            self._bounds.acquired(gpu_hits)
        h = self._held[rid] = Held(request, Residency.GPU)
        self._batched[rid] = n_gpu + n_cpu + n_new
        self._open_in_store(request)
        self._counters.count_lookup(request.num_tokens, n_gpu, n_cpu, self.has_cpu_tier, request.num_preemptions > 0)
        plan = None
        if keys:
            dst = list(self.gpu.get_blocks(rid)[len(gpu_hits) : len(gpu_hits) + len(keys)])
            if staged is not None:  # staging through the CPU tier: nothing to cancel until the GPU copy starts
                t, staging = staged[0].start(staged[1], dst, n_gpu)
            else:
                t, staging = self._off.start_load(request, keys, dst, n_gpu + n_cpu), False
            h.residency, h.plan_id, plan = (
                move("admit", None, Residency.LOADING),
                None if staging else t.plan.plan_id,
                t.plan,
            )
            h.num_hit_tokens = n_gpu
        self._tick += 1
        return Admission(new, n_gpu, n_cpu, n_new, plan)

    @exclusive
    def allocate(
        self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """Grow a request whose KV is on the GPU; ``None`` (nothing changed) if it does not fit.

        A request in a layer-wise swap-in may grow too (it computes while its KV
        lands); nothing of it is cached until the load has landed.  A request
        that got its tokens is batched for this step: it is no victim until the
        step ends (see :meth:`preempt`).
        """
        return self._allocate(request_id, num_new_tokens, num_lookahead_tokens)[1]

    @exclusive
    def grow(self, request_id: Hashable, num_new_tokens: int) -> int | None:
        """:meth:`allocate`, and how far the request may grow next without asking: a scheduler's one call per step.

        Returns ``None`` (nothing changed) when the tokens do not fit, else
        :meth:`quiet_tokens` after the allocation: while a later step keeps
        ``num_computed_tokens + num_new_tokens`` at most that value, allocating
        it would change nothing, and a scheduler may skip the call.  The answer
        holds until the request's KV leaves the GPU or a copy of it settles.
        """
        h, new = self._allocate(request_id, num_new_tokens, 0)
        if new is None:
            return None
        return self.gpu.num_quiet_tokens(request_id, delay_cache_blocks=h.residency is not _GPU)

    def _allocate(
        self, request_id: Hashable, num_new_tokens: int, num_lookahead_tokens: int
    ) -> tuple[Held, list[KVCacheBlock] | None]:
        # A hot path: the lookup of a request on the GPU is inlined; any other case goes through _get.
        try:
            h = self._held.get(request_id)
        except TypeError:
            h = None  # unhashable: _get names the problem
        if h is None or h.residency is not _GPU:
            h = self._get(request_id, *FROM["allocate"])
            if not h.layered:
                h = self._get(request_id, Residency.GPU)  # names the state it is in
            # Its restored blocks are being written: cache nothing until the load lands.
            new = self.gpu.allocate_slots(
                h.request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens, delay_cache_blocks=True
            )
        else:
            new = self.gpu.allocate_slots(h.request, num_new_tokens, 0, None, num_lookahead_tokens)
        if new is not None:
            self._batched[request_id] = h.request.num_computed_tokens + num_new_tokens
        return h, new

    @exclusive
    def quiet_tokens(self, request_id: Hashable) -> int:
        """The most tokens (computed plus new) ``allocate`` serves for the request without changing anything.

        ``allocate(request_id, n)`` with ``num_computed_tokens + n`` at most
        this value returns ``[]`` and changes no state, so a scheduler may skip
        it.  Valid until the request's KV leaves the GPU or a copy of it
        settles (a layer-wise load landing starts caching), whichever is first.
        Raises as ``allocate`` does for a request not on the GPU.
        """
        h = self._get(request_id, *FROM["allocate"])
        if h.residency is not _GPU:
            if not h.layered:
                self._get(request_id, Residency.GPU)  # raises, naming the state it is in
            return self.gpu.num_quiet_tokens(request_id, delay_cache_blocks=True)
        return self.gpu.num_quiet_tokens(request_id)

    # ============================================ preemption, resume, release
    @exclusive
    def quote(self, request_id: Hashable) -> Quote:
        """What preempting a request whose KV is on the GPU would cost, by swap and by recompute."""
        return self._swap.quote(self._get(request_id, Residency.GPU).request, self.cost_model)

    @exclusive
    def preempt(self, request_id: Hashable, mode: str = "auto", *, unschedule: bool = False) -> Preemption | None:
        """Preempt one request whose KV is on the GPU, by the mode its quote chooses under ``mode``.

        Recompute frees its GPU blocks now and forgets the request; swap starts
        a swap-out whose GPU blocks free when it lands.  ``mode="swap"`` where
        no swap is possible (no CPU tier, no room on it, or no computed token:
        nothing to swap) returns ``None`` and changes nothing; ``"auto"`` then
        recomputes and the decision log says why.

        The rule: a request batched in this step is no victim.  Once
        :meth:`admit` or :meth:`allocate` gave it blocks for the step's tokens,
        the step computes into them; preempting it would free them to another
        request (recompute) or copy them out while they are written (swap), and
        its :meth:`on_tokens_computed` would find it gone.  Choose victims
        among the requests not batched yet (vLLM's FCFS rule takes the last of
        the running queue, never scheduled before the request that needs
        room), or first take the victim out of the batch with
        :meth:`unschedule`, as vLLM's priority scheduling un-schedules one.  A
        request stops being batched when its step is computed (its
        ``num_computed_tokens`` reaches the tokens it was given, or
        :meth:`on_tokens_computed`), or when the step ends: at the next
        :meth:`poll` (a scheduler's first call in a step) or
        :meth:`on_schedule_end`.

        ``unschedule=True`` is :meth:`unschedule` first: the caller has taken
        the request out of this step's batch (it stays out whatever the answer).

        Raises:
            InvalidTransitionError: the request is not on the GPU, or it is
                batched in this step.  Nothing changes.
        """
        checks.choice("mode", mode, MODES)
        checks.flag("unschedule", unschedule)
        h = self._get(request_id, *FROM["preempt"])
        if unschedule:
            self._batched.pop(request_id, None)
        if h.request.num_computed_tokens < self._batched.get(request_id, 0):  # its step is not computed yet
            raise InvalidTransitionError(
                f"request {request_id!r} was batched in this step (admit or allocate gave it blocks for the "
                "step's tokens), and a request batched in this step is no victim: the step computes into the "
                "blocks a preemption takes.  Preempt a request not batched yet, or take this one out of the "
                "batch first (unschedule)"
            )
        q = self._swap.quote(h.request, self.cost_model)
        chosen, reason = q.choose(mode)
        if chosen is None:
            return None
        if chosen is PreemptMode.SWAP and q.num_tokens == 0:
            if mode == "swap":  # forced, and impossible: refused like any other impossible swap
                return None
            chosen, reason = PreemptMode.RECOMPUTE, f"nothing is computed yet, so there is nothing to swap; {reason}"
        plan = None
        if chosen is PreemptMode.SWAP:
            out = self._swap.start_out(h.request, q.num_tokens)
            if out is None:  # the quote said there was room: only an inconsistent store gets here
                return None
            if isinstance(out, Transfer):
                h.residency, h.plan_id, plan = Residency.SWAPPING_OUT, out.plan.plan_id, out.plan
            else:  # every block already on the CPU: swapped at once
                self._free_table(h.request)
                h.residency, h.swapped, h.num_stored_blocks = Residency.CPU, out, 0
            self._counters.preemptions_swap += 1
            now, later = (0, q.blocks_freed) if plan is not None else (q.blocks_freed, 0)
        else:
            self._forget(h)
            self._counters.preemptions_recompute += 1
            now, later = q.blocks_freed, 0
        self._tick += 1
        self.decision_log.append(Decision(self._tick, request_id, mode, chosen, reason, q))
        res = move("preempt", Residency.GPU, h.residency if request_id in self._held else None)
        return Preemption(request_id, chosen, reason, plan, now, later, res)

    @exclusive
    def resume(
        self, request_id: Hashable, layered: bool = False, *, num_new_tokens: int = 0, keep_watermark: bool = False
    ) -> Resumption | None:
        """Bring a swapped request back: re-hit what is still cached on the GPU, copy the rest in.

        ``layered``: copy layer by layer, one completion per layer, so the
        request can compute while its KV lands (layer ``i``'s attention waits
        for layer ``i`` only); it may :meth:`allocate` while SWAPPING_IN, and
        a failed load rolls back whatever it grew; the handle to wait on is
        the outcome's ``handle``.  ``None`` (nothing changed) when the GPU
        blocks do not fit: the request's KV, and room for ``num_new_tokens``
        more (:meth:`blocks_to_resume`), plus :attr:`watermark_blocks` with
        ``keep_watermark`` (a preempted request coming back while others run
        leaves the watermark free, as an admission does).
        """
        h = self._get(request_id, *FROM["resume"])
        checks.flag("layered", layered)
        checks.flag("keep_watermark", keep_watermark)
        if layered and not self.num_layers:
            raise InvalidArgumentError("a layer-wise swap-in needs the KV's layer count: give the manager kv_spec=")
        swapped = h.swapped
        assert swapped is not None
        need = self._blocks_to_resume(h, swapped, checks.count("num_new_tokens", num_new_tokens))
        if need + (self.gpu.watermark_blocks if keep_watermark else 0) > self.gpu.block_pool.get_num_free_blocks():
            return None
        out = self._swap.start_in(h.request, swapped, self.num_layers if layered else 0)
        if out is None:
            return None
        hits, t = out
        if hits:
            self._bounds.acquired(hits)
        self._tick += 1
        if t is not None:
            h.residency, h.plan_id, h.layered = (
                move("resume", Residency.CPU, Residency.SWAPPING_IN),
                t.plan.plan_id,
                layered,
            )
            return Resumption(request_id, swapped.num_tokens, t.plan, t.handle)
        self._swap.finish_in(h.request, swapped)
        h.residency, h.swapped = move("resume", Residency.CPU, Residency.GPU), None
        return Resumption(request_id, swapped.num_tokens, None)

    @exclusive
    def drop_swapped(self, request_id: Hashable) -> None:
        """Give up a swapped request's CPU copy: it will be recomputed (the scheduler resets its progress)."""
        self._forget(self._get(request_id, *FROM["drop_swapped"]))
        self._counters.swaps_dropped += 1

    @exclusive
    def free(self, request_id: Hashable, *, cancel: bool = False) -> bool:
        """End a request (finished or aborted): release what it holds in every tier, and close it; True if ended.

        Every request :meth:`is_open` ends here once, wherever its KV is: on
        the GPU or the CPU, or already gone (a recompute victim waiting to be
        admitted again, a failed or cancelled onboarding, a dropped swap),
        because its request in the CPU store stays open until then (a request
        re-admitted after a preemption is the same request, as in vLLM).
        Closing it finishes that request in the store, whose policy then
        commits the request's uses; its copies may still land afterwards.

        ``cancel=True`` (an abort) first cancels a copy of its KV in flight
        (:meth:`cancel`) and ends the request once the copy is rolled back;
        when the engine finished the copy first, nothing changes and the answer
        is False: settle the copy (:meth:`poll`), then free.

        Raises:
            UnknownRequestError: the request is not open (never admitted here,
                or freed already).
            InvalidTransitionError: a copy of its KV is in flight and
                ``cancel`` is False (cancel it or wait for it first).  Nothing
                changes in either case.
        """
        checks.hashable("request_id", request_id)
        checks.flag("cancel", cancel)
        h = self._held.get(request_id)
        if cancel and h is not None and h.residency in IN_FLIGHT:
            if not self._cancel(h):
                return False
            h = self._held.get(request_id)
        if h is None and request_id not in self._store_requests:
            raise UnknownRequestError(
                f"request {request_id!r} is not held by this tier manager and not open in its CPU store "
                "(never admitted here, or freed already)"
            )
        if h is not None:
            if h.residency in IN_FLIGHT:
                raise InvalidTransitionError(
                    f"request {request_id!r} is {h.residency.value} (plan {h.plan_id} in flight); "
                    "cancel the copy or wait for it before freeing"
                )
            self._forget(h)
        self._batched.pop(request_id, None)
        ctx = self._store_requests.pop(request_id, None)
        if ctx is not None:  # finished: the store commits the request's recency (its copies may still land)
            self.store.on_request_finished(ctx)
        return True

    @exclusive
    def is_open(self, request_id: Hashable) -> bool:
        """Whether :meth:`free` has something to end for the request.

        True from admission until :meth:`free`: while the manager holds the
        request's KV (:meth:`holds`), and also after it lost it without the
        request ending (a recompute victim, a failed or cancelled onboarding, a
        dropped swap), while its request stays open in the CPU store (an
        empty store without a CPU tier: the rule is the same).
        """
        rid = checks.hashable("request_id", request_id)
        return rid in self._held or rid in self._store_requests

    @exclusive
    def state(self, request_id: Hashable) -> KVState:
        """The request's state in the manager: open or not, and where its KV is (the one state machine's state).

        Any hashable id is answered (``KVState(False, None)`` for one never
        admitted or freed already); a scheduler reads this instead of keeping
        a copy of where each request's KV is.
        """
        rid = checks.hashable("request_id", request_id)
        h = self._held.get(rid)
        return KVState(h is not None or rid in self._store_requests, h.residency if h is not None else None)

    @exclusive
    def room(self, request_id: Hashable | None = None, num_new_tokens: int = 0) -> Room:
        """GPU room now for the request's next tokens, and what copies in flight will give back (see :class:`Room`).

        ``request_id=None`` asks about no request (``blocks_short`` is 0).
        Raises as :meth:`allocate` does for a request not on the GPU.
        """
        short = 0
        if request_id is not None:
            h = self._get(request_id, Residency.GPU, Residency.SWAPPING_IN)
            req = (h if h.layered else self._get(request_id, Residency.GPU)).request
            need = self.gpu.num_blocks_to_allocate(req, num_new_tokens)
            short = max(need - self.gpu.block_pool.get_num_free_blocks(), 0)
        return Room(short, self.transfers.blocks_freed_on_completion(self.gpu), len(self.transfers))

    @exclusive
    def victim(
        self,
        requester: Hashable,
        ranked: Sequence[Hashable],
        policy: str | VictimPolicy = "last_admitted",
        mode: str = "auto",
    ) -> Hashable | None:
        """Who to preempt so that ``requester`` fits: ``policy``'s first among ``ranked``; ``None`` if nobody may go.

        ``ranked``: the candidates in the scheduler's own preemption order
        (vLLM's rule; the last is preempted first by ``last_admitted``), every
        one on the GPU; ``requester`` may be among them.  The policy (a name
        or an instance, see :mod:`~tiered_kv.manager.victim_policy`) re-ranks
        them from their quotes and this manager's counts.  Under
        ``mode="swap"`` a candidate that cannot be swapped (no room on the CPU
        tier, nothing computed) is passed over, except the requester, which
        then yields by recompute.  Nothing changes.
        """
        checks.choice("mode", mode, MODES)
        held = [self._get(rid, Residency.GPU) for rid in ranked]
        prices = CandidatePrices(
            {h.request.request_id: h.request for h in held}, self._swap, self._bounds, self.cost_model
        )
        quote, bounds = prices.quote, prices.lower_bounds
        candidates = [
            Candidate(
                h.request.request_id,
                rank,
                len(self.gpu.get_blocks(h.request.request_id)),
                h.request.num_computed_tokens,
                h.request.num_prompt_tokens,
                quote,
                bounds,
            )
            for rank, h in enumerate(held)
        ]
        swap_only = mode == "swap"
        room = self.store.num_free + self.store.num_evictable if swap_only else 0
        for c in get_victim_policy(policy, self.cost_model).iter_rank(candidates, mode):
            if swap_only and c.request_id != requester:
                q = c.quote
                if not q.can_swap or q.cpu_blocks_needed > room:
                    continue
            return c.request_id
        return None

    @exclusive
    def unschedule(self, request_id: Hashable) -> None:
        """Take a request out of this step's batch, so that it may be preempted (see :meth:`preempt`).

        For a scheduler that drops a request it had batched, as vLLM's priority
        scheduling un-schedules a victim it scheduled earlier in the step: the
        caller promises not to compute the request in this step.  The blocks the
        step gave it stay in its table (a later step computes into them), as in
        vLLM.  A request that is not batched is left as it is.

        Raises:
            UnknownRequestError: the manager does not hold the request.
        """
        self._get(request_id)
        self._batched.pop(request_id, None)

    def _open_in_store(self, request: Request) -> None:
        """Admission is a new request for the CPU store; a re-admission (after a preemption) is the same one.

        Positions are each prompt block's end token, so the store ranks a
        request's tail before its head.
        """
        store = self.store
        rid = request.request_id
        ctx = self._store_requests.get(rid)
        if ctx is None:
            ctx = RequestContext(rid)
            store.on_new_request(ctx)
            self._store_requests[rid] = ctx
        if request.block_hashes and self.has_cpu_tier:  # without one, no load or store ever reads a position
            ctx.set_positions(list(request.block_hashes), self.block_size, self.block_size)

    @exclusive
    def on_schedule_end(
        self, new_req_ids: list[Hashable], preempted_req_ids: list[Hashable], *, layerwise_stores: bool = False
    ) -> dict[Hashable, TransferHandle]:
        """The end of a scheduler step: the CPU store's ``on_schedule_end`` (vLLM 0.33's step hook).

        The step's batch is final: its requests may be chosen as victims again
        in the next step (see :meth:`preempt`).  With ``layerwise_stores``
        (write-through, layer by layer), first the prompt blocks each batched
        request completes in this step are stored as the step computes them
        (:meth:`start_layerwise_store`, in the order the batch was given its
        blocks; not for a request whose own KV is still landing): returns each
        store's handle by request, whose layers the driver opens as it
        computes them.
        """
        checks.flag("layerwise_stores", layerwise_stores)
        saves: dict[Hashable, TransferHandle] = {}
        if layerwise_stores:
            for rid, upto in self._batched.items():
                h = self._held.get(rid)
                if h is None or h.residency is not _GPU or h.request.num_computed_tokens >= h.request.num_prompt_tokens:
                    continue  # its KV is still arriving, or it is decoding: nothing of the prompt to store
                plan = self._start_layerwise_store(h, upto)
                if plan is not None:
                    t = self.transfers.get(plan.plan_id)
                    if t is not None:
                        saves[rid] = t.handle
        self.store.on_schedule_end(new_req_ids, preempted_req_ids)
        self._batched.clear()
        return saves

    def _free_table(self, request: Request) -> None:
        """Free the request's GPU table (``KVCacheManager.free``) and tell the bounds which blocks lost a holder."""
        blocks = self.gpu.get_blocks(request.request_id)  # the live list: the pool's free leaves it as it is
        self._bounds.forget(request.request_id)
        self.gpu.free(request)
        if blocks:
            self._bounds.released(blocks)

    def _forget(self, h: Held) -> None:
        self._free_table(h.request)
        if h.swapped is not None:
            self._swap.release(h.swapped)
        del self._held[h.request.request_id]

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

    # ======================================================== write-through
    # With offload="write_through" every full prompt block is stored on the CPU once it is computed, so a
    # later request with the same prefix loads it instead of computing it again; a layer-wise store
    # overlaps the rest of the forward pass.
    @exclusive
    def on_tokens_computed(self, request_id: Hashable) -> TransferPlan | None:
        """The step that computed the request's tokens finished: with write-through, store its new full prompt blocks.

        Only steps that computed prompt tokens can complete such blocks, so a
        scheduler may skip the call on decode steps.
        """
        h = self._get(request_id, Residency.GPU)
        self._batched.pop(request_id, None)  # its step is computed: a victim again
        if self.offload != "write_through":
            return None
        return self._store_prompt_blocks(h, h.request.num_computed_tokens)

    @exclusive
    def start_layerwise_store(self, request_id: Hashable, num_tokens_after_step: int) -> TransferPlan | None:
        """Write-through, layer by layer: store the prompt blocks the coming step completes as it computes them.

        Called before the step.  The plan is gated: layer ``i`` is copied
        only after the driver opens it (``open_layer``) once compute has
        written it, so the store overlaps the rest of the forward pass, as
        LMCache and SGLang's HiCache store a prefill.  ``None`` when nothing
        is to be stored, write-through is off, or the copy engine cannot gate.
        The later ``on_tokens_computed`` does not store these blocks again.
        """
        h = self._get(request_id, Residency.GPU)
        req = h.request
        checks.count("num_tokens_after_step", num_tokens_after_step, req.num_computed_tokens)
        if num_tokens_after_step > len(req.all_token_ids):
            raise InvalidArgumentError(
                f"num_tokens_after_step {num_tokens_after_step} exceeds request {request_id!r}'s "
                f"{len(req.all_token_ids)} tokens"
            )
        return self._start_layerwise_store(h, num_tokens_after_step)

    def _start_layerwise_store(self, h: Held, num_tokens_after_step: int) -> TransferPlan | None:
        if self.offload != "write_through" or not self.num_layers:
            return None
        if not isinstance(self.transfers.engine, GatedCopyEngine):
            return None
        return self._store_prompt_blocks(h, num_tokens_after_step, self.num_layers)

    def _store_prompt_blocks(self, h: Held, num_tokens: int, gated_layers: int = 0) -> TransferPlan | None:
        """Store the full prompt blocks within the first ``num_tokens`` that are not stored yet."""
        upto = min(num_tokens, h.request.num_prompt_tokens) // self.block_size
        if upto <= h.num_stored_blocks:
            return None
        t = self._off.write_through(h.request, h.num_stored_blocks, upto, gated_layers)
        h.num_stored_blocks = upto
        if t is None:
            return None
        self._bounds.acquired(t.gpu_holds)
        return t.plan

    def _open_all_layers(self, handle: TransferHandle) -> None:
        """Open every layer of a gated store the driver has not opened (its step's compute is done)."""
        checks.instance("handle", handle, TransferHandle)
        engine = self.transfers.engine
        assert isinstance(engine, GatedCopyEngine), "gated plans are made only for engines that open layers"
        for layer in range(handle.num_opened, handle.plan.num_layers):
            engine.open_layer(handle, layer)

    # ============================================== settling of final copies
    # Copies complete on the engine's side; the manager learns of them only at poll (every final copy,
    # in plan order), process_completion (one now) or cancel.  A landed copy hands its blocks on; a
    # failed or cancelled one is rolled back so the KV stays where it was.
    @exclusive
    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Settle every copy whose handle is final, in plan order; return what settled.

        With on-evict offload it then tops up the saves before eviction: once
        per scheduler step is often enough.  A scheduler polls first in each
        step, so a poll also starts a new batch (see :meth:`preempt`).
        ``timeout`` other than 0 first waits, up to that long (``None``: no
        limit), for some copy in flight to become final (:meth:`wait`): a real
        engine's driver with nothing to compute waits here.
        """
        if timeout != 0.0:
            self.transfers.wait(checks.timeout("timeout", timeout))
        self._batched.clear()
        done = [c for t in self.transfers.finished() if (c := self._settle(t)) is not None]
        self._drain_events()
        if self.offload == "write_back":
            t = self._off.save_window(self.evict_window)
            if t is not None:
                self._bounds.acquired(t.gpu_holds)
        if self._lower is not None:
            self._lower.tick()
        return done

    @exclusive
    def step_computed(
        self, saves: Sequence[TransferHandle] = (), loads: Sequence[TransferHandle] = ()
    ) -> list[Completion]:
        """A step's compute is done: open every layer of its layer-wise ``saves``, settle its layer-wise ``loads``.

        Every layer of a gated store the driver did not open is opened (the
        step wrote them all), then each layer-wise swap-in the step computed
        over is settled now, in the order given (one already settled by an
        abort is skipped): returns their completions.
        """
        for h in saves:
            self._open_all_layers(h)
        done: list[Completion] = []
        for h in loads:
            t = self.transfers.get(h.plan.plan_id)
            if t is not None and t.handle is h:  # not settled by an abort meanwhile
                done.append(self.process_completion(h))
        return done

    @exclusive
    def process_completion(self, handle: TransferHandle) -> Completion:
        """Settle one final handle now (instead of at the next ``poll``).

        Raises:
            PlanError: unknown, settled already, not final, not the plan this
                manager emitted under its id, or a move between tiers below the
                GPU that ``poll`` settles.  Nothing changes.
        """
        c = self._settle(self.transfers.take(checks.instance("handle", handle, TransferHandle)))
        assert c is not None, "only moves of the tiers below the GPU settle silently"
        return c

    @exclusive
    def cancel(self, request_id: Hashable) -> bool:
        """Cancel the request's copy in flight; True only if it was cancelled, and then it is rolled back now.

        A copy the engine finished first is left for ``poll`` to settle as what
        it is, and the answer is False.
        """
        return self._cancel(self._get(request_id))

    def _cancel(self, h: Held) -> bool:
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
    def wait(self, timeout: float | None = None) -> bool:
        """Block until some copy in flight is final (real engines); False if nothing is in flight."""
        return self.transfers.wait(checks.timeout("timeout", timeout))

    def _settle(self, t: Transfer) -> Completion | None:
        lower = self._lower
        if lower is not None and lower.owns(t):
            return self._settle_staged(lower, t)
        kind, rid = t.plan.kind, t.plan.request_id
        ok, n_tok = t.ok, 0
        if kind is PlanKind.OFFLOAD:
            released = self._off.settle_store(t)
            if released:
                self._bounds.released(released)
        else:
            h = self._held[rid]
            h.plan_id, h.layered = None, False
            swap = self._swap
            if kind is PlanKind.ONBOARD:
                loaded = self._off.settle_load(h.request, t)
                n_tok = h.num_hit_tokens + loaded if ok else 0
                new = Residency.GPU if ok else None  # a failed load leaves nothing: recompute from scratch
                if not ok:
                    self._free_table(h.request)
            elif kind is PlanKind.SWAP_OUT:
                h.swapped = swap.settle_out(t)
                ok = h.swapped is not None  # landed but the KV is not whole on the CPU: rolled back
                new, h.num_stored_blocks = (Residency.CPU if ok else Residency.GPU), 0
                if ok:
                    self._free_table(h.request)
            else:
                swapped = h.swapped
                assert swapped is not None
                ok = swap.settle_in(h.request, t)
                n_tok, new = (swapped.num_tokens, Residency.GPU) if ok else (0, Residency.CPU)
                if ok:
                    h.swapped = None
                else:
                    self._free_table(h.request)
            move("settle", h.residency, new)
            if new is None:
                del self._held[rid]
            else:
                h.residency = new
        n, c = t.plan.num_blocks, self._counters
        nbytes = n * self.cost_model.bytes_per_block
        if not ok:
            if t.cancelled:
                c.plans_cancelled += 1
            else:
                c.plans_failed += 1
        elif kind is PlanKind.SWAP_OUT:
            c.swap_out_blocks, c.swap_out_bytes = c.swap_out_blocks + n, c.swap_out_bytes + nbytes
        elif kind is PlanKind.SWAP_IN:
            c.swap_in_blocks, c.swap_in_bytes = c.swap_in_blocks + n, c.swap_in_bytes + nbytes
        elif kind is PlanKind.ONBOARD:
            c.onboard_blocks, c.onboard_bytes = c.onboard_blocks + n, c.onboard_bytes + nbytes
        elif kind is PlanKind.OFFLOAD:
            c.offload_blocks, c.offload_bytes = c.offload_blocks + n, c.offload_bytes + nbytes
        res = self._held[rid].residency if rid in self._held else None
        err = t.handle.error
        why = None if err is None else f"{type(err).__name__}: {err}"
        return Completion(t.plan.plan_id, rid, kind, ok, n_tok, res, t.handle.num_bytes, t.handle.elapsed_s, why)

    def _settle_staged(self, lower: TierMoves, t: Transfer) -> Completion | None:
        """A move of the chain settled; the last staging move of a load starts its GPU copy, or ends the load."""
        out = lower.settle(t)
        if out is None:
            return None
        rid, gpu_copy = out
        h = self._held[rid]
        if gpu_copy is not None:
            h.plan_id = gpu_copy.plan.plan_id
            return None
        h.residency = move(
            "settle", h.residency, Residency.GPU
        )  # nothing landed: the request computes all of it, keeping its GPU hits
        return Completion(t.plan.plan_id, rid, PlanKind.ONBOARD, True, h.num_hit_tokens, Residency.GPU)

    def _drain_events(self) -> None:
        """GPU evictions since the last poll join the counters here (the pool never calls up).

        The pool counts them itself (``num_evicted_blocks``), so the manager keeps the
        pool's events off: building a ``BlockStored`` per cached range and a
        ``BlockRemoved`` per eviction only to count the latter cost more than the count.
        """
        n = self.gpu.block_pool.num_evicted_blocks
        self._counters.gpu_blocks_evicted += n - self._gpu_evicted_seen
        self._gpu_evicted_seen = n

    # ======================================================== lower tiers
    # What the tiers below the CPU store change (admission finds prefixes below the CPU and stages them
    # up; blocks leaving the CPU go down) is in TierMoves (tier_moves.py); here is only the attach.
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
        if not self.has_cpu_tier or not self.caching:
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

    # ============================================================ queries (nothing here changes state)
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
    def gpu_table_length(self, request_id: Hashable) -> int:
        """How many blocks the request's GPU block table holds (``len(gpu_block_ids(...))`` without the list).

        One request's table, not the pool (the constructor's ``num_gpu_blocks``).
        """
        return len(self.gpu.get_blocks(self._get(request_id).request.request_id))

    @exclusive
    def cpu_block_ids(self, request_id: Hashable) -> list[int]:
        """The CPU slots of a swapped request's KV, in block order (fixed while it is swapped)."""
        s = self._get(request_id).swapped
        return list(s.spec.block_ids) if s is not None else []

    @exclusive
    def num_free_gpu_blocks(self) -> int:
        return self.gpu.block_pool.get_num_free_blocks()

    @property
    def watermark_blocks(self) -> int:
        """GPU blocks an admission leaves free while other requests run (vLLM's ``int(watermark * num_blocks)``).

        :meth:`admit` applies it; a scheduler resuming a swapped request (a
        preempted one coming back) applies it too.
        """
        return self.gpu.watermark_blocks

    @exclusive
    def blocks_to_resume(self, request_id: Hashable, num_new_tokens: int = 0) -> int:
        """Free GPU blocks that ``resume`` and then ``allocate(num_new_tokens)`` of a swapped request would take now.

        Its blocks still cached on the GPU count only if no one holds them (a
        free cached block leaves the free queue when it is hit again); the rest
        are new blocks.  :meth:`resume` refuses when they do not fit, as vLLM
        resumes one only with room for the tokens it computes next, so a
        resumed request is not left holding its KV unable to take one step.
        """
        h = self._get(request_id, Residency.CPU)
        assert h.swapped is not None
        return self._blocks_to_resume(h, h.swapped, checks.count("num_new_tokens", num_new_tokens))

    def _blocks_to_resume(self, h: Held, swapped: SwappedKV, num_new_tokens: int) -> int:
        hits = self._swap.gpu_hits(h.request, swapped)
        total = -(-(swapped.num_tokens + num_new_tokens) // self.block_size)
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
        table (see :class:`~tiered_kv.manager.victim_policy.PreemptBounds`).  ``lookups``:
        look up a few of each request's latest blocks in the CPU tier (a
        tighter bound, for a little more).  Raises for a request that is not
        on the GPU.
        """
        checks.choice("mode", mode, MODES)
        checks.flag("lookups", lookups)
        if type(request_ids) is not list and type(request_ids) is not tuple:
            raise InvalidArgumentError(f"request_ids must be a list or tuple, got {checks.describe(request_ids)}")
        gpu = Residency.GPU
        try:
            found = list(map(self._held.get, request_ids))
        except TypeError:
            found = [None]  # an unhashable id: _get names it
        held = [h for h in found if h is not None and h.residency is gpu]
        if len(held) != len(found):
            held = [self._get(rid, gpu) for rid in request_ids]  # raises, naming the first not on the GPU
        return self._bounds.lower_bounds([h.request for h in held], mode, self._swap, lookups)

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
        c.cpu_blocks_evicted = self.store.stats.evictions
        return c

    @exclusive
    def metrics(self) -> MetricsSnapshot:
        """Counters (evictions as of the last ``poll``) and the gauges of this instant."""
        residencies = [h.residency for h in self._held.values()]
        t, low, pool = self.transfers, self._lower, self.gpu.block_pool
        lower = (low.counters, low.lost_blocks) if low is not None else ({}, 0)
        return snapshot(self.counters, len(t), pool, self.store, residencies, *lower)

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
        _check_ownership(self.gpu, self.store, self.transfers, swapped, low.cpu_pins() if low is not None else None)
        if low is not None:
            low.check_invariants()
        self._bounds.check()
        self._swap.check_tails(h.request for h in self._held.values() if h.residency is Residency.GPU)


def _check_ownership(
    gpu: KVCacheManager,
    store: CPUStore,
    transfers: Transfers,
    swapped: Mapping[Hashable, Sequence[Key] | None],
    other_pins: Mapping[Key, int] | None = None,
) -> None:
    """Assert that ref counts and pins are exactly their owners (O(blocks); for tests and debugging).

    Every reference on a GPU block is an entry of some request's block table
    or a hold of a copy in flight, and every pin in the CPU store is a swapped
    request's copy, a load in flight or a move of the tiers below the CPU:
    nothing else may own anything, so a block nobody owns is free and a block
    somebody owns is never handed out.

    Args:
        gpu: The GPU tables and pool.
        store: The CPU store (an empty one without a CPU tier).
        transfers: The copies in flight.
        swapped: Every request the manager holds, with the store keys of its
            swapped copy (``None`` while its KV is on the GPU).
    """
    pool = gpu.block_pool
    pool.check_invariants()
    owners = [0] * pool.num_blocks
    for rid, keys in swapped.items():
        table = gpu.get_blocks(rid)
        assert keys is None or not table or any(t.plan.request_id == rid for t in transfers), (
            f"{rid!r} is swapped out but holds a GPU table"
        )
        for b in table:
            owners[b.block_id] += 1
    for bid, n in transfers.gpu_hold_counts().items():
        owners[bid] += n
    for b in pool.blocks[1:]:
        assert b.ref_cnt == owners[b.block_id], f"GPU block {b.block_id}: {b.ref_cnt} refs, {owners[b.block_id]} owners"
    store.check_invariants()
    pins: dict[Key, int] = dict(other_pins or {})
    for keys in swapped.values():
        for k in keys or ():
            pins[k] = pins.get(k, 0) + 1
    for t in transfers:
        loading = getattr(t.payload, "keys", ()) if t.plan.kind is PlanKind.ONBOARD else ()
        for k in (*loading, *getattr(t.payload, "pinned", ())):
            pins[k] = pins.get(k, 0) + 1
    for e in store.entries():
        if e.ready:
            assert e.ref_cnt == pins.get(e.key, 0), f"store key {e.key!r}: {e.ref_cnt} pins, {pins.get(e.key)} owners"
