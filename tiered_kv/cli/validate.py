"""The ``validate`` subcommand: predicted against published, for every config in ``configs/validation/``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.cli.flags import add_json, add_no_progress

NAME = "validate"
SUMMARY = "compare the simulator's predictions with published measurements"
DESCRIPTION = (
    "Simulate published setups (configs/validation/: same model, GPU, lengths and concurrency) and "
    "print predicted against published, with the ratio and the source of each point.  A point "
    "outside its tolerance is listed as such, with the reason where one is known.  Needs the sim extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``validate``."""
    p.add_argument(
        "configs",
        nargs="*",
        metavar="CONFIG",
        help="validation configs to run: names of shipped ones (such as vllm-paper-fig19) or YAML paths "
        "(default: every shipped one)",
    )
    add_json(p, "write the points (JSON) to this file")
    add_no_progress(p, "progress lines")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What validation reads: each validation config and the profiles and traces it names."""
    from tiered_kv.sim.config import referenced_files
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import read_yaml
    from tiered_kv.sim.shipped import shipped, shipped_names

    import_extra("yaml", "this command")
    out: list[Path] = []
    for ref in args.configs or shipped_names("validation"):
        p = Path(ref)
        found = p if p.suffix in (".yaml", ".yml") and p.is_file() else shipped("validation", ref)
        if isinstance(found, Path):
            out.append(found)
            out.extend(referenced_files(read_yaml(found, "validation"), found.resolve().parent))
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
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
