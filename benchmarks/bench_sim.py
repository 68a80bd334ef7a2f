"""Simulator speed: simulated requests per wall-clock second on the default experiment.

Runs every regime and run of the default experiment (or ``--config``) and prints, per run,
the wall time, the simulated requests per wall second and how much of the wall time the
real Scheduler and TierManager took (``schedule`` + ``update``, timed around the calls):
that share is the anchor, the floor the simulator's own work sits on.  The last line is the
whole experiment: requests simulated over the wall time, serially and, with ``--workers``,
in worker processes.

``--digest`` instead records every run's whole event trace and prints its SHA-256: two
versions of the simulator that print the same digests made the same decisions, event for
event.  ``--plain`` runs the scheduler's plain path (every allocation asked of the manager, through
``tests/plain_path.py``'s manager that reports nothing quiet): its digests must equal the default's.

Usage: python benchmarks/bench_sim.py [--config NAME] [--requests N] [--workers 2] [--digest] [--plain]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tiered_kv.cli.simulate import regime_configs
from tiered_kv.manager import TierManager
from tiered_kv.sim.config import read_config, setup
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import SimRequest, generate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from plain_path import PlainPathTierManager


def _cells(config: str | None, requests: int | None) -> list[tuple[str, dict[str, Any], int]]:
    raw, stem = read_config(config)
    over = {"workload.num_requests": requests} if requests else None
    out = []
    for name, _rate, _expect, cfg in regime_configs(raw, stem, over, None):
        if requests:
            cfg["workload"]["num_requests"] = requests
        for i in range(len(cfg["runs"])):
            out.append((name or "-", cfg, i))
    return out


_WORKLOADS: dict[str, list[SimRequest]] = {}  # per regime: generated once, read by each of its runs


def run_one(cell: tuple[str, dict[str, Any], int], digest: bool = False, plain: bool = False) -> dict[str, Any]:
    regime, cfg, i = cell
    st = setup(cfg, i)
    workload = _WORKLOADS.get(regime)
    if workload is None:
        workload = _WORKLOADS[regime] = generate(cfg["workload"], cfg["seed"])
    sim = Simulator(st, workload, record_trace=digest, manager_class=PlainPathTierManager if plain else TierManager)
    sched = sim.scheduler
    spent = [0.0]
    schedule, update = sched.schedule, sched.update

    def timed_schedule():
        t = time.perf_counter()
        out = schedule()
        spent[0] += time.perf_counter() - t
        return out

    def timed_update(out, sampled):
        t = time.perf_counter()
        done = update(out, sampled)
        spent[0] += time.perf_counter() - t
        return done

    if not digest:
        try:
            sched.schedule, sched.update = timed_schedule, timed_update  # type: ignore[method-assign]
        except AttributeError:  # a mypyc-compiled Scheduler's methods cannot be replaced: no share then
            spent[0] = float("nan")
    t0, c0 = time.perf_counter(), time.process_time()
    res = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    row = {
        "regime": regime,
        "run": st.name,
        "requests": len(workload),
        "wall_s": wall,
        "cpu_s": cpu,
        "sched_s": spent[0],
        "steps": res["steps"],
        "sim_s": res["makespan_s"],
    }
    if digest:
        row["digest"] = hashlib.sha256(repr(sim.loop.trace).encode()).hexdigest()[:16]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a config name or path (default: the main experiment)")
    ap.add_argument("--requests", type=int, default=None, help="requests per regime (default: the config's)")
    ap.add_argument("--workers", type=int, default=1, help="also run the whole experiment in N processes")
    ap.add_argument("--digest", action="store_true", help="print each run's event-trace SHA-256 instead")
    ap.add_argument("--plain", action="store_true", help="the scheduler's plain path (no skipped allocations)")
    args = ap.parse_args(argv)
    cells = _cells(args.config, args.requests)
    if args.digest:
        for cell in cells:
            r = run_one(cell, digest=True, plain=args.plain)
            print(f"{r['regime']:16} {r['run']:22} {r['digest']}")
        return 0
    print(
        f"{'regime':16} {'run':22} {'requests':>8} {'wall s':>7} {'req/wall-s':>10} {'cpu s':>6} "
        f"{'req/cpu-s':>9} {'steps':>6} {'sched+mgr s':>11} {'share':>6}"
    )
    total_req = 0
    t_all, c_all = time.perf_counter(), time.process_time()
    sched_all = 0.0
    for cell in cells:
        r = run_one(cell, plain=args.plain)
        total_req += r["requests"]
        sched_all += r["sched_s"]
        print(
            f"{r['regime']:16} {r['run']:22} {r['requests']:8d} {r['wall_s']:7.2f} "
            f"{r['requests'] / r['wall_s']:10.0f} {r['cpu_s']:6.2f} {r['requests'] / r['cpu_s']:9.0f} "
            f"{r['steps']:6d} {r['sched_s']:11.2f} {r['sched_s'] / r['wall_s']:6.0%}"
        )
    serial, serial_cpu = time.perf_counter() - t_all, time.process_time() - c_all
    print(
        f"whole experiment, 1 process: {total_req} requests in {serial:.1f} s = {total_req / serial:.0f} "
        f"requests/wall-s ({total_req / serial_cpu:.0f} per CPU second); Scheduler+TierManager "
        f"{sched_all / serial:.0%} of it"
    )
    if args.workers > 1:
        t0 = time.perf_counter()
        with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
            list(pool.map(partial(run_one, plain=args.plain), cells))
        par = time.perf_counter() - t0
        print(
            f"whole experiment, {args.workers} processes: {total_req / par:.0f} requests/wall-s "
            f"({serial / par:.2f}x the 1-process run above)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
