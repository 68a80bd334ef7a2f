"""The ``sweep`` subcommand: its flags, and the checks that run before any cell."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.cli.flags import add_json, add_no_progress, add_plots, add_workers, config_inputs, need_extras

NAME = "sweep"
SUMMARY = "cross a config's runs with GPU KV sizes and arrival rates"
DESCRIPTION = (
    "Run every (arrival rate, GPU KV size, run) cell of a config's `sweep:` section and print "
    "throughput per cell.  The results are the same, byte for byte, however the cells are run.  "
    "Needs the sim extra; --ray needs the ray extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``sweep``."""
    p.add_argument("config", help="a YAML config file with a `sweep:` section, or the name of a shipped config")
    add_json(p, "write the results document (JSON) to this file")
    add_plots(p, "write sweep.png into this directory")
    where = p.add_mutually_exclusive_group()
    add_workers(where, "run cells in N processes on this machine (default: 1, in this process)")
    where.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run cells as Ray tasks on the cluster at ADDRESS (host:port, 'auto', or 'local' for a new "
        "local instance); the workers need tiered-kv installed",
    )
    add_no_progress(p)


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a sweep reads: the config, its profiles and trace."""
    return config_inputs(args.config)


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    need_extras((args.ray, "ray", "--ray"), (args.plots, "matplotlib", "--plots"))
    from tiered_kv.sim.sweep import sweep

    sweep(
        args.config,
        args.json,
        args.plots,
        progress=not args.no_progress,
        workers=args.workers,
        ray_address=args.ray,
    )
    return 0
