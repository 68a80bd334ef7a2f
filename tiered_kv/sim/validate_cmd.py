"""The ``validate`` subcommand: predicted against published, for every config in ``configs/validation/``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAME = "validate"
SUMMARY = "compare the simulator's predictions with published measurements"


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``validate`` to the ``tiered-kv`` parser."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description=(
            "Simulate published setups (configs/validation/: same model, GPU, lengths and concurrency) and "
            "print predicted against published, with the ratio and the source of each point.  A point "
            "outside its tolerance is listed as such, with the reason where one is known.  Needs the sim extra."
        ),
    )
    p.add_argument(
        "configs",
        nargs="*",
        metavar="CONFIG",
        help="validation configs to run: names of shipped ones (such as vllm-paper-fig19) or YAML paths "
        "(default: every shipped one)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the points (JSON) to this file")
    p.add_argument("--no-progress", action="store_true", help="print no progress lines")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import sys

    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import check_output_file

    import_extra("yaml", "this command")
    if args.json is not None:
        check_output_file(args.json, "--json")
    from tiered_kv.sim.report import write_json
    from tiered_kv.sim.validate import rows, run_validation, table, validation_files

    files = validation_files(args.configs or None)

    def say(text: str) -> None:
        if not args.no_progress:
            print(f"validate: {text}", file=sys.stderr, flush=True)

    points = run_validation(files, progress=say)
    print(table(points))
    if args.json is not None:
        write_json(args.json, {"points": rows(points)})
        print(f"\nwrote {args.json}")
    return 0
