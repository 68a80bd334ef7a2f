"""The ``trace`` subcommand: ``inspect``, ``convert`` and ``sample`` a trace in any supported format."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.flags import positive_float, positive_int, time_window
from tiered_kv.cli.outputs import add_output, set_inputs

NAME = "trace"
SUMMARY = "inspect, convert or sample a trace (jsonl, mooncake, azure, burstgpt, sharegpt)"
DESCRIPTION = (
    "Read a trace in one of the public formats (see tiered_kv/sim/trace_formats.py): print what it "
    "offers, convert it to another format, or cut a sample of it.  Rows that cannot be replayed "
    "(0 output tokens, empty fields) are counted and reported; a malformed row stops with its line."
)
FORMATS = ("jsonl", "mooncake", "azure", "burstgpt", "sharegpt")  # trace_formats.FORMATS, without importing it


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``trace`` and its three actions (imports nothing heavy)."""
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("path", type=Path, help="the trace file")
    common.add_argument("--format", default="jsonl", metavar="FMT", help=f"its format: {', '.join(FORMATS)}")
    common.add_argument(
        "--rate",
        type=positive_float,
        default=1.0,
        metavar="R",
        help="sharegpt only: conversations start R per second (default 1)",
    )
    ins = sub.add_parser(
        "inspect",
        parents=[*parents, common],
        help="count, rate, length percentiles, prefix reuse at several cache sizes",
    )
    add_output(ins, "--json", metavar="PATH", help="also write the numbers (JSON) to this file")
    ins.set_defaults(func=inspect)
    conv = sub.add_parser("convert", parents=[*parents, common], help="write the trace in another format")
    conv.add_argument("--to", required=True, metavar="FMT", help="jsonl, mooncake, azure or burstgpt")
    conv.set_defaults(func=convert)
    smp = sub.add_parser(
        "sample",
        parents=[*parents, common],
        help="keep a time window and/or every k-th conversation (whole conversations)",
    )
    smp.add_argument("--window", type=time_window, metavar="START:END", help="requests arriving in [START, END) s")
    smp.add_argument("--every", type=positive_int, default=1, metavar="K", help="every K-th conversation")
    smp.set_defaults(func=sample)
    for writer in (conv, smp):
        add_output(writer, "--output", aliases=("-o",), required=True, metavar="PATH", help="the file to write")
    for action_parser in (ins, conv, smp):
        set_inputs(action_parser, _inputs)  # the trace: an output that resolves to it is refused


def _inputs(args: argparse.Namespace) -> list[Path]:
    return [args.path]


def _read(args: argparse.Namespace) -> Any:
    from tiered_kv.sim import trace_formats

    return trace_formats.read(args.path, args.format, args.rate)


def _report_skipped(trace: Any) -> None:
    import sys

    if trace.skipped:
        print(f"tiered-kv trace: skipped {trace.skipped_text()}", file=sys.stderr)


def inspect(args: argparse.Namespace) -> int:
    from tiered_kv.sim import trace_stats

    trace = _read(args)
    doc = trace_stats.summary(trace.rows)
    doc["format"] = trace.format
    doc["skipped"] = {why: n for why, (n, _) in trace.skipped.items()}
    print(trace_stats.text(doc, str(args.path)))
    if trace.skipped:
        print(f"  skipped: {trace.skipped_text()}")
    if args.json is not None:
        from tiered_kv.sim.report import write_json

        write_json(args.json, doc)
        print(f"wrote {args.json}")
    return 0


def _write(args: argparse.Namespace, rows: list[Any], fmt: str) -> None:
    from tiered_kv.sim import trace_formats
    from tiered_kv.sim.files import write_text

    writer = trace_formats.WRITERS[fmt]  # convert checked --to before reading; sample writes a format it can
    write_text(args.output, writer(rows), "--output")
    print(f"wrote {len(rows)} requests to {args.output} ({fmt})")


def convert(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim import trace_formats

    if args.to not in trace_formats.WRITERS:
        raise ConfigError(f"--to: cannot write format {args.to!r}; one of {sorted(trace_formats.WRITERS)}")
    trace = _read(args)
    _report_skipped(trace)
    _write(args, trace.rows, args.to)
    return 0


def sample(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim import trace_formats

    trace = _read(args)
    _report_skipped(trace)
    rows = trace_formats.sample(trace.rows, args.window, args.every)
    if not rows:
        raise ConfigError(f"'{args.path}': the sample keeps none of its {len(trace.rows)} requests")
    fmt = args.format if args.format in trace_formats.WRITERS else "jsonl"
    _write(args, rows, fmt)
    return 0
