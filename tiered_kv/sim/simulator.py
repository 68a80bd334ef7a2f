"""The simulator: the real TierManager and Scheduler, driven on a simulated clock.

Per step the scheduler picks a batch through the tier manager (the same calls
a real engine makes), the step-time model says how long the step takes, and
the simulated host link (:class:`~tiered_kv.sim.link.SimLink`) moves blocks.
How copies and compute interfere is the run's copy mode: ``async`` copies
overlap compute; ``blocking`` copies delay the step that follows them;
``layerwise`` swap-ins stretch the step that reads them only where a layer's
copy is later than its compute.  Results are a plain, deterministic dict:
identical seed and config give identical output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from tiered_kv.core.request import Request
from tiered_kv.errors import TieredKVError
from tiered_kv.manager.states import PreemptMode
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.sched import Scheduler, SchedulerOutput
from tiered_kv.sim import tier_io
from tiered_kv.sim.client import READY, Client
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.link import CopyGeometry, CopyJob, SimLink
from tiered_kv.sim.records import RequestRecord
from tiered_kv.sim.workload import SimRequest
from tiered_kv.transfer.plan import PlanKind

GB = 1e9


class SimulationError(TieredKVError, RuntimeError):
    """The simulation cannot make progress (for example, a swap-only run with the link down)."""


def percentiles(values: list[float], qs: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """Linear-interpolated percentiles (``p50`` ...); empty input gives zeros."""
    if not values:
        return {f"p{int(q)}": 0.0 for q in qs}
    xs = sorted(values)
    out = {}
    for q in qs:
        pos = (len(xs) - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{int(q)}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def overlap_seconds(intervals: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Total overlap of (possibly overlapping) ``intervals`` with sorted, disjoint ``busy`` spans."""
    total = 0.0
    j0 = 0
    for s, e in sorted(intervals):
        while j0 < len(busy) and busy[j0][1] <= s:
            j0 += 1
        j = j0
        while j < len(busy) and busy[j][0] < e:
            total += max(0.0, min(e, busy[j][1]) - max(s, busy[j][0]))
            j += 1
    return total


@dataclass(slots=True, eq=False)
class Step:
    """One computed step, kept for timelines: when it ran and what it waited for."""

    index: int
    issued: float
    start: float
    end: float
    compute_s: float
    num_seqs: int
    num_tokens: int
    preempted: int
    resumed: int


class Simulator:
    """One run of one workload under one :class:`RunSetup`.

    Args:
        setup: The run.
        workload: Requests, in arrival order.
        record_trace: Keep the whole event trace (``loop.trace``), for tests.
        progress: Called now and then with (finished, total, simulated seconds).
        usage_points: About how many memory-usage samples the results keep.
        keep_timeline: Keep every step and copy (:attr:`steps`, ``engine.jobs``),
            for ``--timeline``.
        manager_class: The tier manager's class: :class:`TierManager` or a
            subclass that keeps its contract (one whose ``quiet_tokens`` reports
            nothing quiet runs the scheduler's plain path, every allocation
            asked of the manager, which must decide exactly as the default).
    """

    def __init__(
        self,
        setup: RunSetup,
        workload: list[SimRequest],
        record_trace: bool = False,
        progress: Callable[[int, int, float], None] | None = None,
        usage_points: int = 200,
        keep_timeline: bool = False,
        manager_class: type[TierManager] = TierManager,
    ) -> None:
        self.setup = setup
        self.workload = workload
        self.loop = EventLoop(record_trace)
        self.progress = progress
        self.usage_points = usage_points
        m = setup.manager
        geometry = CopyGeometry(
            m.block_size * setup.model.kv_bytes_per_token, setup.model.num_layers, setup.kv_layout, setup.coalesce
        )
        self.engine = SimLink(self.loop, setup.link, geometry, setup.copies, keep_jobs=keep_timeline)
        self.engine.on_submit = self._count_copy
        tm = manager_class(
            m,
            self.engine,
            cost_model=setup.cost_model,
        )
        #: The I/O engine of each tier below the CPU (medium -> engine), when the run has such tiers.
        self.tier_engines = tier_io.attach(tm, self.loop, setup.tiers, geometry.bytes_per_block)
        self.records: dict[int, RequestRecord] = {}
        self.outputs = {r.rid: r.output for r in workload}
        #: Sends the requests when the load is a closed loop (a concurrency cap, sessions); None: each at its arrival.
        self.client = (
            None if setup.client.open_loop else Client(setup.client, workload, self.loop, setup.compute.frontend_s)
        )
        self.steps: list[Step] | None = [] if keep_timeline else None
        self.scheduler = Scheduler(tm, setup.scheduler)
        # The run's state, kept between the loop's steps (see _run).
        self._finished = 0  # requests done
        self._layerwise = self.engine.mode == "layerwise"
        self._carry: list[CopyJob] = []  # layerwise copies the next step reads
        self._ms_left = 0  # steps left in a multi-step run (compute.scheduler_steps)
        self._held: list[SimRequest] = []  # arrived during a multi-step run: decided on after it
        self._late: list[SimRequest] = []  # arrived during a step, with async scheduling
        self._deferred: list[SimRequest] = []  # late ones, decided on one decision later
        self._busy: list[tuple[float, float]] = []  # (start, end) of every step
        self._n_steps = 0
        self._tokens_computed = 0
        self._recompute_s = 0.0
        self._stall_s = 0.0
        # Memory usage, about usage_points samples: start from the arrival span, halve when too many.
        self._usage: list[tuple[float, float, float, float]] = []
        last_arrival = max((r.arrival for r in workload), default=0.0)
        self._usage_dt = max(last_arrival, 1.0) / usage_points
        self._next_usage = 0.0

    def _count_copy(self, job: CopyJob) -> None:
        plan = job.plan
        rec = self.records.get(plan.request_id)  # type: ignore[call-overload]  # a tier move's id is no request's
        if rec is None:
            return
        if plan.kind is PlanKind.SWAP_OUT:
            rec.swap_out_bytes += job.nbytes
        elif plan.kind is PlanKind.SWAP_IN:
            rec.swap_in_bytes += job.nbytes
        elif plan.kind is PlanKind.ONBOARD:
            rec.onboard_bytes += job.nbytes

    def run(self) -> dict[str, Any]:
        """Simulate the workload to its end; return the results document."""
        return self._run()

    def _run(self) -> dict[str, Any]:
        """The event loop: decide a step, compute it, handle what happened meanwhile; until every request is done.

        ``benchmarks/bench_sim.py --digest`` pins its decisions, event for event.
        """
        loop, sched = self.loop, self.scheduler
        total = len(self.workload)
        self._send_workload()
        last_report = time.perf_counter()
        while True:
            due = loop.peek_time()
            if due is not None and due <= loop.now:
                self._advance(loop.now)
            if self._finished == total:
                sched.settle()  # settle copies still in flight (stores to the CPU tier)
                nt = loop.peek_time()
                if nt is None:
                    break
                self._advance(nt)
                continue
            self._admit_waiting()
            out = sched.schedule()
            self._note_decisions(out)
            early = self.engine.take_layerwise() if self._layerwise else []
            if out.num_tokens:
                self._step(out)
                self._carry = early
            else:
                self._carry.extend(early)
                if self._decide_again(out, early):
                    continue
            if self.progress is not None and time.perf_counter() - last_report > 0.5:
                self.progress(self._finished, total, loop.now)
                last_report = time.perf_counter()
        if self.progress is not None:
            self.progress(self._finished, total, loop.now)
        return self._results()

    def _send_workload(self) -> None:
        """Schedule every request's arrival at the scheduler, or hand the workload to the client."""
        # The serving front end (HTTP, tokenization, hand-off) delays a request's entry into the
        # scheduler; its record keeps the time it was sent, so TTFT and E2E include the front end.
        if self.client is None:
            front = self.setup.compute.frontend_s
            for r in self.workload:
                self.loop.schedule(r.arrival + front, "arrival", r)
        else:
            self.client.start()  # it sends each request when it is ready and a slot is free

    def _advance(self, to: float, before: bool = False, stepping: bool = False) -> None:
        """Handle every event up to ``to`` (strictly before, with ``before``) at its own time, then set the clock.

        Copies finish mid-step at their own time, so the link's next copy starts
        then; events at the step's end are handled after the step is applied.
        ``stepping``: a step runs until ``to`` (an arrival then is late for async scheduling).
        """
        loop = self.loop
        while True:
            ev = loop.pop_until(to, before)
            if ev is None:
                break
            t_event, kind, payload = ev
            if kind == "copy":
                job = self.engine.on_event(payload)
                if job is not None and loop.trace is not None:
                    loop.log("transfer_done", job.plan.plan_id, t_event)
            elif kind == tier_io.EVENT:
                tier_io.on_event(payload)
            elif kind == READY:
                self.client.ready(payload, t_event)  # type: ignore[union-attr]  # only a client schedules READY
            elif self._ms_left:
                self._held.append(payload)
            elif stepping and self.setup.async_scheduling:
                self._late.append(payload)
            else:
                self._enter(payload, t_event)
        if to > loop.now:
            loop.now = to

    def _enter(self, r: SimRequest, t_event: float) -> None:
        """Request ``r`` reaches the scheduler at ``t_event``."""
        if r.hashes is None:
            req = Request(r.rid, r.prompt, max_tokens=len(r.output), arrival_time=r.arrival)
        else:  # a trace's prefix hashes: the pool keys on them, nothing is tokenized
            req = Request.from_hashes(
                r.rid, r.hashed_len, r.hashes, r.hash_block_size, len(r.output), arrival_time=r.arrival
            )
        self.scheduler.add_request(req)
        rec = RequestRecord(r.rid, r.rid if r.id is None else r.id, r.arrival, r.prompt_len)
        if r.queued:
            rec.client_queue = r.queued
        self.records[r.rid] = rec
        self.loop.log("arrival", r.rid, t_event)

    def _admit_waiting(self) -> None:
        """Hand the scheduler the requests that waited for this decision.

        Multi-step scheduling (vLLM 0.6's ``--num-scheduler-steps``): a decode-only batch runs
        ``scheduler_steps`` steps per decision, and requests arriving meanwhile wait (``held``)
        for the next decision.  Async scheduling (vLLM 0.14.0 and later): step k + 1 is decided
        while step k runs, so a request that reaches the scheduler during step k is first decided
        on after it, for step k + 2 (``late`` during the step, ``deferred`` for one decision),
        unless step k + 1 had nothing to run.
        """
        now = self.loop.now
        if self._held and not self._ms_left:
            for r in self._held:
                self._enter(r, now)  # it reaches the scheduler now, at the decision it waited for
            self._held.clear()
        if self._deferred:
            for r in self._deferred:
                self._enter(r, now)  # one decision later: the step after next, as async scheduling has it
            self._deferred.clear()
        if self._late:
            if self.scheduler.num_unfinished:  # the next step was decided without them: they wait for the one after
                self._deferred.extend(self._late)
            else:
                for r in self._late:
                    self._enter(r, now)
            self._late.clear()

    def _note_decisions(self, out: SchedulerOutput) -> None:
        """Count the step's preemptions and first admissions in the requests' records."""
        if self.loop.trace is not None:
            self._log_batch(out)
        records = self.records
        for rid, mode in out.preempted:
            rec = records[rid]  # type: ignore[index]
            if mode is PreemptMode.SWAP:
                rec.preemptions_swap += 1
            else:
                rec.preemptions_recompute += 1
        for rid in out.admitted:
            rec = records[rid]  # type: ignore[index]
            if rec.admitted < 0:
                rec.admitted = self.loop.now

    def _step(self, out: SchedulerOutput) -> None:
        """Compute the batch ``out``: how long it takes, what the link does meanwhile, the tokens it samples."""
        loop, link, compute = self.loop, self.engine, self.setup.compute
        now = loop.now
        records, outputs = self.records, self.outputs
        attn = 0  # exact in ints; the float of the sum is what a float accumulator gave (< 2**53)
        kv = 0
        pre = 0  # tokens and attention units of prefill chunks (requests computing > 1 token)
        pre_attn = 0
        sampled: dict[Hashable, int] = {}
        firsts: list[RequestRecord] = []  # records of requests sampling their first output token
        for req, n in out.scheduled:
            rid = req.request_id
            rec = records[rid]  # type: ignore[index]  # the simulator's requests are numbered 0..n-1
            c = req.num_computed_tokens
            e = c + n
            attn += n * (c + e)  # = e * e - c * c
            kv += e
            if n > 1:
                pre += n
                pre_attn += n * (c + e)
            if e == req.num_tokens:
                k = e - req.num_prompt_tokens
                sampled[rid] = outputs[rid][k]  # type: ignore[index]
                if not k:
                    firsts.append(rec)
        dt = compute.step_time(out.num_tokens, float(attn), kv, len(out.scheduled), len(sampled), pre, float(pre_attn))
        steps_per_decision = compute.scheduler_steps
        if steps_per_decision > 1:
            # a decision that scheduled only decodes starts a run of scheduler_steps steps
            self._ms_left = self._ms_left - 1 if self._ms_left else (steps_per_decision - 1 if not pre else 0)
        if out.recomputed_tokens:
            self._recompute_s += dt * out.recomputed_tokens / out.num_tokens
            for r_id, k in out.recomputed.items():  # the scheduler keeps the high-water marks
                records[r_id].recomputed_tokens += k  # type: ignore[index]
        start = now
        if link.mode == "blocking" and link.busy():
            start = link.idle_at()  # the compute stream waits for every copy issued before it
        end = start + dt
        if self._carry:
            end = link.layerwise_end(self._carry, start, dt, self.setup.model.num_layers)
            self._carry = []
        if end - now > dt:
            self._stall_s += end - now - dt
        self._advance(end, before=True, stepping=True)
        self._busy.append((start, end))
        self._n_steps += 1
        self._tokens_computed += out.num_tokens
        if self.steps is not None:
            self.steps.append(
                Step(self._n_steps, now, start, end, dt, len(out.scheduled), out.num_tokens,
                     len(out.preempted), len(out.resumed))
            )  # fmt: skip
        for rec in firsts:
            if rec.first_token < 0:
                rec.first_token = end
        for rid in sampled:  # every token sampled in this step reaches the client at its end
            records[rid].token_times.append(end)  # type: ignore[index]
        for req in self.scheduler.update(out, sampled):
            rec = records[req.request_id]  # type: ignore[index]
            rec.finish = end
            rec.output_tokens = req.num_output_tokens
            loop.log("finish", req.request_id)
            if self.client is not None:
                self.client.finished(rec.rid, end)
        self._finished = len(records) - self.scheduler.num_unfinished
        if end >= self._next_usage:
            self._sample_usage(end)

    def _sample_usage(self, t: float) -> None:
        """Keep the memory usage at ``t``: about :attr:`usage_points` samples over the run."""
        m = self.scheduler.tm.metrics()
        # held: pinned by a swapped request or a load, or being written (cannot be evicted);
        # fill: every block the CPU tier caches, held or evictable.  Both are fractions of the tier.
        cpu_held = m.cpu_pinned_blocks / m.cpu_blocks if m.cpu_blocks else 0.0
        fill = m.cpu_cached_blocks / m.cpu_blocks if m.cpu_blocks else 0.0
        self._usage.append((t, m.gpu_usage, cpu_held, fill))
        self._next_usage = t + self._usage_dt
        # a long tail: keep every other sample, sample half as often
        if len(self._usage) >= 2 * self.usage_points:
            self._usage = self._usage[::2]
            self._usage_dt *= 2

    def _decide_again(self, out: SchedulerOutput, early: list[CopyJob]) -> bool:
        """Nothing was computed: True if the next decision is now; else move the clock to the next event.

        Raises:
            SimulationError: nothing runs and nothing is left to wait for.
        """
        if self._held:  # nothing runs: the multi-step run is over, and the next decision is now
            self._ms_left = 0
            return True
        if self._deferred:  # nothing ran: the step they waited for was empty, so they are decided on now
            for r in self._deferred:
                self._enter(r, self.loop.now)
            self._deferred.clear()
            return True
        if early:
            return True  # a layerwise copy was ordered: its request can run in the next step, now
        loop, sched = self.loop, self.scheduler
        nt = loop.peek_time()
        if nt is None and (out.resumed or out.admitted):
            # A request came back (or in) after this step's batch was picked, its KV on the GPU
            # already: with nothing else to wait for, it runs in the next step, now.
            return True
        if nt is None:
            raise SimulationError(
                f"run {self.setup.name!r}: no progress at t={loop.now:.3f}s with {sched.num_unfinished} "
                f"requests unfinished ({len(sched.waiting)} waiting, {len(sched.running)} running, "
                f"{len(sched.swapped)} swapped) and nothing left to wait for"
            )
        self._advance(max(loop.now, nt))
        return False

    def _log_batch(self, out: SchedulerOutput) -> None:
        for rid, mode in out.preempted:
            self.loop.log(f"preempt_{mode.value}", rid)
        for rid in out.resumed:
            self.loop.log("resume", rid)
        for rid in out.admitted:
            self.loop.log("admit", rid)
        if out.scheduled:
            self.loop.log("step", tuple((req.request_id, n) for req, n in out.scheduled))

    # About 70 lines: one flat results document, field by field; split, it would only scatter the fields.
    def _results(self) -> dict[str, Any]:
        recs = list(self.records.values())
        makespan = max((r.finish for r in recs), default=0.0)
        ttft = [r.first_token - r.arrival for r in recs]
        e2e = [r.finish - r.arrival for r in recs]
        # the wait in the scheduler's queue: from reaching the scheduler, after the front end
        front = self.setup.compute.frontend_s
        queue = [r.admitted - r.arrival - front for r in recs if r.admitted >= 0]
        tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in recs if r.output_tokens > 1]
        # Inter-token latency: the gaps between consecutive tokens of each request, pooled over the
        # requests, as vLLM's benchmark client pools them (``itls += outputs[i].itl``) before its percentiles.
        itl = [b - a for r in recs for a, b in pairwise(r.token_times)]
        n_out = sum(r.output_tokens for r in recs)
        requested = sum(len(o) for o in self.outputs.values())
        m = self.scheduler.tm.metrics()
        c = m.counters
        intervals = self.engine.intervals
        transfer_s = sum(e - s for s, e, _, _ in intervals)
        hidden = overlap_seconds([(s, e) for s, e, _, _ in intervals], self._busy)
        usage = self._usage
        stride = max(1, len(usage) // self.usage_points)
        # Untyped: each field is copied as the set-up holds it (compiled, a typed read would turn
        # a whole number of GiB given as an int into a float, and the document would change).
        st: Any = self.setup
        return {
            "run": st.name,
            "victim_policy": st.scheduler.victim_policy,
            "mode": st.scheduler.mode,
            "offload": st.manager.offload,
            "copies": st.copies,
            "kv_layout": st.kv_layout,
            "gpu_blocks": st.manager.num_gpu_blocks,
            "cpu_blocks": st.manager.num_cpu_blocks,
            "gpu_kv_gib": st.gpu_kv_gib,
            "cpu_kv_gib": st.cpu_kv_gib,
            "requests": len(recs),
            "requests_finished": sum(1 for r in recs if r.finish >= 0),
            "output_tokens": n_out,
            "requested_output_tokens": requested,
            "makespan_s": makespan,
            "steps": self._n_steps,
            "tokens_computed": self._tokens_computed,
            "throughput_rps": len(recs) / makespan if makespan else 0.0,
            "throughput_output_tps": n_out / makespan if makespan else 0.0,
            "ttft_s": percentiles(ttft),
            # TTFT's parts outside the engine: the front end (the same for every request) and the queue
            "frontend_s": front,
            "queue_s": percentiles(queue),
            "tpot_s": percentiles(tpot),
            "itl_s": {**percentiles(itl), "mean": sum(itl) / len(itl) if itl else 0.0},
            # the wait for a free slot of the client's concurrency cap, before a request is sent (vLLM's
            # client_queue_time); TTFT and E2E count from the send, as vLLM's client measures them
            "client_queue_s": percentiles([r.client_queue for r in recs]),
            "e2e_s": percentiles(e2e),
            # the vLLM paper's normalized latency: mean over requests of end-to-end latency / output tokens
            "norm_latency_s": sum(x / r.output_tokens for x, r in zip(e2e, recs, strict=True) if r.output_tokens)
            / max(1, sum(1 for r in recs if r.output_tokens)),
            "preemptions_swap": c.preemptions_swap,
            "preemptions_recompute": c.preemptions_recompute,
            "gb_swapped_out": c.swap_out_bytes / GB,
            "gb_swapped_in": c.swap_in_bytes / GB,
            "gb_offloaded": c.offload_bytes / GB,
            "gb_onboarded": c.onboard_bytes / GB,
            "copies_issued": self.engine.copies_issued,
            "tokens_recomputed": self.scheduler.tokens_recomputed,
            "recompute_s": self._recompute_s,
            "gpu_prefix_hit_rate": m.gpu_hit_rate,
            "cpu_prefix_hit_rate": m.cpu_hit_rate,
            # Tokens looked up and found at admission, kept apart as vLLM does: a request's first
            # admission (hits are prefix reuse between requests) and the re-admission of a recompute
            # victim (hits are mostly its own KV found again, not reuse).
            "lookup_tokens": {
                "first": {"tokens": c.gpu_query_tokens, "gpu": c.gpu_hit_tokens, "cpu": c.cpu_hit_tokens},
                "readmitted": {
                    "tokens": c.preempted_gpu_query_tokens,
                    "gpu": c.preempted_gpu_hit_tokens,
                    "cpu": c.preempted_cpu_hit_tokens,
                },
            },
            "transfer_s": transfer_s,
            "transfer_hidden_s": hidden,
            "transfer_exposed_s": transfer_s - hidden,
            "stall_s": self._stall_s,
            "plans_failed": c.plans_failed,
            "blocks_held_at_end": {
                "gpu": m.gpu_blocks - m.gpu_free_blocks,
                "cpu": m.cpu_pinned_blocks,
            },
            "tiers": st.tiers.describe(),
            **tier_io.results(m, self.tier_engines),
            # [time, GPU usage, CPU blocks held (swapped, loading, being written), CPU tier fill], fractions
            "usage": [[round(x, 6) for x in u] for u in usage[::stride]],
            "latency_samples": {"ttft_s": sorted(ttft), "e2e_s": sorted(e2e)},
        }
