"""gpu-check's measuring region: issue copies and compute, then time host issue, device makespan and syncs.

On CUDA the region is timed by events on the compute stream; on a CPU, where
every torch op runs on the calling thread, by the host clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tiered_kv.tools.crossover_timing import spread, sync_device
from tiered_kv.tools.gpu_check_syncs import SyncCounter, SyncDebug, region_name

Issue = Callable[[Callable[[str], None]], list[Any]]
"""A region's body: called with ``mark``; returns the copy handles it submitted."""


class Round:
    """One issued region and what it took: host issue time, device makespan, compute time, copy times."""

    def __init__(self) -> None:
        self.host_issue_s = 0.0
        self.makespan_s = 0.0
        self.compute_s = 0.0
        self.copy_s = 0.0
        self.syncs_python = 0
        self.syncs_debug = 0


class Issuer:
    """Runs a region on CUDA (events on the compute stream) or on a CPU (the host clock), counting syncs.

    ``run(issue)`` calls ``issue(mark)`` inside the region; ``issue`` returns the
    copy handles it submitted and calls ``mark("compute_start")`` /
    ``mark("compute_end")`` around its compute.
    """

    def __init__(self, device: str, engine: Any, counter: SyncCounter) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.engine = engine
        self.counter = counter

    def run(self, name: str, issue: Issue) -> Round:
        r = Round()
        sync_device(self.device)  # boundary
        marks: dict[str, Any] = {}

        def mark(what: str) -> None:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks[what] = ev
            else:
                marks[what] = time.perf_counter()

        debug = SyncDebug()
        t0 = time.perf_counter()
        with self.counter, debug, torch.profiler.record_function(region_name(name)):
            mark("start")
            handles = issue(mark)
            if self.cuda:
                for h in handles:
                    self.engine.make_compute_wait(h)
            mark("end")
        r.host_issue_s = time.perf_counter() - t0
        r.syncs_python = self.counter.total
        r.syncs_debug = debug.total
        self.counter.counts.clear()
        # Outside the region: the measurement boundary.
        for h in handles:
            if not h.wait(600):
                raise RuntimeError(f"plan {h.plan.plan_id} failed: {h.error}")
        if self.cuda:
            marks["end"].synchronize()
            r.makespan_s = marks["start"].elapsed_time(marks["end"]) / 1e3
            if "compute_start" in marks:
                r.compute_s = marks["compute_start"].elapsed_time(marks["compute_end"]) / 1e3
        else:
            finish = max([marks["end"], *(h.submitted_at + h.elapsed_s for h in handles)])
            r.makespan_s = finish - marks["start"]
            if "compute_start" in marks:
                r.compute_s = marks["compute_end"] - marks["compute_start"]
        r.copy_s = max((h.elapsed_s for h in handles), default=0.0)
        return r


def summarize(rounds: list[Round]) -> dict[str, Any]:
    return {
        "makespan_s": spread([r.makespan_s for r in rounds]),
        "compute_s": spread([r.compute_s for r in rounds]),
        "copy_s": spread([r.copy_s for r in rounds]),
        "host_issue_s": spread([r.host_issue_s for r in rounds]),
        "syncs_python": sum(r.syncs_python for r in rounds),
        "syncs_debug_mode": sum(r.syncs_debug for r in rounds),
    }


def hidden_fraction(compute: float, copies: float, makespan: float) -> float:
    if copies <= 0:
        return 0.0
    return max(0.0, min(1.0, (compute + copies - makespan) / copies))
