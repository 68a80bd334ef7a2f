"""The ``tiered-kv`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-kv", description="Multi-tier KV-cache memory manager for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through the prefix-cached block pool step by step")
    demo.add_argument("--hash", default="sha256", choices=["sha256", "fast"], help="block hash function")
    sub.add_parser("bench-transfer", help="measure copy-engine bandwidth against one contiguous copy", add_help=False)
    sim = sub.add_parser("simulate", help="simulate a config's runs on one workload (default: the main experiment)")
    sim.add_argument(
        "config", nargs="?", default=None, help="YAML config (default: configs/oversubscribed-llama3-8b-h200.yaml)"
    )
    sim.add_argument("--json", type=Path, help="write the results document here")
    sim.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument("--calibration", type=Path, help="use a cost model measured by `tiered-kv crossover`")
    sub.add_parser("crossover", help="measure swap vs recompute on this hardware; write a calibration", add_help=False)
    sub.add_parser("fidelity", help="simulator prediction vs the real engine on one workload", add_help=False)
    sw = sub.add_parser("sweep", help="cross a config's runs with sweep.gpu_kv_gib and sweep.rate")
    sw.add_argument("config")
    sw.add_argument("--json", type=Path)
    sw.add_argument("--plots", type=Path)
    sw.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench-transfer"]:
        from tiered_kv.tools.bench_transfer import main as bench_transfer

        return bench_transfer(argv[1:])
    if argv[:1] == ["crossover"]:
        from tiered_kv.engine.crossover import main as crossover

        return crossover(argv[1:])
    if argv[:1] == ["fidelity"]:
        from tiered_kv.engine.fidelity import main as fidelity

        return fidelity(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from tiered_kv.demo import run_walkthrough

        run_walkthrough(hash_fn=args.hash)
        return 0
    from tiered_kv.errors import ConfigError

    try:
        if args.command == "simulate":
            from tiered_kv.sim.runner import simulate

            simulate(args.config, args.json, args.plots, progress=not args.no_progress, calibration=args.calibration)
            return 0
        if args.command == "sweep":
            from tiered_kv.sim.runner import sweep

            sweep(args.config, args.json, args.plots, progress=not args.no_progress)
            return 0
    except ConfigError as exc:
        print(f"tiered-kv: config error: {exc}", file=sys.stderr)
        return 2
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
