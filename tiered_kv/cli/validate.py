"""The ``validate`` subcommand: predicted against published and measured, for ``configs/validation/`` and ``--runs``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.cli.flags import add_json, add_no_progress

NAME = "validate"
SUMMARY = "compare the simulator's predictions with published measurements and measured runs"
DESCRIPTION = (
    "Simulate published setups (configs/validation/: same model, GPU, lengths and concurrency) and "
    "print predicted against published, with the ratio and the source of each point.  A point "
    "outside its tolerance is listed as such, with the reason where one is known.  Sets of measured "
    "runs (the shipped vllm-0.15.1-h100-runs, and any file given with --runs) are simulated run by run: "
    "per run, stage and metric (TTFT, ITL, E2E means) measured, predicted and their ratio, then the "
    "median absolute error and the count within +-15% per set.  Needs the sim extra."
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
    p.add_argument(
        "--runs",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="also simulate this file of measured runs (JSON or YAML, the format of "
        "configs/validation/vllm-0.15.1-h100-runs.yaml); may be given more than once",
    )
    p.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="simulate the --runs files on this hardware profile (a shipped name or a YAML path, such as "
        "one `tiered-kv calibrate --out` wrote) instead of the profile each run names",
    )
    p.add_argument(
        "--only-runs",
        action="store_true",
        help="skip the published points and the shipped run sets: only the --runs files",
    )
    add_json(p, "write the points and the measured runs' rows (JSON) to this file")
    add_no_progress(p, "progress lines")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What validation reads: each validation config and the profiles and traces it names."""
    from tiered_kv.sim.config import referenced_files
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import read_yaml
    from tiered_kv.sim.shipped import shipped, shipped_names

    import_extra("yaml", "this command")
    out: list[Path] = list(args.runs)
    if args.hardware and (args.hardware.endswith((".yaml", ".yml")) or "/" in args.hardware):
        out.append(Path(args.hardware))
    for ref in [] if args.only_runs else args.configs or shipped_names("validation"):
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
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim import validate_runs
    from tiered_kv.sim.measured_runs import load_run_set
    from tiered_kv.sim.report import write_json
    from tiered_kv.sim.validate import rows, run_sets, run_validation, table, validation_files

    # Read every input before simulating anything, so that a bad file fails at once.
    refs = None if args.only_runs else args.configs or None
    files = [] if args.only_runs else validation_files(refs)
    for p in args.runs:
        if not p.exists():
            raise ConfigError(f"--runs: file '{p}' does not exist")
    sets = ([] if args.only_runs else run_sets(refs)) + [load_run_set(p) for p in args.runs]

    def say(text: str) -> None:
        if not args.no_progress:
            print(f"validate: {text}", file=sys.stderr, flush=True)

    doc: dict = {}
    if files:
        points = run_validation(files, progress=say)
        print(table(points))
        doc["points"] = rows(points)
    doc["runs"] = []
    doc["run_summaries"] = {}
    external = {id(rs) for rs in sets[len(sets) - len(args.runs) :]}
    for rs in sets:
        hardware = args.hardware if id(rs) in external else None
        skipped: list[tuple[str, str]] = []
        uncalibrated: list[tuple[str, str]] = []
        run_rows = validate_runs.validate_set(
            rs, progress=say, hardware=hardware, skipped=skipped, uncalibrated=uncalibrated
        )
        print()
        print(validate_runs.table(rs, run_rows, skipped, uncalibrated))
        doc["runs"].extend(validate_runs.row_dicts(run_rows))
        doc["run_summaries"][rs.name] = validate_runs.summary_dicts(run_rows)
        doc.setdefault("runs_not_simulated", {})[rs.name] = [{"run": i, "reason": why} for i, why in skipped]
        doc.setdefault("runs_uncalibrated", {})[rs.name] = [{"run": i, "note": why} for i, why in uncalibrated]
    if args.json is not None:
        write_json(args.json, doc)
        print(f"\nwrote {args.json}")
    return 0
