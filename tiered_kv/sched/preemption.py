"""Preemption inside a scheduling step: make room for a request, by the policy's victims or by itself.

When a running request's tokens do not fit, blocks that copies in flight will
free are counted first (waiting beats preempting); then the policy picks
victims among running requests not yet scheduled this step, and each is
preempted through the manager by the mode its quote chooses.  If no choice
frees enough, the request preempts itself, as in vLLM.

A request computes between two preemptions, as in vLLM (where a resumed
request is scheduled in the step it resumes): one that has become runnable
(admitted, resumed, or its KV landed) and has not computed a step since is
never a victim, and does not preempt itself; it waits.  Otherwise a victim
that costs nothing to swap (its blocks all stored already) can be swapped out,
resumed from the GPU cache and swapped out again forever, never computing.
Only when nothing at all can run or land does such a request yield
(:meth:`Preempting._yield_if_stuck`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from tiered_kv.core.request import Request
from tiered_kv.manager.outcomes import Preemption
from tiered_kv.manager.states import PreemptMode, Residency
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.manager.victim_policy import Candidate, VictimPolicy, select_victims
from tiered_kv.sched.config import SchedulerConfig
from tiered_kv.sched.output import SchedulerOutput
from tiered_kv.sched.status import RequestStatus
from tiered_kv.transfer.plan import TransferHandle

S = RequestStatus


class Preempting:
    """The scheduler's preemption steps (a part of :class:`~tiered_kv.sched.scheduler.Scheduler`)."""

    tm: TierManager
    config: SchedulerConfig
    victim_policy: VictimPolicy
    running: list[Request]
    waiting: deque[Request]
    swapped: deque[Request]
    requests: dict[Hashable, Request]
    status: dict[Hashable, RequestStatus]
    _high_water: dict[Hashable, int]
    _loads: dict[Hashable, TransferHandle]
    _quiet: dict[Hashable, int]
    _fresh: set[Hashable]  # runnable again and no step computed since: not preemptible (membership only)

    def _make_room(
        self,
        req: Request,
        n: int,
        scheduled: set[Hashable],
        promised: int,
        out: SchedulerOutput,
        stalled: list[Request] | None = None,
    ) -> tuple[bool, int]:
        """Allocate ``n`` tokens for ``req``, preempting others if needed; (fits, promised blocks left).

        A fresh request (no step computed since it became runnable) that
        finds no victim waits instead of preempting itself; it is appended to
        ``stalled``.
        """
        tm, rid = self.tm, req.request_id
        for i in range(len(self.running) + 1):  # each round preempts at least one victim, or ends
            if i and tm.allocate(rid, n) is not None:  # the caller tried once already
                return True, promised
            short = tm.blocks_short(rid, n)
            if short <= promised:
                return False, promised - short  # copies in flight will free enough: wait for them
            victims = select_victims(
                self.victim_policy,
                self._candidates(scheduled | {rid}),
                short - promised,
                self.config.mode,
                tm.cpu_room(),
            )
            if victims is None:
                if rid in self._loads:  # its KV is still landing: it cannot be preempted now; it waits
                    return False, promised
                if rid in self._fresh:  # preempting it now would undo its resume before it made progress
                    if stalled is not None:
                        stalled.append(req)
                    return False, promised
                self._preempt(req, out)  # nobody else can make room: vLLM preempts the request itself
                return False, promised
            for v in victims:
                promised += self._preempt(self.requests[v.request_id], out).blocks_freed_on_completion
        raise AssertionError(f"request {rid!r}: preemption did not make room")  # pragma: no cover

    def _candidates(self, exclude: set[Hashable]) -> list[Candidate]:
        """Running requests that may be preempted, ranked by vLLM's rule (higher rank goes first)."""
        status, loads = self.status, self._loads
        if self.config.policy == "fcfs":
            order = list(self.running)
        else:
            order = sorted(self.running, key=lambda r: (r.priority, r.arrival_time))
        tm = self.tm
        running, num_blocks, quote, bounds = S.RUNNING, tm.gpu_table_length, tm.quote, tm.preemption_bounds
        return [
            Candidate(rid, rank, num_blocks(rid), r.num_computed_tokens, r.num_prompt_tokens, quote, bounds)
            for rank, r in enumerate(order)
            if (rid := r.request_id) not in exclude
            and status[rid] is running
            and rid not in loads
            and rid not in self._fresh
        ]

    def _yield_if_stuck(self, stalled: list[Request], out: SchedulerOutput) -> None:
        """Fresh requests waited for room, yet the step runs nothing and no copy will land: the last one yields.

        Nothing else can free a block then, so waiting would make empty steps
        forever; preempting it is vLLM's answer to a request that cannot fit.
        """
        if stalled and not out.scheduled and not self.tm.plans_in_flight():
            req = stalled[-1]
            self._fresh.discard(req.request_id)
            self._preempt(req, out)

    def _preempt(self, req: Request, out: SchedulerOutput) -> Preemption:
        rid = req.request_id
        p = self.tm.preempt(rid, self.config.mode) or self.tm.preempt(rid, "auto")  # forced swap impossible
        assert p is not None
        self._quiet.pop(rid, None)  # its blocks are released or leaving
        self.running.remove(req)
        req.num_preemptions += 1
        out.preempted.append((rid, p.mode))
        if p.mode is PreemptMode.SWAP:
            self.status[rid] = S.SWAPPED if p.residency is Residency.CPU else S.SWAPPING_OUT
            self.swapped.append(req)
        else:
            self._high_water[rid] = max(self._high_water.get(rid, 0), req.num_computed_tokens)
            req.num_computed_tokens = 0
            self.status[rid] = S.WAITING
            self.waiting.appendleft(req)
        return p
