"""The ``simulate`` subcommand: its flags, and the checks that run before any simulation."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.flags import (
    add_calibration,
    add_config,
    add_json,
    add_no_progress,
    add_plots,
    add_workers,
    config_inputs,
    need_extras,
)
from tiered_kv.cli.outputs import add_output

NAME = "simulate"
SUMMARY = "simulate every run of a config on one workload"
DESCRIPTION = (
    "Simulate every entry of a config's `runs:` on one workload with the real tier manager "
    "and scheduler, then print a comparison table.  No output may be an input of the run (the config, "
    "its profiles, the workload trace, the calibration), and every output is created before the first "
    "step.  Needs the sim extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``simulate`` (imports nothing heavy: ``--help`` works on a base install)."""
    add_config(
        p,
        "a YAML config file, or the name of a shipped config such as fidelity-tiny "
        "(default: oversubscribed-llama3-8b-h200, the synthetic experiment; the main job is mooncake-llama3-8b-h200)",
    )
    add_json(p, "write the results document (JSON) to this file")
    add_plots(p, "write PNG plots into this directory")
    add_calibration(p, "simulate with the cost model measured by `tiered-kv crossover` (a calibration JSON file)")
    add_output(
        p,
        "--metrics",
        metavar="PATH",
        help="write every run's metrics as a Prometheus text exposition (label run=NAME) to this file; "
        "needs the metrics extra",
    )
    add_output(
        p,
        "--requests",
        metavar="PATH",
        help="write one JSONL row per request and run (arrival, first token, finish, preemptions, swap bytes, "
        "recomputed tokens); rows join back to a replayed trace by id",
    )
    add_output(
        p,
        "--timeline",
        metavar="PATH",
        help="write a timeline of the runs (Chrome/Perfetto JSON): compute steps and each copy on its own track, "
        "both directions",
    )
    p.add_argument("--trace", action=_Renamed, nargs="?", help=argparse.SUPPRESS)
    add_workers(p, "simulate the runs in N processes on this machine (default: 1; the results are the same)")
    add_no_progress(p)


class _Renamed(argparse.Action):
    """``--trace`` was the timeline's old name; a workload trace is an input, so the flag now says what it writes."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error("--trace is now --timeline (it writes a timeline of the run; the workload trace is an input)")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a run reads: the config, its profiles and trace, and the calibration."""
    return config_inputs(args.config, args.calibration)


def run(args: argparse.Namespace) -> int:
    """Simulate; the outputs were already checked against the inputs and created (``outputs.claim_outputs``)."""
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    need_extras(
        (args.metrics, "prometheus_client", "--metrics"),
        (args.plots, "matplotlib", "--plots"),
    )
    from tiered_kv.sim.runner import simulate

    simulate(
        args.config,
        args.json,
        args.plots,
        progress=not args.no_progress,
        calibration=args.calibration,
        requests_path=args.requests,
        metrics_path=args.metrics,
        timeline_path=args.timeline,
        workers=args.workers,
    )
    return 0
