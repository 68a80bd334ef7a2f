"""The ``crossover`` subcommand: its flags, and the checks that run before any measurement.

Two forms, measured as :mod:`tiered_kv.bench.crossover` describes: ``crossover
--model PROFILE (--hardware PROFILE | --calibration PATH)``, the user's own
model; and ``crossover`` with the model flags, a small real model end to end.
Both repeat each point (``--repeats``) and report min/median/max, print a row
per length as it is measured and append it to ``--rows`` (JSON Lines), and
refuse, before allocating anything, a run whose tiers do not fit in memory.

Importing this module imports neither torch nor the engine, so ``tiered-kv
--help`` works on a base install; :func:`run` imports them once the
arguments are known to be good.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.flags import (
    add_calibration,
    add_json,
    add_no_progress,
    add_plots,
    add_repeats,
    fraction,
    here,
    need_extras,
    positive_int,
    positive_int_list,
    power_of_two,
    refuse_over_half_memory,
    write_json,
)
from tiered_kv.cli.outputs import add_output
from tiered_kv.storage.spec import LAYOUTS

NAME = "crossover"
SUMMARY = "measure swap vs recompute here (or for your model); write a calibration"
DESCRIPTION = (
    "Answer 'swap or recompute, and from which context length'.  With --model, for your model: the copy "
    "link is measured here with its KV shape, compute comes from --hardware (roofline) or --calibration "
    "(measured on the same model).  Without --model, a small real model is measured end to end (copies, "
    "prefills, engine steps).  Each point is repeated and reported as min/median/max; each row is saved "
    "as it is measured; a calibration file is written for `tiered-kv simulate --calibration`.  Needs torch."
)
DTYPES = ("float32", "float16", "bfloat16")  # what the model computes in (the KV can hold more)
# The built-in small model's shape; None in the parser so that --model can tell a flag the user gave.
SMALL_MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``crossover``."""
    _add_output_flags(p)
    _add_model_flags(p)
    _add_measurement_flags(p)
    add_no_progress(p)


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the calibration, the measurements, the rows and the plot go."""
    add_output(
        p,
        "--calibration-out",
        default=Path("out/calibration.json"),
        metavar="PATH",
        help="where to write the calibration (default: %(default)s)",
    )
    add_json(p, "also write every measurement (JSON) to this file")
    add_output(
        p,
        "--rows",
        resolve=_rows_path,
        metavar="PATH",
        help="append each measured row to this JSON Lines file as it is measured "
        "(default: beside --calibration-out, NAME-rows.jsonl)",
    )
    add_plots(p, "write crossover.png into this directory")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What a measurement reads: profile files given by path, and the calibration."""
    from tiered_kv.sim.profiles import is_path_ref

    out = [Path(r) for r in (args.model, args.hardware) if r is not None and is_path_ref(r)]
    return [*out, *([args.calibration] if args.calibration is not None else [])]


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The two forms' groups: the user's model (``--model``) and the built-in small model's shape."""
    u = p.add_argument_group("your model (--model)")
    u.add_argument(
        "--model",
        metavar="PROFILE",
        help="a model profile: a shipped name (llama3-8b) or a YAML file (configs/models/X.yaml)",
    )
    u.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="a hardware profile (h200, or a YAML file) whose roofline prices recompute",
    )
    add_calibration(u, "price recompute by this calibration instead (it must be measured on the same model)")
    u.add_argument(
        "--mfu", type=fraction, default=0.5, metavar="X", help="roofline model-FLOPs utilisation (default: 0.5)"
    )
    u.add_argument(
        "--lengths",
        type=positive_int_list,
        metavar="N,N,...",
        help="context lengths in tokens (default: 512,1024,...,32768 with --model; 256,... up to what fits without)",
    )
    m = p.add_argument_group("the built-in small model (without --model)")
    m.add_argument("--layers", type=positive_int, metavar="N", help="decoder layers (default: 4)")
    m.add_argument("--hidden", type=positive_int, metavar="N", help="hidden size (default: 256)")
    m.add_argument("--heads", type=positive_int, metavar="N", help="attention heads (default: 8)")
    m.add_argument(
        "--kv-heads", type=positive_int, metavar="N", help="KV heads; --heads must be a multiple of it (default: 2)"
    )
    m.add_argument("--head-dim", type=positive_int, metavar="N", help="head dimension (default: 32)")
    m.add_argument("--dtype", choices=DTYPES, help="weights and KV dtype (default: float32)")


def _add_measurement_flags(p: argparse.ArgumentParser) -> None:
    """The KV cache's geometry and how long and how often each point is measured."""
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
        help="longest context to measure (default: 32768 with --model; what fits in 512 MiB of attention "
        "scores without)",
    )
    add_repeats(k, 3, "timed runs per point, after one untimed; min/median/max reported (default: %(default)s)")


def _rows_path(args: argparse.Namespace) -> Path:
    if args.rows is not None:
        return args.rows
    out: Path = args.calibration_out
    return out.with_name(f"{out.stem}-rows.jsonl")


def run(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError

    given = [f for f in SMALL_MODEL if getattr(args, f) is not None]
    if args.model is not None:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag}: the model comes from --model {args.model}; drop {flag}")
        return _run_profile(args)
    for flag in ("hardware", "calibration", "lengths"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag}: applies to --model only (the small model is measured end to end)")
    for f, v in SMALL_MODEL.items():
        if getattr(args, f) is None:
            setattr(args, f, v)
    return _run_small(args)


def _lengths(args: argparse.Namespace, default: Sequence[int]) -> list[int]:
    from tiered_kv.errors import ConfigError

    lengths = sorted(set(args.lengths)) if args.lengths is not None else list(default)
    if args.max_tokens is not None:
        lengths = [n for n in lengths if n <= args.max_tokens]
    if not lengths:
        raise ConfigError(f"--max-tokens {args.max_tokens}: no length left to measure (shortest: {min(default)})")
    short = [n for n in lengths if n < args.block_size]
    if short:
        raise ConfigError(f"--lengths: {short[0]} tokens is less than one block of {args.block_size}")
    return lengths


def _run_profile(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim.extras import import_extra

    if args.hardware is None and args.calibration is None:
        raise ConfigError(
            "--model: recompute needs a compute source: --hardware PROFILE (roofline) or --calibration PATH "
            "(measured on the same model)"
        )
    import_extra("yaml", "reading model profiles")
    from tiered_kv.sim.calibration import load_calibration
    from tiered_kv.sim.profiles import load_hardware, load_model

    model = load_model(args.model, "--model")
    hardware = load_hardware(args.hardware, "--hardware") if args.hardware is not None else None
    cal = load_calibration(args.calibration) if args.calibration is not None else None
    need_extras((args.plots, "matplotlib", "--plots"))  # the path itself was claimed before the command ran
    torch = import_extra("torch", "this command")
    from tiered_kv.bench.crossover import (
        PROFILE_LENGTHS,
        compute_from_calibration,
        compute_from_roofline,
        model_spec,
        profile_crossover,
    )
    from tiered_kv.bench.swap_timer import check_tiers_fit
    from tiered_kv.bench.timing import RowFile
    from tiered_kv.sim.progress import Phases

    lengths = _lengths(args, PROFILE_LENGTHS)
    compute = (
        compute_from_calibration(model, cal, str(args.calibration))
        if cal is not None
        else compute_from_roofline(model, hardware, args.mfu)  # type: ignore[arg-type]
    )
    device = here(torch)
    check_tiers_fit(model_spec(model, args.block_size), max(lengths), device, f"crossover for {model.name}")
    with RowFile(_rows_path(args)) as rows, Phases("crossover", enabled=not args.no_progress) as phases:
        doc, calibration = profile_crossover(
            model,
            compute,
            args.block_size,
            args.layout,
            lengths,
            args.repeats,
            device,
            rows,
            emit=phases.wrap(print),
            progress=phases,
            hardware=hardware,
        )
    _write(args, doc, calibration)
    return 0


def _write(args: argparse.Namespace, doc: dict[str, Any], calibration: Any) -> None:
    calibration.save(args.calibration_out)
    print(f"wrote calibration {args.calibration_out}")
    print(f"wrote rows {_rows_path(args)}")
    write_json(args.json, doc)
    if args.plots is not None:
        from tiered_kv.bench.crossover import plot

        print(f"wrote {plot(doc, args.plots)}")


def _run_small(args: argparse.Namespace) -> int:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim.extras import import_extra
    from tiered_kv.sim.progress import Phases

    if args.heads % args.kv_heads:
        raise ConfigError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.max_tokens is not None and args.max_tokens < 256:
        raise ConfigError(f"--max-tokens: the shortest context measured is 256 tokens, got {args.max_tokens}")
    need_extras((args.plots, "matplotlib", "--plots"))  # the path itself was claimed before the command ran
    torch = import_extra("torch", "this command")
    from tiered_kv.bench.crossover import crossover, default_lengths
    from tiered_kv.bench.swap_timer import check_tiers_fit
    from tiered_kv.bench.timing import RowFile
    from tiered_kv.engine.model import ModelConfig
    from tiered_kv.storage.spec import DTYPE_BYTES

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
    refuse_over_half_memory(weights, "--hidden/--layers: the model's weights alone take", "measure a smaller model")
    lengths = default_lengths(config, args.max_tokens)
    device = here(torch)
    # Two contexts' worth of GPU blocks (swap-in lands in other blocks) next to the weights and one
    # prefill's attention scores (heads x L^2 floats).
    scores = 4 * config.num_heads * max(lengths) ** 2
    check_tiers_fit(config.kv_spec(args.block_size), 2 * max(lengths), device, "crossover", weights + scores)
    with RowFile(_rows_path(args)) as rows, Phases("crossover", enabled=not args.no_progress) as phases:
        doc, cal = crossover(
            config,
            args.block_size,
            args.layout,
            lengths,
            None,
            args.repeats,
            emit=phases.wrap(print),
            progress=phases,
            rows=rows,
        )
    _write(args, doc, cal)
    return 0
