"""Simulator speed against a baseline tree: the default experiment, interleaved, pure and compiled.

Each round runs the whole experiment (``tiered-kv simulate``'s entry point,
``tiered_kv.cli.simulate.simulate``, serially in one process) once per variant, in a fresh
process each, the variants interleaved so that all of them see the same load:

* ``baseline``: the tree given by ``--baseline`` (a checkout of the code to compare with);
* ``pure``: this tree, pure Python (the default for an editable install);
* ``compiled``: this tree built by mypyc (``scripts/build-compiled-core.sh``), when built.

It prints, per variant, simulated requests per wall second and per CPU second (best and
median over the rounds) and the ratio of each against the baseline's, from the same rounds.
Every run's results document (every field of every run but its wall time) is hashed: the
digests of all variants must be identical, or the script says so and exits 1.  The event
traces are compared by ``bench_sim.py --digest`` (run it in each tree).

Usage: python benchmarks/bench_speed.py --baseline PATH [--rounds 3] [--config NAME] [--requests N] [--extra NAME=PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: one whole experiment, timed around ``simulate`` (set-up included).
CHILD = r"""
import hashlib, json, sys, time
import tiered_kv, tiered_kv.core
try:
    from tiered_kv.cli.simulate import simulate
except ImportError:  # a tree from before the command was one module
    from tiered_kv.sim.runner import simulate
config, requests = sys.argv[1] or None, int(sys.argv[2])
over = {"workload.num_requests": requests} if requests else None
t0, c0 = time.perf_counter(), time.process_time()
doc = simulate(config, overrides=over, emit=lambda line: None, progress=False)
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
for run in doc["runs"]:
    run.pop("wall_s")
digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()[:16]
print(json.dumps({"requests": sum(r["requests"] for r in doc["runs"]), "wall_s": wall, "cpu_s": cpu,
                  "digest": digest, "compiled": tiered_kv.core.COMPILED, "where": tiered_kv.__file__}))
"""


def run_variant(path: Path, config: str | None, requests: int | None) -> dict[str, object]:
    """One experiment in a fresh interpreter with ``path`` first on ``sys.path``."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, config or "", str(requests or 0)],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"the run in {path} failed:\n{proc.stderr}")
    row: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    where = Path(str(row["where"])).resolve()
    if path.resolve() not in where.parents:
        raise SystemExit(f"the run meant for {path} imported tiered_kv from {where}")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every variant once)")
    ap.add_argument("--config", default=None, help="a config name (default: the main experiment)")
    ap.add_argument("--requests", type=int, default=None, help="requests per regime (default: the config's)")
    ap.add_argument("--compiled", type=Path, default=ROOT / "build" / "compiled", help="the mypyc build's tree")
    ap.add_argument("--no-compiled", action="store_true", help="leave the compiled build out")
    ap.add_argument(
        "--extra", action="append", default=[], metavar="NAME=PATH", help="another tree to run (repeatable)"
    )
    args = ap.parse_args(argv)
    variants = {"baseline": args.baseline, "pure": ROOT}
    if not args.no_compiled:
        if not (args.compiled / "tiered_kv").is_dir():
            raise SystemExit(f"no compiled build at {args.compiled}: run scripts/build-compiled-core.sh")
        variants["compiled"] = args.compiled
    for spec in args.extra:
        name, _, path = spec.partition("=")
        variants[name] = Path(path)
    rows: dict[str, list[dict[str, object]]] = {name: [] for name in variants}
    for k in range(args.rounds):
        for name, path in variants.items():
            row = run_variant(path, args.config, args.requests)
            rows[name].append(row)
            print(
                f"# round {k + 1}: {name:9} {row['requests']} requests in {row['wall_s']:.2f} wall s, "
                f"{row['cpu_s']:.2f} CPU s (compiled={row['compiled']}, digest {row['digest']})",
                flush=True,
            )
    if rows["pure"][0]["compiled"] or ("compiled" in rows and not rows["compiled"][0]["compiled"]):
        raise SystemExit("a variant did not run the build it was meant to (tiered_kv.core.COMPILED)")

    def rate(name: str, key: str) -> list[float]:
        return [float(r["requests"]) / float(r[key]) for r in rows[name]]  # type: ignore[arg-type]

    base_wall, base_cpu = rate("baseline", "wall_s"), rate("baseline", "cpu_s")
    print(
        f"\n{'variant':9} {'rounds':>6} {'req/wall-s best':>15} {'median':>7} {'x base best':>11} {'x median':>8} "
        f"{'req/cpu-s best':>14} {'median':>7} {'x base best':>11} {'x median':>8}"
    )
    for name in variants:
        wall, cpu = rate(name, "wall_s"), rate(name, "cpu_s")
        print(
            f"{name:9} {len(wall):6d} {max(wall):15.0f} {statistics.median(wall):7.0f} "
            f"{max(wall) / max(base_wall):10.2f}x {statistics.median(wall) / statistics.median(base_wall):7.2f}x "
            f"{max(cpu):14.0f} {statistics.median(cpu):7.0f} "
            f"{max(cpu) / max(base_cpu):10.2f}x {statistics.median(cpu) / statistics.median(base_cpu):7.2f}x"
        )
    digests = {str(r["digest"]) for name in variants for r in rows[name]}
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} on {os.cpu_count()} cores")
    if len(digests) != 1:
        for name in variants:
            print(f"DIGESTS DIFFER: {name}: {sorted({str(r['digest']) for r in rows[name]})}")
        return 1
    print(f"results digests identical across every variant and round: {digests.pop()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
