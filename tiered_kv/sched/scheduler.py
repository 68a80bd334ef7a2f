"""A continuous-batching scheduler in the manner of vLLM v1, over the TierManager.

It alone owns the queues, each request's status (which queue it is in), its
progress (``num_computed_tokens``), the token budget and the preemption loop.
It asks the manager for outcomes (an admission, a preemption, a completed
copy) through the verbs of :class:`~tiered_kv.manager.port.SchedulerPort`
and applies them; where a request's KV is, it reads from those outcomes or
from ``TierManager.state`` and never keeps.  The simulator and the real
engine both drive it.

Each step (:meth:`Scheduler.schedule`), under a token budget and a cap on
admitted requests:

1. Completed copies are applied by the residency they report: a request
   whose KV landed on the GPU (a swap-in, an onboarding) runs with the
   progress the completion reports; a failed copy puts the request back in
   the queue for where its KV is (a failed swap-out: running again).
2. Running requests, in queue order: the rest of a (chunked) prefill, or one
   decode token.  When a request does not fit, blocks that copies in flight
   will free are counted first (waiting beats preempting); then, as in vLLM's
   loop, one victim at a time is preempted through the manager (by the mode
   its quote chooses) until the request fits or the victim is the request
   itself.  The victim is the policy's first among the candidates vLLM's
   rule gives: with FCFS the requester and the running requests not yet
   scheduled this step; with priority every running request, the requester
   and those already scheduled this step included (a scheduled victim is
   taken out of the batch and its tokens go back to the budget).  A step the
   manager would serve without changing anything (a decode token landing in
   a block the request holds, filling none: ``TierManager.quiet_tokens``)
   skips the manager call (``grow`` answers how far that holds); that is most
   decode steps.
3. Swapped requests resume, oldest first, unless this step preempted.  One
   whose KV is whole on the GPU at once (every block still cached there) is
   scheduled in the same step, as vLLM schedules a resumed request; with
   ``layerwise`` so is one whose KV is still landing, computing while it
   lands layer by layer (``SchedulerOutput.loads``).
4. Waiting requests are admitted (FCFS, or by priority), unless requests are
   swapped out or this step preempted, under vLLM 0.33's gates: without
   chunked prefill the tokens left after the prefix hits must fit the budget;
   with ``scheduler_reserve_full_isl`` the whole sequence must fit the pool;
   while requests run, the manager's watermark stays free.  With chunked
   prefill and that whole-sequence gate, the request the manager refused is
   not asked about again until something happens that could let it in (a
   block returned to the pool, a copy settled, one of its prefix blocks
   cached): until then the answer would be the same refusal
   (:meth:`Scheduler._admit` argues why).

:meth:`Scheduler.update` then applies the computed step: it advances progress
and appends the sampled token of every request that reached the end of its
known tokens (the decode rule: the last sampled token is not computed yet; the
next step computes it).

A request computes between two preemptions, as in vLLM (where a resumed
request is scheduled in the step it resumes): one that has become runnable
(admitted, resumed, or its KV landed) and has not computed a step since is
never a victim, and does not preempt itself; it waits.  Otherwise a victim
that costs nothing to swap (its blocks all stored already) can be swapped out,
resumed from the GPU cache and swapped out again forever, never computing.
Only when nothing at all can run or land does such a request yield
(:meth:`Scheduler._yield_if_stuck`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping

from tiered_kv import checks
from tiered_kv.core.request import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, UnknownRequestError
from tiered_kv.manager.outcomes import Completion, Preemption
from tiered_kv.manager.port import SchedulerPort
from tiered_kv.manager.states import PreemptMode, Residency
from tiered_kv.manager.tier_manager import EMPTY_PROMPT, TierManager
from tiered_kv.manager.victim_policy import get_victim_policy
from tiered_kv.sched.config import SchedulerConfig
from tiered_kv.sched.output import SchedulerOutput
from tiered_kv.sched.status import RequestStatus
from tiered_kv.transfer.plan import PlanKind, TransferHandle

S = RequestStatus


class Scheduler:
    """Continuous batching with preemption by swap or recompute.

    It talks to the manager through the verbs of
    :class:`~tiered_kv.manager.port.SchedulerPort` only (their contracts are
    listed there); drivers read the manager's own facts (``tm.metrics()``,
    ``tm.gpu_block_ids``) from the manager itself.

    Args:
        tm: The tier manager (owns where KV lives).
        config: Budget, limits, scheduling order, victim policy, preemption mode.
    """

    def __init__(self, tm: TierManager, config: SchedulerConfig | None = None) -> None:
        self.tm = tm  # for drivers: the manager's own facts (metrics, block tables, logs)
        self._kv: SchedulerPort = tm  # the scheduler's only way to the manager: the port's verbs
        self.config = config or SchedulerConfig()
        get_victim_policy(self.config.victim_policy)  # a policy named by a module path is imported now: fail early
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[Hashable, Request] = {}
        self.status: dict[Hashable, RequestStatus] = {}
        # The queue of each status (an ARRIVING request is in none: _arriving holds it).
        self._queues: dict[RequestStatus, deque[Request] | list[Request]] = {
            S.WAITING: self.waiting,
            S.RUNNING: self.running,
            S.SWAPPED: self.swapped,
        }
        self._high_water: dict[Hashable, int] = {}  # recompute victims: tokens they had computed
        self._passed: dict[Hashable, int] = {}  # marks passed by a step of the batch being built (this step only)
        self._aborting: set[Hashable] = set()
        self._loads: dict[Hashable, TransferHandle] = {}  # layer-wise swap-ins not settled yet
        self._arriving: set[Hashable] = set()  # status ARRIVING (their KV landing): they hold a seat
        # A cache of the manager's answer to grow (TierManager.quiet_tokens) per running request: while its
        # next step stays within it, allocating would change nothing and is skipped.  Dropped whenever the
        # request leaves the running queue or a copy of its KV settles (then the answer may differ); absent
        # means "ask".
        self._quiet: dict[Hashable, int] = {}
        # Requests that became runnable (admitted, resumed, their KV landed) and have not computed a step
        # since: no victim until they have (see the module docstring).  Membership only, never iterated.
        self._fresh: set[Hashable] = set()
        # The waiting request the manager refused last, kept while nothing has happened since that could let it
        # in: the next step then refuses it without asking (see _admit, which argues why that is exact).  Dropped
        # (None) by anything that returns GPU blocks to the pool, settles a copy, or may cache one of its prefix
        # blocks; _refused_keys is its block hashes (what its prefix hits are looked up by), _refused_running
        # the has_scheduled_reqs it was refused with.
        self._refused: Request | None = None
        self._refused_keys: frozenset[Hashable] = frozenset()
        self._refused_running = False
        # Running requests whose blocks the manager may cache later than their progress says: their KV arrived
        # by a copy (an onboarding, a swap-in, layer by layer or not) or came back by a resume or a failed
        # swap-out, and their first allocation since may cache any of their full blocks, not only the blocks
        # that step fills.  Membership only; dropped at that allocation.
        self._lagging: set[Hashable] = set()
        # The output of the latest schedule() until update() applies it: a step is applied once, and only
        # the latest (an older one's progress no longer matches the requests').
        self._unapplied: SchedulerOutput | None = None
        self.tokens_recomputed = 0  # tokens computed again after recompute preemptions dropped their KV
        self.copy_seconds = 0.0  # engine-reported time of every copy that landed
        self.copies_landed = 0
        # Called with every copy the scheduler applies, after it is applied (metrics exporters observe here).
        self.completion_observers: list[Callable[[Completion], None]] = []

    # --------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        """Queue a new request (no computed tokens).

        Without chunked prefill a request must fit one step's token budget
        whenever it is prefilled, and a recompute preemption prefills its
        prompt and every token it has generated again: a request whose prompt
        plus ``max_tokens - 1`` exceeds ``max_num_batched_tokens`` could never
        be admitted again, so it is refused here (vLLM requires
        ``max_num_batched_tokens >= max_model_len`` then, for the same reason).
        """
        checks.instance("request", request, Request)
        rid = request.request_id
        if rid in self.requests:
            raise InvalidArgumentError(f"request {rid!r} was already added")
        if request.num_computed_tokens != 0 or request.is_finished:
            raise InvalidArgumentError(f"request {rid!r} must be new: no computed tokens, not finished")
        if request.num_prompt_tokens == 0:
            raise InvalidArgumentError(f"request {rid!r}: {EMPTY_PROMPT}")
        cfg = self.config
        longest = request.num_prompt_tokens + max(request.max_tokens - 1, 0)
        if not cfg.chunked_prefill and longest > cfg.max_num_batched_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: with chunked_prefill=False a prefill must fit one step, and this request may "
                f"need {longest} tokens at once ({request.num_prompt_tokens} prompt + up to "
                f"{max(request.max_tokens - 1, 0)} generated, prefilled again after a recompute preemption) but "
                f"max_num_batched_tokens is {cfg.max_num_batched_tokens}; enable chunked_prefill or raise the budget"
            )
        self.requests[rid] = request
        self.status[rid] = S.WAITING
        self.waiting.append(request)

    def abort(self, request_id: Hashable) -> None:
        """Drop a request wherever it is; a request whose KV is moving is dropped when its copy settles."""
        req = self._request(request_id)
        self._refused = None  # whatever it held is released, now or when its copy settles
        if self._kv.state(request_id).in_flight and not self._kv.free(request_id, cancel=True):
            self._aborting.add(request_id)  # the engine finished its copy first: it ends once that settles
            return
        self._apply(self._kv.poll())
        if request_id in self.requests:
            self._finish(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def _request(self, request_id: Hashable) -> Request:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request {request_id!r} is not scheduled here") from None

    # ---------------------------------------------------- what drivers read
    def copies_in_flight(self) -> bool:
        return self._kv.room().copies_in_flight > 0

    def wait_for_copies(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for some copy to land, and apply what landed; False if nothing is in flight.

        For a driver with nothing runnable (real engines): the next ``schedule`` runs what landed.
        """
        if not self._kv.room().copies_in_flight:
            return False
        self._apply(self._kv.poll(timeout))
        return True

    def settle(self) -> None:
        """Apply the copies that landed, without scheduling (``schedule`` does this first anyway)."""
        self._apply(self._kv.poll())

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every copy in flight and apply it (at the end of a run).

        Saves before eviction top themselves up at every poll, but only until
        the eviction window is stored or the CPU has no room, so this ends.
        """
        self._apply(self._kv.poll())
        for _ in range(1_000_000):
            if not self._kv.room().copies_in_flight:
                return
            self._apply(self._kv.poll(timeout))  # waits up to timeout for a copy, then settles what is final
        raise AssertionError("copies kept coming while draining")  # pragma: no cover

    # ---------------------------------------------------------- completions
    def _apply(self, done: list[Completion]) -> None:
        if done:
            self._refused = None  # a copy settled: GPU blocks or cached blocks may have come back
        for c in done:
            if c.ok:
                self.copy_seconds += c.elapsed_s
                self.copies_landed += 1
            self._quiet.pop(c.request_id, None)  # where its KV is, or whether it is cached, may have changed
            if c.kind is PlanKind.OFFLOAD or c.request_id not in self.requests:
                continue
            # Where the KV is now is the completion's residency (the manager's state machine); the
            # request's queue says what it was waiting for.
            req = self.requests[c.request_id]
            rid = req.request_id
            st, res = self.status[rid], c.residency
            if st is S.ARRIVING:
                self._arriving.discard(rid)
                if res is Residency.GPU:  # landed: its GPU hits and what was copied in count as computed
                    req.num_computed_tokens = c.num_tokens
                    self._run(req)
                elif res is Residency.CPU:  # a swap-in failed: back to the front of the swapped queue
                    self.status[rid] = S.SWAPPED
                    self.swapped.appendleft(req)
                else:  # an onboarding failed: the manager holds nothing; recompute from scratch
                    req.num_computed_tokens = 0
                    self.status[rid] = S.WAITING
                    self.waiting.appendleft(req)
            elif st is S.SWAPPED:
                if res is Residency.GPU:  # its swap-out failed: it runs on (on CPU: swapped, as it waited)
                    self.swapped.remove(req)
                    self.status[rid] = S.RUNNING
                    self.running.append(req)
                    self._lagging.add(rid)
            elif rid in self._loads:  # a layer-wise swap-in: it has been running meanwhile
                del self._loads[rid]
                if res is Residency.CPU:  # failed: back to the front of the swapped queue, with its progress there
                    self.running.remove(req)
                    self.status[rid] = S.SWAPPED
                    self.swapped.appendleft(req)
            if rid in self._aborting:
                self._aborting.discard(rid)
                self._finish(req)
        for observe in self.completion_observers:  # after the loop: a raising observer cannot leave a copy half-applied
            for c in done:
                observe(c)

    def _run(self, req: Request) -> None:
        """Its KV landed whole on the GPU: it runs, and is no victim until it has computed a step."""
        rid = req.request_id
        self.status[rid] = S.RUNNING
        self.running.append(req)
        self._fresh.add(rid)
        self._lagging.add(rid)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (see the module docstring for the order of things)."""
        kv = self._kv
        done = kv.poll()
        if done:
            self._apply(done)
        if self._passed:
            self._passed.clear()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Blocks the copies in flight will free: read from the manager when a request first lacks room
        # (_make_room), as nothing before that in this loop starts or settles a copy.
        promised: int | None = None
        status, chunked = self.status, self.config.chunked_prefill
        preempted, scheduled = out.preempted, out.scheduled
        quiet, marks, loads = self._quiet, self._high_water, self._loads
        running = S.RUNNING
        tokens = 0  # batched by this loop (_unschedule takes a victim's tokens off out.num_tokens meanwhile)
        stalled: list[Request] = []  # fresh requests that found no room and waited
        for req in list(self.running):
            if budget <= 0:
                break
            rid = req.request_id
            if preempted and status[rid] is not running:
                continue  # preempted earlier in this step (running holds RUNNING requests only)
            c = req.num_computed_tokens
            n = len(req.all_token_ids) - c
            if n > budget:
                if not chunked:
                    continue
                n = budget
            # Most decode steps: the token lands in a block it holds and fills none, so the
            # manager would change nothing; skip the call.  Otherwise allocate, making room
            # (preempting) or waiting when it does not fit.
            if c + n > quiet.get(rid, 0):
                q = kv.grow(rid, n)
                if q is None:
                    q, promised, budget = self._make_room(req, n, promised, budget, out, stalled)
                    if q is None:
                        continue
                elif self._refused is not None or self._lagging:
                    self._grown(req, c, n)
                quiet[rid] = q
            scheduled.append((req, n))  # _add, inlined: the loop's one call per batched request
            tokens += n
            if marks or loads:
                self._note(out, req, n)
            budget -= n
        out.num_tokens += tokens
        if stalled:
            self._yield_if_stuck(stalled, out)
        if not out.preempted:
            budget = self._resume(out, budget)
        if not self.swapped and not out.preempted:
            self._admit(out, budget)
        # Prompt blocks this step completes are stored layer by layer while it computes them.
        saves = kv.on_schedule_end(
            out.admitted, [rid for rid, _ in out.preempted], layerwise_stores=self.config.layerwise
        )
        if saves:
            out.saves.update(saves)
        self._unapplied = out
        return out

    def _grown(self, req: Request, c: int, n: int) -> None:
        """``req`` (``c`` tokens computed) got room for ``n`` more: forget the refusal if that may cache its prefix.

        An allocation caches, under the request's block hashes, the full
        blocks of its first ``c + n`` tokens not cached yet.  A request not
        lagging (see ``_lagging``) has every full block of its first ``c``
        tokens cached already (each earlier step cached what it filled), so
        what this one caches is among its hashes from block ``c // block_size``
        on; ``c * len(hashes) // len(tokens)`` is never above that (its hashes
        cover at most ``len(tokens) // block_size`` blocks), and the scheduler
        needs no block size.  A lagging request may cache any of its blocks.
        The refused request's prefix hits can only grow when one of its own
        hashes becomes cached.
        """
        rid = req.request_id
        if rid in self._lagging:
            if rid not in self._loads:  # on the GPU: this allocation cached every full block it had not
                self._lagging.discard(rid)
            lo = 0
        else:
            lo = c * len(req.block_hashes) // len(req.all_token_ids)
        if self._refused is not None and not self._refused_keys.isdisjoint(req.block_hashes[lo:]):
            self._refused = None

    # ------------------------------------------------------------ preemption
    # When a running request's tokens do not fit, blocks that copies in flight will free are counted
    # first (waiting beats preempting); then vLLM's loop: preempt one victim, try again, until the
    # request fits or the victim was the request itself.  The victim policy picks each victim among
    # the candidates vLLM's rule gives (see _candidates); with last_admitted it is vLLM's own victim.
    def _make_room(
        self,
        req: Request,
        n: int,
        promised: int | None,
        budget: int,
        out: SchedulerOutput,
        stalled: list[Request] | None = None,
    ) -> tuple[int | None, int | None, int]:
        """Allocate ``n`` tokens for ``req``, preempting if needed; (grow's answer, promised blocks left, token budget).

        Grow's answer is ``None`` when it does not fit.
        ``promised``: blocks the copies in flight will free and no earlier
        request of this step waits for, or ``None`` if this step has not read
        them yet (then they are read now, with the room).
        The budget grows by the tokens of a victim taken out of this step's
        batch.  A fresh request (no step computed since it became runnable)
        that finds no victim waits instead of preempting itself; it is
        appended to ``stalled``.
        """
        kv, rid = self._kv, req.request_id
        for i in range(len(self.running) + 1):  # each round preempts one victim, or ends
            if i and (q := kv.grow(rid, n)) is not None:  # the caller tried once already
                return q, promised, budget
            room = kv.room(rid, n)
            if promised is None:
                promised = room.blocks_freed_on_completion
            short = room.blocks_short
            if short <= promised:
                return None, promised - short, budget  # copies in flight will free enough: wait for them
            victim = self._victim(req, out)
            if victim is None:
                if rid in self._fresh and stalled is not None:  # preempting it would undo its resume
                    stalled.append(req)
                return None, promised, budget  # it cannot be preempted now (fresh, or its KV landing): it waits
            if victim is req:
                self._preempt(req, out)  # nobody before it in the order: vLLM preempts the request itself
                return None, promised, budget
            n_back = self._unschedule(victim, out)
            budget += n_back
            promised += self._preempt(victim, out, unschedule=n_back > 0).blocks_freed_on_completion
        raise AssertionError(f"request {rid!r}: preemption did not make room")  # pragma: no cover

    def _victim(self, req: Request, out: SchedulerOutput) -> Request | None:
        """The next request to preempt so that ``req`` fits: the policy's first candidate (``req`` may be it).

        Who may go, in what order, is vLLM's rule (:meth:`_candidates`); the
        manager's victim policy re-ranks them by what it knows of their KV.
        """
        ranked = self._candidates(req, out)
        if not ranked:
            return None
        rid = self._kv.victim(req.request_id, ranked, self.config.victim_policy, self.config.mode)
        return None if rid is None else self.requests[rid]

    def _candidates(self, req: Request, out: SchedulerOutput) -> list[Hashable]:
        """Who may be preempted so that ``req`` fits, ranked by vLLM's rule (the last is vLLM's victim).

        FCFS: ``req`` and the running requests not scheduled this step, ranked
        by their place in the running queue (vLLM pops the queue's last until
        the requester is the last).  Priority: every running request, the
        requester and those scheduled this step included, ranked by
        ``(priority, arrival_time)``, ties by queue place the first highest
        (vLLM's ``max`` over the queue).  Never a request whose KV is still
        landing, nor a fresh one (see the module docstring).
        """
        status, loads, fresh = self.status, self._loads, self._fresh
        running = self.running
        if self.config.policy == "fcfs":
            batch = {r.request_id for r, _ in out.scheduled}
            batch.discard(req.request_id)
            order = running
        else:
            batch = set()
            ranked = sorted(enumerate(running), key=lambda t: (t[1].priority, t[1].arrival_time, -t[0]))
            order = [r for _, r in ranked]
        running_status = S.RUNNING
        return [
            rid
            for r in order
            if (rid := r.request_id) not in batch
            and status[rid] is running_status
            and rid not in loads
            and rid not in fresh
        ]

    def _unschedule(self, req: Request, out: SchedulerOutput) -> int:
        """Take ``req`` out of this step's batch if it is there (a priority victim); return the tokens it gives back."""
        for i, (r, n) in enumerate(out.scheduled):
            if r is req:
                del out.scheduled[i]
                out.num_tokens -= n
                rid = req.request_id
                mark = self._high_water.get(rid, 0) or self._passed.pop(rid, 0)
                c = req.num_computed_tokens
                if mark > c:  # it was computing again what a recompute preemption dropped: not this step
                    out.recomputed_tokens -= out.recomputed.pop(rid)
                    self._high_water[rid] = mark
                return n
        return 0

    def _yield_if_stuck(self, stalled: list[Request], out: SchedulerOutput) -> None:
        """Fresh requests waited for room, yet the step runs nothing and no copy will land: the last one yields.

        Nothing else can free a block then, so waiting would make empty steps
        forever; preempting it is vLLM's answer to a request that cannot fit.
        """
        if stalled and not out.scheduled and not self._kv.room().copies_in_flight:
            req = stalled[-1]
            self._fresh.discard(req.request_id)
            self._preempt(req, out)

    def _preempt(self, req: Request, out: SchedulerOutput, unschedule: bool = False) -> Preemption:
        """Preempt ``req`` (``unschedule``: taken out of this step's batch first) by the mode its quote chooses."""
        rid = req.request_id
        kv, mode = self._kv, self.config.mode
        # A forced swap may be impossible (no room on the CPU tier, nothing computed): then by the quote.
        p = kv.preempt(rid, mode, unschedule=unschedule) or kv.preempt(rid, "auto", unschedule=unschedule)
        assert p is not None
        self._refused = None  # its blocks are released (or will be when its copy settles)
        self._quiet.pop(rid, None)  # its blocks are released or leaving
        self._lagging.discard(rid)  # no longer running (a resume or a landing marks it again)
        self.running.remove(req)
        req.num_preemptions += 1
        out.preempted.append((rid, p.mode))
        if p.mode is PreemptMode.SWAP:
            self.status[rid] = S.SWAPPED  # its KV on the CPU tier, or leaving (p.residency says which)
            self.swapped.append(req)
        else:
            self._high_water[rid] = max(self._high_water.get(rid, 0), req.num_computed_tokens)
            req.num_computed_tokens = 0
            self.status[rid] = S.WAITING
            self.waiting.appendleft(req)
        return p

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """Batch ``n`` tokens of ``req``: count what it computes again, and name the load it computes over."""
        out.scheduled.append((req, n))
        out.num_tokens += n
        if self._high_water or self._loads:
            self._note(out, req, n)

    def _note(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """For ``n`` batched tokens of ``req``: the tokens it computes again, and the load it computes over."""
        rid = req.request_id
        if self._high_water:  # only recompute victims have a mark, until they pass it again
            mark = self._high_water.get(rid, 0)
            c = req.num_computed_tokens
            if mark > c:
                k = min(c + n, mark) - c
                out.recomputed_tokens += k
                out.recomputed[rid] = k
                if c + n >= mark:
                    del self._high_water[rid]
                    self._passed[rid] = mark  # until the step is over: a priority victim leaving the batch keeps it
        if self._loads and rid in self._loads:  # landing layer by layer: the driver waits on it per layer
            out.loads[rid] = self._loads[rid]

    def _num_admitted(self) -> int:
        """Requests holding a seat: running, or with KV arriving (loading, swapping in)."""
        return len(self.running) + len(self._arriving)

    def _resume(self, out: SchedulerOutput, budget: int) -> int:
        """Resume swapped requests, oldest first; return the token budget left."""
        seats = self.config.max_num_seqs - self._num_admitted()
        layered, kv = self.config.layerwise, self._kv
        while self.swapped and seats > 0:
            req = self.swapped[0]
            rid = req.request_id
            if kv.state(rid).residency is not Residency.CPU:
                break  # oldest first: wait for its swap-out to land
            # Room for its KV and its next step (resumed without it, it could not run), and, while
            # others run, the manager's watermark: it is a preempted request coming back, as vLLM's is.
            res = kv.resume(
                rid, layered, num_new_tokens=self._next_tokens(req, budget), keep_watermark=bool(self.running)
            )
            if res is None:
                break
            self.swapped.popleft()
            self._refused = None  # it took GPU blocks and may have touched cached ones
            self._quiet.pop(rid, None)
            self._fresh.add(rid)
            self._lagging.add(rid)
            seats -= 1
            out.resumed.append(rid)
            if res.plan is not None and not layered:
                self.status[rid] = S.ARRIVING
                self._arriving.add(rid)
                continue
            req.num_computed_tokens = res.num_tokens
            self.status[rid] = S.RUNNING
            self.running.append(req)
            if res.handle is not None:  # landing layer by layer while it computes
                self._loads[rid] = res.handle
            budget = self._start_resumed(out, req, budget)
        return budget

    def _next_tokens(self, req: Request, budget: int) -> int:
        """Tokens the request computes in its next step: the rest of its tokens, chunked to the budget (>= 1)."""
        n = len(req.all_token_ids) - req.num_computed_tokens
        return min(n, max(budget, 1)) if self.config.chunked_prefill else n

    def _start_resumed(self, out: SchedulerOutput, req: Request, budget: int) -> int:
        """Schedule a request in the step it resumes (its KV whole on the GPU, or landing layer by layer).

        As vLLM schedules a resumed request in the step that resumes it: it
        makes progress before anything can preempt it again.  Skipped when its
        tokens do not fit the budget or the pool now; it then runs in a later
        step, still protected until it has computed (see the module docstring).
        """
        n = len(req.all_token_ids) - req.num_computed_tokens
        if n > budget:
            if not self.config.chunked_prefill or budget <= 0:
                return budget
            n = budget
        if self._kv.grow(req.request_id, n) is None:
            return budget  # runs in a later step, once its load has landed or room is made
        self._grown(req, req.num_computed_tokens, n)
        self._add(out, req, n)
        return budget - n

    def _next_waiting(self) -> Request:
        """FCFS: the queue's first.  Priority: the lowest ``(priority, arrival_time, request_id)``, vLLM's heap order.

        Request ids that do not compare with each other (ids of mixed types)
        leave ties in queue order.
        """
        if self.config.policy == "fcfs":
            return self.waiting[0]
        try:
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time, r.request_id))
        except TypeError:
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order until one does not fit (vLLM 0.33's waiting loop).

        The manager is not asked again about the request it refused last
        while nothing has happened since that could let it in: then it
        refuses it again, so the call is skipped.  With chunked prefill and
        ``scheduler_reserve_full_isl`` (vLLM's defaults) the manager refuses
        exactly when the whole sequence's blocks not held by other requests
        (its prefix hits that others hold are free for it; an evictable hit
        costs a free block as a new block does), plus the watermark while
        requests run, exceed the free blocks; the budget (this chunk is never
        more than the whole sequence) and the hits on the tiers below the GPU
        (loaded into new blocks) do not enter.  That shortfall only shrinks
        when blocks return to the pool (a finish, an abort, a preemption, a
        settled copy: each drops the refusal), or when one of its own block
        hashes becomes cached on the GPU (its hits are its leading cached
        hashes; :meth:`_grown` and any admission or resume drop the refusal
        then).  Everything else that happens between steps takes free
        blocks, makes a hit evictable or held at the cost of a free block,
        or evicts, and none of that shrinks it.  A skipped call would only
        have counted one more prefix lookup (the GPU pool's
        ``prefix_cache_stats``, the stores' lookup statistics) and asked the
        tiers below the CPU again; vLLM 0.33 counts a lookup only when the
        request is admitted.
        """
        cfg = self.config
        chunked, full = cfg.chunked_prefill, cfg.scheduler_reserve_full_isl
        seats = cfg.max_num_seqs - self._num_admitted()
        while self.waiting and budget > 0 and seats > 0:
            req = self._next_waiting()
            has_running = bool(self.running)
            if req is self._refused and has_running == self._refused_running and chunked and full:
                return  # refused again: nothing that could let it in has happened since (see above)
            res = self._kv.admit(
                req,
                min(req.num_tokens, budget),
                chunked=chunked,
                full_sequence_must_fit=full,
                has_scheduled_reqs=has_running,
            )
            if res is None:  # it does not fit (the budget, the pool, the gates): vLLM stops admitting too
                if req is not self._refused:
                    self._refused, self._refused_keys = req, frozenset(req.block_hashes)
                self._refused_running = has_running
                return
            self._refused = None  # its allocation may have cached blocks, or touched another's hits
            self.waiting.remove(req)
            seats -= 1
            rid = req.request_id
            self._quiet.pop(rid, None)
            self._fresh.add(rid)
            req.num_computed_tokens = res.num_computed_tokens
            out.admitted.append(rid)
            mark = self._high_water.get(rid, 0)
            if mark:  # a recompute victim back: what its hits did not restore is computed again
                self.tokens_recomputed += max(mark - res.num_computed_tokens - res.num_loading_tokens, 0)
            if res.runnable:
                self.status[rid] = S.RUNNING
                self.running.append(req)
                self._add(out, req, res.num_new_tokens)
                budget -= res.num_new_tokens
            else:
                self.status[rid] = S.ARRIVING
                self._arriving.add(rid)

    # ---------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, sampled: Mapping[Hashable, int]) -> list[Request]:
        """Apply a computed step: advance progress, append sampled tokens; return the requests that finished.

        ``sampled`` maps the id of every request whose scheduled tokens reached
        the end of its known tokens to the token it sampled (and no other id).
        A request aborted after ``schedule`` needs no token; one given for it is
        ignored, as its step no longer counts.
        A request whose layer-wise load failed (``out.loads``) computed on KV
        that never landed: its step is discarded (a token it sampled is
        ignored) and it goes back to the front of the swapped queue.  Loads
        are settled here, so call this after the step's compute, which waited
        for every layer.

        ``out`` must be the output of the latest :meth:`schedule`, applied once:
        another (an older step's, or one applied already) is refused with
        ``InvalidArgumentError`` and nothing changes.
        """
        if out is not self._unapplied:
            what = (
                "this one was applied already, or a later schedule() replaced it"
                if isinstance(out, SchedulerOutput)
                else f"got {checks.describe(out)}"
            )
            raise InvalidArgumentError(f"update takes the output of the latest schedule(), once: {what}")
        if not isinstance(sampled, Mapping):
            raise InvalidArgumentError(
                f"sampled must map request ids to sampled tokens, got {checks.describe(sampled)}"
            )
        loads = out.loads
        failed = {rid for rid, h in loads.items() if not h.wait()} if loads else ()  # waits only: nothing changes
        status, running = self.status, S.RUNNING
        need = ignored = 0
        steps: list[tuple[Request, int, int | None]] = []  # what counts: (request, tokens, the token it sampled)
        for r, n in out.scheduled:  # check everything before changing anything
            rid = r.request_id
            ends = r.num_computed_tokens + n == len(r.all_token_ids)
            if status.get(rid) is not running or (failed and rid in failed):
                if ends:
                    ignored += rid in sampled  # its step no longer counts: a token for it may come or not
                continue
            if ends:
                need += 1
                t = sampled.get(rid)
                if type(t) is not int:  # exact: a bool is no token
                    raise InvalidArgumentError(
                        f"request {rid!r} reached the end of its tokens: sampled must map it to an int "
                        f"token, got {checks.describe(t)}"
                    )
                steps.append((r, n, t))
            else:
                steps.append((r, n, None))
        extra = len(sampled) - ignored
        if extra != need:
            raise InvalidArgumentError(f"sampled has {extra} entries, but {need} requests sampled a token")
        self._unapplied = None  # checked: from here on the step is applied
        # The step has computed every layer: whatever layer of a store the driver did not open is opened,
        # and the loads it computed over settle now (a request aborted while its load was landing ends then).
        settled = bool(out.saves or loads)
        if settled:
            self._apply(self._kv.step_computed(list(out.saves.values()), list(loads.values())))
        finished: list[Request] = []
        fresh, kv = self._fresh, self._kv
        for req, n, t in steps:
            rid = req.request_id
            if settled and status.get(rid) is not running:
                continue  # it ended as its load settled: this step did not count
            if fresh:
                fresh.discard(rid)  # it made progress: it may be preempted again
            c = req.num_computed_tokens
            req.num_computed_tokens = c + n
            if c < req.num_prompt_tokens:
                kv.on_tokens_computed(rid)
            if t is not None:
                tokens = req.all_token_ids
                tokens.append(t)
                if len(tokens) - req.num_prompt_tokens >= req.max_tokens:
                    self._finish(req, running=True)
                    finished.append(req)
        return finished

    def _finish(self, req: Request, running: bool = False) -> None:
        """End ``req`` here and in the manager (``running``: it is running, so the manager holds it open)."""
        rid = req.request_id
        self._refused = None  # its blocks are released
        # Open: its KV, or only its request in the CPU store (a recompute victim, a failed load).
        if running or self._kv.state(rid).open:
            self._kv.free(rid)
        queue = self._queues.get(self.status.pop(rid))  # its status names the one queue it is in
        if queue is not None:
            queue.remove(req)
        del self.requests[rid]
        self._quiet.pop(rid, None)
        self._high_water.pop(rid, None)
        self._loads.pop(rid, None)
        self._arriving.discard(rid)
        self._fresh.discard(rid)
        self._lagging.discard(rid)

    def check_consistency(self) -> None:
        """Assert that each queue holds exactly the requests of its status, and that the manager agrees (for tests).

        The status is the queue; where the KV is comes from the manager
        (``TierManager.state``), and must be one a request in that queue can have.
        """
        allowed = {
            S.WAITING: (None,),
            S.ARRIVING: (Residency.LOADING, Residency.SWAPPING_IN),
            S.RUNNING: (Residency.GPU,),
            S.SWAPPED: (Residency.SWAPPING_OUT, Residency.CPU),
        }
        for rid, st in self.status.items():
            res = self._kv.state(rid).residency
            ok = (Residency.SWAPPING_IN,) if rid in self._loads else allowed[st]  # running while its KV lands
            assert res in ok, f"{rid!r}: status {st.value} but residency {res}"
        for queue, st in ((self.running, S.RUNNING), (self.waiting, S.WAITING), (self.swapped, S.SWAPPED)):
            assert {r.request_id for r in queue} == {k for k, s in self.status.items() if s is st}, st
        assert self._arriving == {k for k, s in self.status.items() if s is S.ARRIVING}
        for rid, st in self.status.items():
            if st is S.WAITING and self.requests[rid].num_computed_tokens != 0:
                raise InvalidTransitionError(f"{rid!r} waits with computed tokens")
