"""tiered_kv's preemption inside vLLM 0.33: ``--scheduler-cls tiered_kv.integrations.vllm.TieredKVScheduler``.

Everything is vLLM's scheduler but two decisions, made the way tiered_kv's own
scheduler makes them (:mod:`tiered_kv.sched.scheduler`), and no line of vLLM's
scheduler is copied:

**Who is preempted** (``preemption.victim_policy``).  vLLM picks its victim
inline in ``schedule()``: with FCFS the last of ``running``, with priority
scheduling the largest ``(priority, arrival_time)``, right after
``kv_cache_manager.allocate_slots`` fails for a running request (only the
running loop calls it for a running request).  So that call is wrapped: when
it fails, the policy ranks the requests vLLM's own rule puts above the one
that did not fit (with FCFS those after it in ``running``, as vLLM's FCFS
branch never preempts an earlier one; with priority scheduling those of a
larger ``(priority, arrival_time)``, which keeps vLLM's priority semantics: a
request never preempts one it outranks), and the policy's victim is made the
one vLLM's inline rule picks: moved to the end of ``running`` (FCFS), or given
the largest priority for that one comparison and its own priority back before
vLLM puts it in the waiting heap (priority).  Candidates whose blocks vLLM
may not free yet (``defer_block_free`` with async scheduling) are left out, as
vLLM stops preempting when its own victim cannot be freed; candidates that
would free no block are passed over (their blocks are all shared), and
under ``mode: swap`` so are those that cannot be swapped.  With no candidate
left, vLLM's own victim stands.  ``last_admitted`` is vLLM's own rule and
changes nothing.

**How** (``preemption.mode``).  Per victim, tiered_kv's :class:`~tiered_kv.manager.pricing.Quote`
(swap out and back in against recompute, and whether the CPU tier has room)
chooses, exactly as tiered_kv's scheduler does: ``Quote.choose(mode)``; a
forced swap that is impossible falls back to ``auto``; a victim with no full
chunk computed is recomputed.  A swap stores the victim's computed KV that
the CPU tier lacks through tiered_kv's connector (:mod:`.connector`) before
any of its GPU blocks can be written by another request; vLLM then frees its
blocks and zeroes its progress as always, and its resume is vLLM's prefix
lookup and load.

Every preemption is recorded in :attr:`TieredKVScheduler.decisions` (the
policy's victim, vLLM's own, the one preempted, the mode and why), and a
victim preempted that is not the one the policy chose is counted in
:attr:`TieredKVScheduler.victim_mismatches` and logged: a change in vLLM's
internals shows up there, not as a silent fallback.  The counters
(:class:`~.preemption_stats.PreemptionCounters`) include the recompute tax.

With async scheduling (``--async-scheduling``, vLLM's default where supported)
vLLM picks ``AsyncScheduler``; a custom class replaces that pick, so this
class builds :class:`TieredKVAsyncScheduler` (the same, over ``AsyncScheduler``)
when the config asks for async scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.connector import TieredKVConnector, TieredKVConnectorScheduler, swap_supported
from tiered_kv.integrations.vllm.extra_config import PreemptionConfig, preemption_config
from tiered_kv.integrations.vllm.preemption_stats import PreemptionCounters
from tiered_kv.manager.bounded_log import BoundedLog
from tiered_kv.manager.pricing import Quote, price
from tiered_kv.manager.states import PreemptMode
from tiered_kv.manager.victim_policy import Candidate, LastAdmittedPolicy

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class VictimDecision:
    """One preemption: whom the policy chose, whom vLLM preempted, and how.

    Attributes:
        step: vLLM's scheduling step (``Scheduler.current_step``).
        needed_by: The running request that did not fit (``None``: a prefix cache reset).
        victim: The request vLLM preempted.
        chosen: The policy's victim (``None``: no choice was made, e.g. a cache reset).
        vllm_choice: The request vLLM's own rule would have preempted.
        mode: Swap or recompute.
        reason: Why that mode, in words (the quote's reason, or why a swap fell back).
        quote: The victim's quote (``None`` for a cache reset).
        num_tokens: Tokens it had computed (its KV at stake).
        stored_blocks: GPU blocks its store at preemption copies (0: none, or recompute).
    """

    step: int
    needed_by: str | None
    victim: str
    chosen: str | None
    vllm_choice: str | None
    mode: PreemptMode
    reason: str
    quote: Quote | None
    num_tokens: int
    stored_blocks: int


@dataclass(frozen=True, slots=True)
class _Pick:
    needed_by: str
    chosen: str
    vllm_choice: str


class TieredKVScheduler(Scheduler):
    """vLLM 0.33's ``Scheduler`` with tiered_kv's victim policies and swap-or-recompute per victim.

    Built by vLLM from ``--scheduler-cls tiered_kv.integrations.vllm.TieredKVScheduler``;
    configured by the ``preemption`` object of ``kv_connector_extra_config``
    (:func:`~.config.preemption_config`; without it, nothing differs from vLLM).

    Attributes:
        preemption: The parsed configuration.
        counters: Preemptions by mode, blocks stored and loaded, computed and
            recomputed tokens (shared with tiered_kv's connector, which exports them).
        decisions: The latest preemptions (:class:`VictimDecision`), newest last.
        victim_mismatches: Preemptions of another request than the policy's victim.

    Raises:
        ConfigError: a bad ``preemption`` object; a swap mode without tiered_kv's
            connector, without ``kv_load_failure_policy: recompute``, or for a model
            whose KV layout swaps do not support.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TieredKVScheduler:
        if cls is TieredKVScheduler:
            vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
            if vllm_config.scheduler_config.async_scheduling:
                cls = TieredKVAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kv = self.vllm_config.kv_transfer_config
        extra = kv.kv_connector_extra_config if kv is not None else {}
        self.preemption: PreemptionConfig = preemption_config(
            extra.get("preemption"), kv_bytes_per_token(self.kv_cache_config), self.block_size
        )
        store = self.connector.preemption if isinstance(self.connector, TieredKVConnector) else None
        if self.preemption.swaps:
            if store is None:
                raise ConfigError(
                    f"preemption.mode {self.preemption.mode!r} swaps victims through tiered_kv's connector: set "
                    '"kv_connector": "TieredKVConnector", "kv_connector_module_path": "tiered_kv.integrations.vllm" '
                    f"(the connector is {kv.kv_connector if kv is not None else None!r}), or mode 'recompute'"
                )
            why = swap_supported(self.kv_cache_config)
            if why is not None:
                raise ConfigError(f"preemption.mode {self.preemption.mode!r} cannot swap: {why}; use 'recompute'")
            assert kv is not None
            if kv.kv_load_failure_policy != "recompute":
                raise ConfigError(
                    f'preemption.mode {self.preemption.mode!r} needs "kv_load_failure_policy": "recompute" in '
                    f"--kv-transfer-config (it is {kv.kv_load_failure_policy!r}, vLLM's default): a swapped victim "
                    "whose load fails must recompute, not fail"
                )
        self._store: TieredKVConnectorScheduler | None = store
        self.counters: PreemptionCounters = store.counters if store is not None else PreemptionCounters()
        self.decisions: BoundedLog[VictimDecision] = BoundedLog()
        self.victim_mismatches = 0
        self._pick: _Pick | None = None
        self._lent_priority: tuple[Request, int] | None = None
        self._high_water: dict[str, int] = {}
        self._resetting = False
        self._allocate_slots = self.kv_cache_manager.allocate_slots
        self.kv_cache_manager.allocate_slots = self._allocate_or_pick_victim  # type: ignore[method-assign]

    # ------------------------------------------------------------ who
    def _allocate_or_pick_victim(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        blocks = self._allocate_slots(request, num_new_tokens, *args, **kwargs)
        if blocks is None and request.status == RequestStatus.RUNNING and not self._resetting:
            self._pick_victim(request)
        return blocks

    def _pick_victim(self, request: Request) -> None:
        """vLLM is about to pick a victim for ``request``: make it pick the policy's."""
        self._pick = None
        if self.connector is not None and self.connector.has_pending_block_frees():
            return  # vLLM waits for those frees instead of preempting
        running = self.running
        if self.policy == SchedulingPolicy.PRIORITY:
            order = sorted(range(len(running)), key=lambda i: (running[i].priority, running[i].arrival_time, -i))
            rank = {running[i].request_id: r for r, i in enumerate(order)}
            default = running[order[-1]]  # max() keeps the first of equal keys: the smallest index
        else:
            rank = {r.request_id: i for i, r in enumerate(running)}
            default = running[-1]
        victim = default
        policy = self.preemption.victim_policy
        if type(policy) is not LastAdmittedPolicy:
            victim = self._policy_victim(request, rank) or default
        if victim is not default:
            if self.policy == SchedulingPolicy.PRIORITY:
                self._lent_priority = (victim, victim.priority)
                victim.priority = max(r.priority for r in running) + 1
            else:
                index = next(i for i, r in enumerate(running) if r is victim)
                running.append(running.pop(index))
        self._pick = _Pick(request.request_id, victim.request_id, default.request_id)

    def _policy_victim(self, request: Request, rank: dict[str, int]) -> Request | None:
        """The policy's first candidate that frees a block (and, under ``swap``, can be swapped)."""
        mine = rank[request.request_id]
        by_id = {
            r.request_id: r for r in self.running if rank[r.request_id] > mine and self._request_blocks_can_be_freed(r)
        }
        if not by_id:
            return None
        blocks = self.kv_cache_manager.get_blocks
        candidates = [
            Candidate(
                rid,
                rank[rid],
                sum(len(g) for g in blocks(rid).blocks),
                r.num_computed_tokens,
                r.num_prompt_tokens,
                lambda rid: self.quote(self.requests[rid]),
            )
            for rid, r in by_id.items()
        ]
        mode = self.preemption.mode
        for c in self.preemption.victim_policy.iter_rank(candidates, mode):
            q = c.quote
            if q.blocks_freed == 0 or (mode == "swap" and not q.can_swap):
                continue
            return by_id[c.request_id]
        return None

    # ------------------------------------------------------------ how
    def quote(self, request: Request) -> Quote:
        """What preempting a running request would cost, by swap and by recompute (tiered_kv's quote)."""
        blocks: KVCacheBlocks = self.kv_cache_manager.get_blocks(request.request_id)
        cost_model = self.preemption.cost_model
        if self._store is not None:
            return self._store.quote(request, blocks, cost_model)
        table = [b for group in blocks.blocks for b in group]
        freed = [b.block_id for b in table if b.ref_cnt == 1 and not b.is_null]
        n = request.num_computed_tokens
        return price(cost_model, request.request_id, n, len(table), freed, [], 0, False, False)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        if self._lent_priority is not None and self._lent_priority[0] is request:
            request.priority = self._lent_priority[1]  # before vLLM pushes it into the waiting heap
            self._lent_priority = None
        rid, computed = request.request_id, request.num_computed_tokens
        pick, self._pick = self._pick, None
        if self._resetting:
            mode, reason, quote, stored = PreemptMode.RECOMPUTE, "the prefix cache is reset; its KV goes", None, 0
        else:
            if pick is None or pick.chosen != rid:
                self.victim_mismatches += 1
                logger.warning(
                    "tiered_kv: vLLM preempted %s, not the victim policy's choice %s; vLLM's scheduler "
                    "may have changed (this plug-in is tested with vLLM 0.33.0)",
                    rid,
                    pick.chosen if pick is not None else None,
                )
            mode, reason, quote, stored = self._swap_or_recompute(request, computed)
        super()._preempt_request(request, timestamp, drop_stale_output)
        if mode is PreemptMode.SWAP:
            self.counters.preemptions_swap += 1
        else:
            self.counters.preemptions_recompute += 1
        if computed:
            self._high_water[rid] = max(self._high_water.get(rid, 0), computed)
        self.decisions.append(
            VictimDecision(
                self.current_step,
                pick.needed_by if pick is not None and not self._resetting else None,
                rid,
                pick.chosen if pick is not None and not self._resetting else None,
                pick.vllm_choice if pick is not None and not self._resetting else None,
                mode,
                reason,
                quote,
                computed,
                stored,
            )
        )

    def _swap_or_recompute(self, request: Request, computed: int) -> tuple[PreemptMode, str, Quote, int]:
        """Decide the victim's mode by its quote, as tiered_kv's scheduler does; start its store if it swaps."""
        quote = self.quote(request)
        mode, reason = quote.choose(self.preemption.mode)
        if mode is None:  # a forced swap that is impossible: vLLM must preempt, so it recomputes, saying why
            mode, reason = quote.choose("auto")
            assert mode is not None
        if mode is not PreemptMode.SWAP:
            return mode, reason, quote, 0
        assert self._store is not None
        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)
        out = self._store.store_at_preemption(request, computed, block_ids)
        if out is None:
            return PreemptMode.RECOMPUTE, f"recompute: the CPU tier could not reserve room; {reason}", quote, 0
        if out.num_chunks == 0:
            why = f"recompute: no full chunk of KV is computed (a partial one is recomputed anyway); {reason}"
            return PreemptMode.RECOMPUTE, why, quote, 0
        return mode, reason, quote, out.num_blocks

    # ------------------------------------------------------------ vLLM's steps, observed
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            # A pick vLLM did not act on (it stopped preempting) must not leave a lent priority behind.
            if self._lent_priority is not None:
                victim, priority = self._lent_priority
                victim.priority = priority
                self._lent_priority = None
            self._pick = None
        self._count_computed(out)
        return out

    def _count_computed(self, out: SchedulerOutput) -> None:
        """Add the step's tokens; those below a request's mark before its last preemption are recomputed."""
        counters, marks = self.counters, self._high_water
        counters.tokens_computed += out.total_num_scheduled_tokens
        if not marks:
            return
        for rid, n in out.num_scheduled_tokens.items():
            mark = marks.get(rid)
            if mark is None:
                continue
            start = self.requests[rid].num_computed_tokens - n  # vLLM advanced it already
            if mark > start:
                counters.tokens_recomputed += min(start + n, mark) - start
            if start + n >= mark:
                del marks[rid]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self._resetting = True
        try:
            return super().reset_prefix_cache(*args, **kwargs)
        finally:
            self._resetting = False

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self._high_water.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


class TieredKVAsyncScheduler(TieredKVScheduler, AsyncScheduler):
    """:class:`TieredKVScheduler` over vLLM's ``AsyncScheduler`` (built for ``async_scheduling``)."""


def kv_bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes of one token on one GPU, over every layer of every KV cache group.

    Per GPU, because with tensor parallelism each rank copies its own shard over
    its own host link, concurrently: one link's bytes set the copy time.
    """
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += spec.page_size_bytes * len(group.layer_names) // max(1, spec.block_size)
    return max(1, total)
