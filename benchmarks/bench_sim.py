"""Simulator speed: simulated seconds and requests per wall second on the default config.

Runs the default experiment's three runs at its own size and at 10,000 requests,
and prints a table.  Usage: python benchmarks/bench_sim.py [--requests 10000]
"""

from __future__ import annotations

import argparse
import sys
import time

from tiered_kv.sim.config import load_config, setup
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="*", default=[3000, 10000])
    args = ap.parse_args(argv)
    print(f"{'requests':>8} {'run':22} {'wall s':>7} {'sim s':>8} {'sim-s/wall-s':>12} {'req/wall-s':>10} {'steps':>7}")
    for n in args.requests:
        cfg = load_config(None, {"workload.num_requests": n})
        t0 = time.perf_counter()
        workload = generate(cfg["workload"], cfg["seed"])
        gen = time.perf_counter() - t0
        total = gen
        for i in range(len(cfg["runs"])):
            st = setup(cfg, i)
            t0 = time.perf_counter()
            res = Simulator(st, workload).run()
            wall = time.perf_counter() - t0
            total += wall
            print(
                f"{n:8d} {st.name:22} {wall:7.2f} {res['makespan_s']:8.1f} {res['makespan_s'] / wall:12.1f} "
                f"{n / wall:10.0f} {res['steps']:7d}"
            )
        print(f"{n:8d} {'(workload generation)':22} {gen:7.2f}   total {total:.1f} s for all runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
