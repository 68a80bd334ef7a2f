"""The ``simulate`` subcommand: its flags, and the checks that run before any simulation."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    p.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import check_output_dir, check_output_file

    import_extra("yaml", "this command")
    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.metrics is not None:
        import_extra("prometheus_client", "--metrics")
        check_output_file(args.metrics, "--metrics")
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
        metrics_path=args.metrics,
    )
    return 0
