"""The simulator: the real TierManager and Scheduler, driven on a simulated clock.

Per step the scheduler picks a batch through the tier manager (the same calls
a real engine makes), the roofline compute model says how long the step takes,
and the simulated PCIe link moves blocks concurrently.  Results are a plain,
deterministic dict: identical seed and config give identical output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tiered_kv.core.request import Request
from tiered_kv.errors import TieredKVError
from tiered_kv.manager.tier_manager import TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig, SchedulerOutput
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.link import SimCopyEngine
from tiered_kv.sim.workload import SimRequest

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


class Simulator:
    """One run of one workload under one :class:`RunSetup`."""

    def __init__(
        self,
        setup: RunSetup,
        workload: list[SimRequest],
        record_trace: bool = False,
        progress: Callable[[int, int, float], None] | None = None,
        usage_points: int = 400,
    ) -> None:
        self.setup = setup
        self.workload = workload
        self.loop = EventLoop(record_trace)
        self.progress = progress
        self.usage_points = usage_points
        bpb = setup.block_size * setup.model.kv_bytes_per_token
        self.engine = SimCopyEngine(
            self.loop, bpb, setup.d2h_bytes_per_s, setup.h2d_bytes_per_s, setup.per_copy_overhead_s
        )
        tm = TierManager(
            setup.num_gpu_blocks,
            setup.num_cpu_blocks,
            setup.block_size,
            self.engine,
            cost_model=setup.cost_model,
            offload=setup.offload,
            hash_fn=setup.hash_fn,
        )
        self.records: dict[int, list[float]] = {}  # rid -> [arrival, first_token, finish, n_out]
        self.outputs = {r.rid: r.output for r in workload}
        self.scheduler = Scheduler(
            tm,
            SchedulerConfig(
                setup.max_num_batched_tokens,
                setup.max_num_seqs,
                setup.chunked_prefill,
                policy=setup.policy,
                mode=setup.mode,
            ),
        )

    def _finished(self, req: Request) -> None:
        rec = self.records[req.request_id]  # type: ignore[index]
        rec[2] = self.loop.now
        rec[3] = req.num_output_tokens
        self.loop.log("finish", req.request_id)

    def _sampled(self, out: SchedulerOutput) -> dict:
        """The workload's next output token of every request that samples one this step."""
        outputs = self.outputs
        return {
            r.request_id: outputs[r.request_id][r.num_output_tokens]  # type: ignore[index]
            for r, n in out.scheduled
            if r.num_computed_tokens + n == r.num_tokens
        }

    def run(self) -> dict[str, Any]:
        loop, sched = self.loop, self.scheduler
        for r in self.workload:
            loop.schedule(r.arrival, "arrival", r)
        total = len(self.workload)
        finished = 0
        busy: list[tuple[float, float]] = []
        usage: list[tuple[float, float, float, float]] = []
        steps = 0
        tokens_computed = 0
        recompute_s = 0.0
        last_report = time.perf_counter()
        while True:
            for t_event, kind, payload in loop.pop_due():
                if kind == "arrival":
                    r: SimRequest = payload
                    sched.add_request(Request(r.rid, r.prompt, max_tokens=len(r.output), arrival_time=r.arrival))
                    self.records[r.rid] = [r.arrival, -1.0, -1.0, 0]
                    loop.log("arrival", r.rid, t_event)
                else:
                    SimCopyEngine.finish(payload)
                    loop.log("transfer_done", payload.plan.plan_id, t_event)
            if finished == total:
                sched.settle()  # settle copies still in flight (stores to the CPU tier)
                nt = loop.peek_time()
                if nt is None:
                    break
                loop.now = max(loop.now, nt)
                continue
            out = sched.schedule()
            self._log_batch(out)
            if out.num_tokens:
                attn = 0.0
                kv = 0
                for req, n in out.scheduled:
                    c = req.num_computed_tokens
                    attn += (c + n) * (c + n) - c * c
                    kv += c + n
                dt = self.setup.compute.step_time(out.num_tokens, attn, kv, len(out.scheduled))
                if out.recomputed_tokens:
                    recompute_s += dt * out.recomputed_tokens / out.num_tokens
                start = loop.now
                loop.now = start + dt
                busy.append((start, loop.now))
                steps += 1
                tokens_computed += out.num_tokens
                for req, n in out.scheduled:
                    if req.num_computed_tokens + n == req.num_tokens:
                        rec = self.records[req.request_id]  # type: ignore[index]
                        if rec[1] < 0:
                            rec[1] = loop.now
                for req in sched.update(out, self._sampled(out)):
                    self._finished(req)
                finished = len(self.records) - sched.num_unfinished
                m = sched.metrics()
                usage.append(
                    (
                        loop.now,
                        m.gpu_usage,
                        m.cpu_usage,
                        # distinct prefixes cached on the CPU (held or free), as a fraction of the tier
                        m.cpu_cached_blocks / m.cpu_blocks if m.cpu_blocks else 0.0,
                    )
                )
            else:
                nt = loop.peek_time()
                if nt is None:
                    raise SimulationError(
                        f"run {self.setup.name!r}: no progress at t={loop.now:.3f}s with {sched.num_unfinished} "
                        f"requests unfinished ({len(sched.waiting)} waiting, {len(sched.running)} running, "
                        f"{len(sched.swapped)} swapped) and nothing left to wait for"
                    )
                loop.now = max(loop.now, nt)
            if self.progress is not None and time.perf_counter() - last_report > 0.5:
                self.progress(finished, total, loop.now)
                last_report = time.perf_counter()
        if self.progress is not None:
            self.progress(finished, total, loop.now)
        return self._results(busy, usage, steps, tokens_computed, recompute_s)

    def _log_batch(self, out: SchedulerOutput) -> None:
        if self.loop.trace is None:
            return
        for rid, mode in out.preempted:
            self.loop.log(f"preempt_{mode.value}", rid)
        for rid in out.resumed:
            self.loop.log("resume", rid)
        for rid in out.admitted:
            self.loop.log("admit", rid)
        if out.scheduled:
            self.loop.log("step", tuple((req.request_id, n) for req, n in out.scheduled))

    def _results(self, busy, usage, steps: int, tokens_computed: int, recompute_s: float) -> dict[str, Any]:
        recs = self.records
        makespan = max((r[2] for r in recs.values()), default=0.0)
        ttft = [r[1] - r[0] for r in recs.values()]
        e2e = [r[2] - r[0] for r in recs.values()]
        tpot = [(r[2] - r[1]) / (r[3] - 1) for r in recs.values() if r[3] > 1]
        n_out = sum(int(r[3]) for r in recs.values())
        requested = sum(len(o) for o in self.outputs.values())
        m = self.scheduler.metrics()
        c = m.counters
        intervals = self.engine.intervals
        transfer_s = sum(e - s for s, e, _, _ in intervals)
        hidden = overlap_seconds([(s, e) for s, e, _, _ in intervals], busy)
        stride = max(1, len(usage) // self.usage_points)
        st = self.setup
        return {
            "run": st.name,
            "policy": st.policy,
            "mode": st.mode,
            "offload": st.offload,
            "gpu_blocks": st.num_gpu_blocks,
            "cpu_blocks": st.num_cpu_blocks,
            "gpu_kv_gib": st.gpu_kv_gib,
            "cpu_kv_gib": st.cpu_kv_gib,
            "requests": len(recs),
            "requests_finished": sum(1 for r in recs.values() if r[2] >= 0),
            "output_tokens": n_out,
            "requested_output_tokens": requested,
            "makespan_s": makespan,
            "steps": steps,
            "tokens_computed": tokens_computed,
            "throughput_rps": len(recs) / makespan if makespan else 0.0,
            "throughput_output_tps": n_out / makespan if makespan else 0.0,
            "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot),
            "e2e_s": percentiles(e2e),
            "preemptions_swap": c.preemptions_swap,
            "preemptions_recompute": c.preemptions_recompute,
            "gb_swapped_out": c.swap_out_bytes / GB,
            "gb_swapped_in": c.swap_in_bytes / GB,
            "gb_offloaded": c.offload_bytes / GB,
            "gb_onboarded": c.onboard_bytes / GB,
            "tokens_recomputed": self.scheduler.tokens_recomputed,
            "recompute_s": recompute_s,
            "gpu_prefix_hit_rate": m.gpu_hit_rate,
            "cpu_prefix_hit_rate": m.cpu_hit_rate,
            "transfer_s": transfer_s,
            "transfer_hidden_s": hidden,
            "transfer_exposed_s": transfer_s - hidden,
            "plans_failed": c.plans_failed,
            "blocks_held_at_end": {
                "gpu": m.gpu_blocks - m.gpu_free_blocks,
                "cpu": m.cpu_pinned_blocks,
            },
            # [time, GPU usage, CPU usage (held), CPU prefix-cache fill]
            "usage": [[round(x, 6) for x in u] for u in usage[::stride]],
            "latency_samples": {"ttft_s": sorted(ttft), "e2e_s": sorted(e2e)},
        }
