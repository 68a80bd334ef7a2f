"""The ``sweep`` subcommand: its flags, and the checks that run before any cell."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.flags import positive_int
from tiered_kv.cli.outputs import add_output, set_inputs

NAME = "sweep"
SUMMARY = "cross a config's runs with GPU KV sizes and arrival rates"


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``sweep`` to the ``tiered-kv`` parser."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description=(
            "Run every (arrival rate, GPU KV size, run) cell of a config's `sweep:` section and print "
            "throughput per cell.  The results are the same, byte for byte, however the cells are run.  "
            "Needs the sim extra; --ray needs the ray extra."
        ),
    )
    p.add_argument("config", help="a YAML config file with a `sweep:` section, or the name of a shipped config")
    add_output(p, "--json", metavar="PATH", help="write the results document (JSON) to this file")
    add_output(p, "--plots", "dir", metavar="DIR", help="write sweep.png into this directory")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        metavar="N",
        help="run cells in N processes on this machine (default: 1, in this process)",
    )
    where.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run cells as Ray tasks on the cluster at ADDRESS (host:port, 'auto', or 'local' for a new "
        "local instance); the workers need tiered-kv installed",
    )
    p.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    p.set_defaults(func=run)
    set_inputs(p, inputs)
    return p


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a sweep reads: the config, its profiles and trace."""
    from tiered_kv.sim.config import input_files
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    return input_files(args.config)


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    if args.ray is not None:
        import_extra("ray", "--ray")
    if args.plots is not None:
        import_extra("matplotlib", "--plots")
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
