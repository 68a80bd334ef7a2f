"""The ``simulate`` subcommand: its flags, and the checks that run before any simulation."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.sim.argtypes import positive_int

NAME = "simulate"
SUMMARY = "simulate every run of a config on one workload"


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``simulate`` to the ``tiered-kv`` parser (imports nothing heavy: ``--help`` works on a base install)."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description=(
            "Simulate every entry of a config's `runs:` on one workload with the real tier manager "
            "and scheduler, then print a comparison table.  Needs the sim extra."
        ),
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a YAML config file, or the name of a shipped config such as fidelity-tiny "
        "(default: oversubscribed-llama3-8b-h200, the main experiment)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results document (JSON) to this file")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots into this directory")
    p.add_argument(
        "--calibration",
        type=Path,
        metavar="PATH",
        help="simulate with the cost model measured by `tiered-kv crossover` (a calibration JSON file)",
    )
    p.add_argument(
        "--metrics",
        type=Path,
        metavar="PATH",
        help="write every run's metrics as a Prometheus text exposition (label run=NAME) to this file; "
        "needs the metrics extra",
    )
    p.add_argument(
        "--requests",
        type=Path,
        metavar="PATH",
        help="write one JSONL row per request and run (arrival, first token, finish, preemptions, swap bytes, "
        "recomputed tokens); rows join back to a replayed trace by id",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="PATH",
        help="write a Chrome/Perfetto trace: compute steps and each copy on its own track, both directions",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="simulate the runs in N processes on this machine (default: 1; the results are the same)",
    )
    p.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import check_output_dir, check_output_file

    import_extra("yaml", "this command")
    if args.metrics is not None:
        import_extra("prometheus_client", "--metrics")
    for flag, path in (
        ("--json", args.json),
        ("--requests", args.requests),
        ("--trace", args.trace),
        ("--metrics", args.metrics),
    ):
        if path is not None:
            check_output_file(path, flag)
    if args.plots is not None:
        import_extra("matplotlib", "--plots")
        check_output_dir(args.plots, "--plots")
    from tiered_kv.sim.runner import simulate

    simulate(
        args.config,
        args.json,
        args.plots,
        progress=not args.no_progress,
        calibration=args.calibration,
        requests_path=args.requests,
        metrics_path=args.metrics,
        trace_path=args.trace,
        workers=args.workers,
    )
    return 0
