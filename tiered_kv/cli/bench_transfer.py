"""The ``bench-transfer`` subcommand: its flags, and the checks that run before any buffer is allocated.

Importing this module imports no torch (``tiered-kv --help`` works on a base install).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from tiered_kv.cli.flags import (
    add_json,
    add_repeats,
    choice_list,
    positive_int,
    positive_int_list,
    refuse_over_half_memory,
)
from tiered_kv.storage.spec import LAYOUTS
from tiered_kv.transfer.factory import ENGINE_KINDS

NAME = "bench-transfer"
SUMMARY = "measure copy-engine bandwidth against one contiguous copy"
DESCRIPTION = (
    "For each layout, block size, id pattern and direction, time the copy engine and, in the same run, "
    "one contiguous copy of the same bytes between the same tiers.  Needs torch."
)
ENGINES = ENGINE_KINDS  # the copy engines make_copy_engine builds by name
# Each case allocates a GPU and a CPU tier of about 4x the bytes it moves.
TIER_BYTES_PER_CASE_BYTE = 8


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``bench-transfer``."""
    add_json(p, "write one JSON row per case to this file")
    p.add_argument(
        "--mib", type=positive_int, default=128, metavar="N", help="MiB moved per case and direction (default: 128)"
    )
    p.add_argument(
        "--block-tokens",
        type=positive_int_list,
        default=[16, 32, 64, 128],
        metavar="N,N,...",
        help="block sizes in tokens, comma-separated (default: 16,32,64,128)",
    )
    p.add_argument(
        "--layouts",
        type=choice_list(LAYOUTS),
        default=list(LAYOUTS),
        metavar="NAME,...",
        help=f"KV layouts, comma-separated, from {', '.join(LAYOUTS)} (default: all)",
    )
    p.add_argument(
        "--engines",
        type=choice_list(ENGINES),
        default=None,
        metavar="NAME,...",
        help="copy engines, comma-separated, from cpu, cuda, cupy; cuda and cupy need a GPU "
        "(default: what this machine has)",
    )
    add_repeats(p, 3, "best of N per measurement (default: 3)")


def run(args: argparse.Namespace) -> int:
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import write_text

    need = TIER_BYTES_PER_CASE_BYTE * (args.mib << 20)
    refuse_over_half_memory(need, f"--mib {args.mib}: the tiers for one case take about", "move fewer MiB per case")
    torch = import_extra("torch", "this command")
    from tiered_kv.bench.transfer import check_engines, run_cases
    from tiered_kv.storage.spec import LLAMA3_8B

    if args.engines is not None:
        check_engines(args.engines)  # before any buffer is allocated
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    print(
        f"device: {dev}; torch {torch.__version__}; KV shape {LLAMA3_8B.num_layers} layers x "
        f"{LLAMA3_8B.num_kv_heads} KV heads x {LLAMA3_8B.head_dim} {LLAMA3_8B.dtype}"
    )
    rows = run_cases(
        block_tokens=args.block_tokens,
        layouts=args.layouts,
        bytes_per_case=args.mib << 20,
        engines=args.engines,
        repeats=args.repeats,
    )
    if args.json is not None:
        write_text(args.json, "\n".join(json.dumps(r) for r in rows) + "\n", "--json")
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0
