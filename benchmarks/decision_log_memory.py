"""Memory of a long run's preemption log: the bounded log (the default) against keeping every entry.

A run of N requests through one TierManager: each request is admitted, its
prompt computed, and it is preempted once (recompute, one decision-log entry
each) before it finishes, so the log gets one entry per request as in an
oversubscribed serving run.  Prints, at a few points of the run, the Python
heap the manager holds (tracemalloc, after a full collection) with the default
``log_size`` and with ``log_size=None`` (the unbounded log it replaces), and
their ratio.

    .venv/bin/python benchmarks/decision_log_memory.py [--requests 200000]
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.manager.bounded_log import DEFAULT_LOG_SIZE
from tiered_kv.transfer import ControlledCopyEngine

BLOCK = 16
PROMPT = 48  # three blocks a request


def run(num_requests: int, log_size: int | None, checkpoints: list[int]) -> tuple[list[tuple[int, int, int]], float]:
    """(requests done, heap bytes, log entries kept) at each checkpoint, and the run's seconds."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    eng = ControlledCopyEngine({"GPU": 64, "CPU": 2})
    tm = TierManager(
        ManagerConfig(64, 0, BLOCK, log_size=log_size),
        eng,
        cost_model=CostModel(kv_bytes_per_token=1024, block_size=BLOCK),
    )
    out = []
    t0 = time.perf_counter()
    for i in range(num_requests):
        rid = f"r{i}"
        req = Request(rid, [(i * 131 + k) % 50_000 for k in range(PROMPT)], max_tokens=4)
        tm.admit(req, PROMPT)
        req.num_computed_tokens = PROMPT
        tm.preempt(rid, "recompute")  # one decision each; the request is forgotten by the manager
        tm.poll()  # once per step, as a scheduler does (drains the pool's events)
        if i + 1 in checkpoints:
            elapsed = time.perf_counter() - t0
            gc.collect()
            out.append((i + 1, tracemalloc.get_traced_memory()[0] - base, len(tm.decision_log)))
            t0 = time.perf_counter() - elapsed
    seconds = time.perf_counter() - t0
    assert tm.decision_log.total == num_requests
    tracemalloc.stop()
    return out, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200_000)
    args = ap.parse_args()
    n = args.requests
    points = sorted({n // 8, n // 4, n // 2, n})
    bounded, t_b = run(n, DEFAULT_LOG_SIZE, points)
    full, t_f = run(n, None, points)
    print(f"decision-log memory over a run of {n:,} requests (one preemption each); heap held, tracemalloc")
    bounded_name = f"log_size={DEFAULT_LOG_SIZE}"
    print(f"{'requests':>10} | {bounded_name:>18} | {'kept':>7} | {'log_size=None':>14} | {'kept':>7} | ratio")
    for (k, mb, lb), (_, mf, lf) in zip(bounded, full, strict=True):
        print(f"{k:>10,} | {mb / 2**20:>15.1f} MiB | {lb:>7,} | {mf / 2**20:>11.1f} MiB | {lf:>7,} | {mf / mb:5.1f}x")
    print(f"run time: bounded {t_b:.1f} s, unbounded {t_f:.1f} s (tracing on)")


if __name__ == "__main__":
    main()
