"""The ``fidelity`` subcommand: its flags, and the checks that run before the engine starts.

Importing this module imports neither torch nor the engine (``tiered-kv
--help`` works on a base install).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.outputs import add_output, set_inputs

NAME = "fidelity"
SUMMARY = "compare the simulator's prediction with the real engine"


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``fidelity`` to the ``tiered-kv`` parser."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description=(
            "Simulate every run of a config with a calibrated cost model, serve the same workload on the real "
            "engine in real time, and report predicted against measured throughput, transfer and recompute "
            "time.  Needs torch and the sim extra, and a calibration from `tiered-kv crossover`."
        ),
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a YAML config file or the name of a shipped config (default: fidelity-tiny)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        default=Path("out/calibration.json"),
        metavar="PATH",
        help="the calibration written by `tiered-kv crossover` (default: %(default)s)",
    )
    add_output(p, "--json", metavar="PATH", help="write predicted and measured rows (JSON) to this file")
    p.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    p.set_defaults(func=run)
    set_inputs(p, inputs)
    return p


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a comparison reads: the calibration, the config and what it names."""
    from tiered_kv.sim.config import input_files
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    return [args.calibration, *input_files(args.config if args.config is not None else "fidelity-tiny")]


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import write_text
    from tiered_kv.sim.progress import Phases

    import_extra("yaml", "this command")
    load_calibration(args.calibration)  # a missing or broken calibration fails before torch is even imported
    import_extra("torch", "this command")
    from tiered_kv.bench.fidelity import fidelity

    with Phases("fidelity", "halves", enabled=not args.no_progress) as phases:
        doc = fidelity(args.calibration, args.config, emit=phases.wrap(print), progress=phases)
    if args.json is not None:
        write_text(args.json, json.dumps(doc, indent=1), "--json")
        print(f"wrote {args.json}")
    return 0
