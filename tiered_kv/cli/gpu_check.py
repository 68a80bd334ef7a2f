"""The ``gpu-check`` subcommand: its flags, and the checks that run before anything is measured.

Importing this module imports no torch (``tiered-kv --help`` works on a base install).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tiered_kv.cli.flags import choice_list, seconds
from tiered_kv.cli.outputs import add_output

NAME = "gpu-check"
SUMMARY = "prove the CUDA half in minutes: gpu tests, bandwidth, overlap, crossover"
DESCRIPTION = (
    "Run, in order, each within its share of the time budget and saved as soon as measured: device facts; "
    "the tests marked gpu; copy bandwidth of every engine, layout, block size and id pattern against one "
    "contiguous copy and a per-block copy loop; compute beside swaps with host synchronisations counted "
    "(and a Perfetto trace); swap against recompute for a model of Llama-3-8B's shape with random weights. "
    "Writes OUT/gpu-check.json (valid after every step), gpu-check-trace.json, gpu-check.log, "
    "pytest-gpu.log, crossover.jsonl and calibration.json.  Needs a CUDA device; --cpu runs a small form "
    "of every part on any machine.  Exit status 0 when every part finished and every test passed."
)
PARTS = ("device", "tests", "bandwidth", "overlap", "crossover")  # tiered_kv.bench.gpu_check.PARTS


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``gpu-check``."""
    add_output(
        p,
        "--out",
        "dir",
        default=Path("out/gpu-check"),
        metavar="DIR",
        help="directory for the results (default: %(default)s)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="the CPU form: tiny shapes and the CPU copy engine, under a minute"
    )
    p.add_argument(
        "--budget-s",
        type=seconds,
        default=None,
        metavar="S",
        help="the whole command's time budget, shared out among the parts (default: 480 on a GPU, 60 with --cpu)",
    )
    p.add_argument(
        "--parts",
        type=choice_list(PARTS),
        default=list(PARTS),
        metavar="NAME,...",
        help=f"run only these parts, from {', '.join(PARTS)} (default: all, in that order)",
    )


def run(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim.extras import import_extra

    import_extra("torch", "this command")
    from tiered_kv.transfer.factory import cuda_missing

    why = cuda_missing()
    if not args.cpu and why is not None:
        raise ConfigError(f"needs a CUDA device, but {why}; run `tiered-kv gpu-check --cpu` for the CPU form")
    from tiered_kv.bench.gpu_check import CPU_FORM, GPU_FORM, GpuCheck, exit_status

    form = CPU_FORM if args.cpu else GPU_FORM
    if args.budget_s is not None:
        form = form.scaled(args.budget_s)
    check = GpuCheck(args.out, form, args.parts, ["tiered-kv", *sys.argv[1:]])
    check.report.arm(form.hard_stop_s)
    doc = check.run()
    return exit_status(doc)
