"""The ``fidelity`` subcommand: its flags, and the checks that run before the engine starts.

Importing this module imports neither torch nor the engine (``tiered-kv
--help`` works on a base install).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.cli.flags import (
    add_calibration,
    add_config,
    add_json,
    add_no_progress,
    config_inputs,
    write_json,
)

NAME = "fidelity"
SUMMARY = "compare the simulator's prediction with the real engine"
DESCRIPTION = (
    "Simulate every run of a config with a calibrated cost model, serve the same workload on the real "
    "engine in real time, and report predicted against measured throughput, transfer and recompute "
    "time.  Needs torch and the sim extra, and a calibration from `tiered-kv crossover`."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``fidelity``."""
    add_config(p, "a YAML config file or the name of a shipped config (default: fidelity-tiny)")
    add_calibration(
        p, "the calibration written by `tiered-kv crossover` (default: %(default)s)", Path("out/calibration.json")
    )
    add_json(p, "write predicted and measured rows (JSON) to this file")
    add_no_progress(p)


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a comparison reads: the config and what it names, and the calibration."""
    return config_inputs(args.config if args.config is not None else "fidelity-tiny", args.calibration)


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.progress import Phases

    import_extra("yaml", "this command")
    load_calibration(args.calibration)  # a missing or broken calibration fails before torch is even imported
    import_extra("torch", "this command")
    from tiered_kv.bench.fidelity import fidelity

    with Phases("fidelity", "halves", enabled=not args.no_progress) as phases:
        doc = fidelity(args.calibration, args.config, emit=phases.wrap(print), progress=phases)
    write_json(args.json, doc)
    return 0
