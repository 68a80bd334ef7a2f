"""A continuous-batching scheduler modelled on vLLM v1, over the TierManager.

It lives beside the simulator because the real engine reuses it unchanged:
the simulator and the engine differ only in who computes a step and how long
it takes.

Each step, under a token budget and a cap on running requests:

1. Running requests, in admission order: the rest of a (chunked) prefill, or
   one decode token.  When ``allocate`` does not fit, the scheduler preempts
   through the tier manager with the configured policy and mode.  Swap-out
   victims free their blocks only when their copies finish, so blocks already
   promised by swap-outs in flight are counted before preempting anyone else.
2. Swapped requests resume before any new admission, oldest first (vLLM v0).
3. New and recompute-preempted requests are admitted first come, first
   served; recompute victims go back to the front of the queue (vLLM v1).

A step that had to preempt neither resumes nor admits: memory is short, and a
victim whose blocks are still cached would otherwise come straight back.

A request whose KV is still arriving (swap-in, onboarding, or an on-evict copy
it must wait for) is skipped until the manager says it is runnable.  Drivers
call :meth:`Scheduler.poll` (not the manager's) so that a request whose copy
failed is put back where the manager left it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from tiered_kv.core.request import Request
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.states import PreemptMode, RequestState
from tiered_kv.manager.tier_manager import Completion, PreemptionResult, TierManager
from tiered_kv.transfer.plan import PlanKind

_MOVES = frozenset({PlanKind.SWAP_OUT, PlanKind.SWAP_IN, PlanKind.ONBOARD})


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise InvalidArgumentError("max_num_batched_tokens and max_num_seqs must be > 0")


@dataclass(slots=True)
class StepBatch:
    """What one step computes: ``(request, num_new_tokens)`` pairs, plus bookkeeping for reports."""

    items: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0
    recomputed_tokens: int = 0  # tokens computed before, now computed again after a recompute preemption
    preempted: list[tuple[Hashable, PreemptMode]] = field(default_factory=list)
    resumed: list[Hashable] = field(default_factory=list)
    admitted: list[Hashable] = field(default_factory=list)


class Scheduler:
    """Continuous batching over a :class:`TierManager`.

    Args:
        tm: The tier manager (owns all KV bookkeeping).
        config: Budget and limits.
        policy / mode: Passed to ``TierManager.preempt``.
        on_finish: Called with each finished request.
    """

    def __init__(
        self,
        tm: TierManager,
        config: SchedulerConfig,
        policy: str | None = None,
        mode: str | None = None,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        self.tm = tm
        self.config = config
        self.policy = policy
        self.mode = mode or tm.mode
        self.on_finish = on_finish
        self.waiting: deque[Request] = deque()
        self.running: list[Hashable] = []
        self.swapped: deque[Hashable] = deque()
        self.requests: dict[Hashable, Request] = {}
        self.high_water: dict[Hashable, int] = {}  # most tokens ever computed per request

    # ---------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidArgumentError(f"request {request.request_id!r} was already added")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def poll(self) -> list[Completion]:
        """Settle finished copies through the manager, and re-file requests whose copy failed.

        A failed swap-out leaves the request running on the GPU; a failed swap-in
        leaves it swapped; a failed onboarding leaves it waiting to recompute.
        """
        done = self.tm.poll()
        for c in done:
            # Only a failed swap-out, swap-in or onboarding moves a request; a failed cache
            # offload leaves it where it is (the copy was of cached data, not its state).
            if c.ok or c.kind not in _MOVES or c.request_id not in self.requests:
                continue
            rid = c.request_id
            state = self.tm.state(rid)
            if rid in self.swapped:
                self.swapped.remove(rid)
            if rid in self.running:
                self.running.remove(rid)
            if state in (RequestState.RUNNING, RequestState.SWAPPING_IN):
                self.running.append(rid)
            elif state in (RequestState.SWAPPED, RequestState.SWAPPING_OUT):
                self.swapped.appendleft(rid)
            else:
                self.waiting.appendleft(self.requests[rid])
        return done

    # --------------------------------------------------------------- schedule
    def schedule(self) -> StepBatch:
        tm = self.tm
        batch = StepBatch()
        budget = self.config.max_num_batched_tokens
        # Blocks that copies in flight will free (swap-outs, saves before eviction): waiting
        # for them is cheaper than preempting anyone else.
        promised = tm.blocks_freed_on_completion()
        scheduled: set[Hashable] = set()

        # 1. Running requests.
        for rid in list(self.running):
            if budget <= 0:
                break
            if rid not in self.requests or not tm.is_runnable(rid):
                continue
            if tm.state(rid) is not RequestState.RUNNING:
                continue
            req = self.requests[rid]
            n = req.num_tokens - req.num_computed_tokens
            if n <= 0:
                continue
            if n > budget:
                if not self.config.chunked_prefill:
                    continue
                n = budget
            for _ in range(64):  # each round preempts at least one victim, or ends
                if tm.allocate(rid, n) is not None:
                    batch.items.append((req, n))
                    batch.num_tokens += n
                    budget -= n
                    scheduled.add(rid)
                    break
                need = tm.gpu.num_blocks_to_allocate(req, n) - tm.gpu_pool.get_num_free_blocks()
                if need <= promised:
                    promised -= need  # a swap-out in flight will free these: wait for it
                    break
                res = tm.preempt(need - promised, self.policy, self.mode, exclude=scheduled | {rid})
                if res is None:
                    self._preempt_self(rid, batch)
                    break
                self._take_victims(res, batch)
                promised += res.blocks_freed_on_completion
            else:  # pragma: no cover - would mean preemption frees less than it reports
                raise AssertionError(f"request {rid!r}: preemption did not make room")

        # 2. Resume swapped requests before admitting new ones; not in a step that had to
        #    preempt (memory is short, and the victim would come straight back: vLLM v0's rule).
        while not batch.preempted and self.swapped and len(self.running) < self.config.max_num_seqs:
            rid = self.swapped[0]
            if tm.state(rid) is not RequestState.SWAPPED:
                break  # oldest first: wait for its swap-out to finish
            res = tm.resume(rid)
            if res is None:
                break
            self.swapped.popleft()
            if res.state is RequestState.PREEMPTED:
                self.waiting.appendleft(self.requests[rid])
            else:
                self.running.append(rid)
                batch.resumed.append(rid)

        # 3. Admit waiting requests, first come first served, unless requests are swapped out
        #    or this step preempted (vLLM v0 and v1 alike admit nothing then).
        if not self.swapped and not batch.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                want = req.num_tokens
                if want > budget and not self.config.chunked_prefill:
                    break
                res = tm.admit(req, min(want, budget))
                if res is None:
                    break
                self.waiting.popleft()
                self.running.append(req.request_id)
                batch.admitted.append(req.request_id)
                if res.runnable and res.num_new_tokens:
                    batch.items.append((req, res.num_new_tokens))
                    batch.num_tokens += res.num_new_tokens
                    budget -= res.num_new_tokens
        return batch

    def _take_victims(self, res: PreemptionResult, batch: StepBatch) -> None:
        for v in res.victims:
            self.running.remove(v.request_id)
            batch.preempted.append((v.request_id, v.mode))
            if v.mode is PreemptMode.SWAP:
                self.swapped.append(v.request_id)
            else:
                self.waiting.appendleft(self.requests[v.request_id])

    def _preempt_self(self, rid: Hashable, batch: StepBatch) -> None:
        """Nobody else can make room: preempt the request itself (vLLM v1 preempts the lowest priority)."""
        mode = "recompute"
        if self.mode != "recompute" and self.tm.cpu_pool is not None:
            q = self.tm.quote(rid)
            if q.cpu_has_room and (self.mode == "swap" or q.swap_out_s + q.swap_in_s < q.recompute_s):
                mode = "swap"
        d = self.tm.preempt_request(rid, mode)
        self.running.remove(rid)
        batch.preempted.append((rid, d.mode))
        if d.mode is PreemptMode.SWAP:
            self.swapped.append(rid)
        else:
            self.waiting.appendleft(self.requests[rid])

    # ----------------------------------------------------------------- update
    def count_recomputed(self, batch: StepBatch) -> int:
        """Tokens of the batch that were computed before (redone after a recompute preemption)."""
        hw = self.high_water
        n_re = 0
        for req, n in batch.items:
            mark = hw.get(req.request_id, 0)
            c = req.num_computed_tokens
            if mark > c:
                n_re += min(c + n, mark) - c
        batch.recomputed_tokens = n_re
        return n_re

    def update(self, batch: StepBatch, sample: Callable[[Request], int]) -> list[Request]:
        """Apply a computed step: advance progress, sample a token where the known tokens are done.

        Returns the requests that produced a token this step (for latency accounting).
        """
        produced: list[Request] = []
        tm = self.tm
        hw = self.high_water
        for req, n in batch.items:
            in_prompt = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += n
            if req.num_computed_tokens > hw.get(req.request_id, 0):
                hw[req.request_id] = req.num_computed_tokens
            if in_prompt:
                tm.on_tokens_computed(req.request_id)
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(sample(req))
                produced.append(req)
                if req.num_output_tokens >= req.max_tokens:
                    tm.finish(req.request_id)
                    self.running.remove(req.request_id)
                    del self.requests[req.request_id]
                    hw.pop(req.request_id, None)
                    if self.on_finish is not None:
                        self.on_finish(req)
        return produced
