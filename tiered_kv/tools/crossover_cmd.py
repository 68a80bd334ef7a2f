"""The ``crossover`` subcommand: its flags, and the checks that run before any measurement.

Importing this module imports neither torch nor the engine, so ``tiered-kv
--help`` works on a base install; :func:`run` imports them once the
arguments are known to be good.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.sim.argtypes import positive_int, power_of_two
from tiered_kv.storage.spec import LAYOUTS

NAME = "crossover"
SUMMARY = "measure swap vs recompute here; write a calibration"
DTYPES = ("float32", "float16", "bfloat16")  # what the model computes in (the KV can hold more)


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``crossover`` to the ``tiered-kv`` parser."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description=(
            "For context lengths up to what fits, time swap-out, swap-in, swap beside compute and recompute "
            "with a small real model and the real copy engine; fit the cost model and the engine's step time "
            "and write them as a calibration file.  Needs torch."
        ),
    )
    p.add_argument(
        "--calibration-out",
        type=Path,
        default=Path("out/calibration.json"),
        metavar="PATH",
        help="where to write the calibration (default: %(default)s)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every measurement (JSON) to this file")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write crossover.png into this directory")
    m = p.add_argument_group("the model measured")
    m.add_argument("--layers", type=positive_int, default=4, metavar="N", help="decoder layers (default: %(default)s)")
    m.add_argument("--hidden", type=positive_int, default=256, metavar="N", help="hidden size (default: %(default)s)")
    m.add_argument("--heads", type=positive_int, default=8, metavar="N", help="attention heads (default: %(default)s)")
    m.add_argument(
        "--kv-heads",
        type=positive_int,
        default=2,
        metavar="N",
        help="KV heads; --heads must be a multiple of it (default: %(default)s)",
    )
    m.add_argument(
        "--head-dim", type=positive_int, default=32, metavar="N", help="head dimension (default: %(default)s)"
    )
    m.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV dtype (default: %(default)s)")
    k = p.add_argument_group("the KV cache and the measurement")
    k.add_argument(
        "--block-size", type=power_of_two, default=16, metavar="N", help="tokens per KV block (default: %(default)s)"
    )
    k.add_argument("--layout", default="block_contiguous", choices=LAYOUTS, help="KV layout (default: %(default)s)")
    k.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="longest context to measure (default: what fits in 512 MiB of attention scores)",
    )
    k.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N", help="best of N per measurement (default: %(default)s)"
    )
    p.add_argument("--no-progress", action="store_true", help="print no progress bar or progress lines")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError, ResourceLimitError
    from tiered_kv.sim.budget import Machine, human_bytes
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.files import check_output_dir, check_output_file, write_text
    from tiered_kv.sim.progress import Phases

    if args.heads % args.kv_heads:
        raise ConfigError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.max_tokens is not None and args.max_tokens < 256:
        raise ConfigError(f"--max-tokens: the shortest context measured is 256 tokens, got {args.max_tokens}")
    check_output_file(args.calibration_out, "--calibration-out")
    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.plots is not None:
        import_extra("matplotlib", "--plots")
        check_output_dir(args.plots, "--plots")
    import_extra("torch", "this command")
    from tiered_kv.engine.model import ModelConfig
    from tiered_kv.storage.spec import DTYPE_BYTES
    from tiered_kv.tools.crossover import crossover, plot

    config = ModelConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=2 * args.hidden,
        dtype=args.dtype,
    )
    weights = config.num_params * DTYPE_BYTES[args.dtype]
    machine = Machine.this()
    if machine.memory_bytes is not None and weights > machine.memory_bytes // 2:
        raise ResourceLimitError(
            f"--hidden/--layers: the model's weights alone take {human_bytes(weights)}, more than half of this "
            f"machine's {human_bytes(machine.memory_bytes)}; measure a smaller model"
        )
    with Phases("crossover", enabled=not args.no_progress) as phases:
        doc, cal = crossover(
            config,
            args.block_size,
            args.layout,
            None,
            args.max_tokens,
            args.repeats,
            emit=phases.wrap(print),
            progress=phases,
        )
    cal.save(args.calibration_out)
    print(f"wrote calibration {args.calibration_out}")
    if args.json is not None:
        write_text(args.json, json.dumps(doc, indent=1), "--json")
        print(f"wrote {args.json}")
    if args.plots is not None:
        print(f"wrote {plot(doc, args.plots)}")
    return 0
