"""The ``tiered-kv`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-kv", description="Multi-tier KV-cache memory manager for LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through the prefix-cached block pool step by step")
    demo.add_argument("--hash", default="sha256", choices=["sha256", "fast"], help="block hash function")
    sub.add_parser("bench-transfer", help="measure copy-engine bandwidth against one contiguous copy", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench-transfer"]:
        from tiered_kv.tools.bench_transfer import main as bench_transfer

        return bench_transfer(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from tiered_kv.demo import run_walkthrough

        run_walkthrough(hash_fn=args.hash)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
