"""The ``calibrate`` subcommand: a hardware profile's step model, fitted to one's own measurements of vLLM."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.flags import add_no_progress, positive_float, positive_int
from tiered_kv.cli.outputs import add_output

NAME = "calibrate"
SUMMARY = "fit a GPU's step model to your own measurements of vLLM and write its hardware profile"
DESCRIPTION = (
    "Read measured serving runs of one GPU (the JSON of `vllm bench serve --save-result`, inference-perf "
    "results directories, the server's start-up log for its settings and KV block count, or a file of "
    "measured runs in the format of configs/validation/vllm-0.15.1-h100-runs.yaml), fit the step model's "
    "coefficients (front end, per step, per layer, per request, HBM efficiency) by simulating every run, "
    "print each run's residuals, and write the GPU's hardware profile with the fitted step model "
    "(--out) and a plot of predicted against measured (--plot).  Bad input (a file of another format, "
    "runs of two GPUs, too few runs to fit a coefficient) is one line and exit status 2, with nothing "
    "written.  docs/hardware.md says what each coefficient is.  Needs the sim extra."
)


def add_flags(p: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser]) -> None:
    """The flags of ``calibrate``."""
    p.add_argument("measurements", nargs="+", type=Path, metavar="PATH", help="measurement files or directories")
    p.add_argument(
        "--hardware",
        metavar="PROFILE",
        help="the GPU's profile to start from and complete (a shipped name or a YAML path; its datasheet "
        "numbers are kept); default: the profile the runs name",
    )
    p.add_argument("--model", metavar="NAME", help="the model of benchmark results (a Hugging Face id)")
    p.add_argument("--tp", type=positive_int, metavar="N", help="tensor parallelism of benchmark results")
    p.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N", help="vLLM's token budget")
    p.add_argument("--max-num-seqs", type=positive_int, metavar="N", help="vLLM's max_num_seqs")
    p.add_argument("--gpu-memory-utilization", type=positive_float, metavar="X", help="vLLM's setting (0.9)")
    p.add_argument("--engine", metavar="vllm-X.Y.Z", help="the vLLM version measured (default: the log's)")
    p.add_argument("--iters", type=positive_int, default=5, metavar="N", help="fit iterations (default 5)")
    p.add_argument(
        "--stage-scale",
        type=positive_float,
        default=0.25,
        metavar="X",
        help="simulate each stage this much shorter during the iterations (default 0.25; the last "
        "iteration, whose residuals are printed, runs them at full length)",
    )
    add_output(p, "--out", metavar="PATH", help="write the calibrated hardware profile (YAML) here")
    add_output(p, "--plot", metavar="PATH", help="write a plot of predicted against measured (PNG) here")
    add_no_progress(p, "progress lines")


def inputs(args: argparse.Namespace) -> list[Path]:
    """What calibration reads: the measurements (and their files) and a profile given by path."""
    out: list[Path] = []
    for p in args.measurements:
        out.extend(sorted(q for q in p.iterdir() if q.is_file()) if p.is_dir() else [p])
    if args.hardware and (args.hardware.endswith((".yaml", ".yml")) or "/" in args.hardware):
        out.append(Path(args.hardware))
    return out


def _profile_raw(ref: str) -> dict[str, Any]:
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim.files import read_yaml
    from tiered_kv.sim.profiles import is_path_ref
    from tiered_kv.sim.shipped import shipped

    found = Path(ref) if is_path_ref(ref) else shipped("hardware", ref)
    if found is None:
        raise ConfigError(f"--hardware: no hardware profile {ref!r}")
    raw = read_yaml(found, "--hardware")
    if not isinstance(raw, dict):
        raise ConfigError(f"--hardware: '{found}' is not a hardware profile (a mapping)")
    return raw


def run(args: argparse.Namespace) -> int:
    import statistics
    import sys

    from tiered_kv.sim.extras import import_extra

    yaml = import_extra("yaml", "this command")
    if args.plot is not None:
        import_extra("matplotlib", "--plot")
    from tiered_kv.errors import ConfigError
    from tiered_kv.sim.engine_version import DEFAULT_ENGINE, parse_engine
    from tiered_kv.sim.files import write_text
    from tiered_kv.sim.measured_runs import hardware_of
    from tiered_kv.sim.measurements import Settings, read_measurements
    from tiered_kv.sim.profiles import load_hardware, uncalibrated_step
    from tiered_kv.sim.run_fit import COEFFS, fit_runs

    flags = Settings(
        model=args.model,
        tp=args.tp,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        engine=args.engine,
        hw=args.hardware,
    )
    if args.engine is not None:
        parse_engine(args.engine, "--engine")
    runs, engine = read_measurements(list(args.measurements), flags)
    engine = args.engine or engine or DEFAULT_ENGINE
    era = parse_engine(engine).era
    gpus = set()
    for r in runs:
        try:
            gpus.add(hardware_of(r))
        except ConfigError:
            if args.hardware is None:
                raise ConfigError(
                    f"calibrate: run {r.id} names no GPU we have a profile of ({r.raw['hw']!r}); give --hardware"
                ) from None
    if len(gpus) > 1:
        raise ConfigError(
            f"calibrate: the runs are of {len(gpus)} GPUs ({', '.join(sorted(gpus))}); a step model is one GPU's: "
            "calibrate each GPU on its own runs"
        )
    ref = args.hardware or gpus.pop()
    hw = load_hardware(ref, "--hardware")
    start = hw.step_for(era)
    say = (lambda s: None) if args.no_progress else (lambda s: print(f"calibrate: {s}", file=sys.stderr, flush=True))
    if start is None:
        start = uncalibrated_step(era)
        print(f"calibrate: {hw.name} has no {era} step model; starting from the uncalibrated default")
    fit = fit_runs(runs, engine, start, iters=args.iters, stage_scale=args.stage_scale, emit=say, hardware=ref)
    residuals = fit.residuals()
    print(f"{hw.name}, {engine} ({era}): {len(runs)} runs, {len(residuals)} measured means")
    head = f"{'run':18} {'stage':7} {'metric':12} {'measured':>10} {'predicted':>10} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for eq, ratio in residuals:
        print(
            f"{eq.run[:18]:18} {eq.stage:7} {eq.metric:12} {eq.measured:10.2f} {eq.measured * ratio:10.2f} {ratio:6.2f}"
        )
    errs = [abs(r - 1) for _, r in residuals]
    within = sum(e <= 0.15 for e in errs)
    print(
        f"median abs error {statistics.median(errs) * 100:.1f}%, {within} of {len(errs)} within +-15%; "
        f"{fit.compute_bound_share * 100:.1f}% of the steps compute-bound (mfu and prefill_mfu kept)"
    )
    if fit.held:
        print(f"held at the starting value (the runs cannot tell them apart): {', '.join(fit.held)}")
    step = {
        "mfu": fit.fixed["mfu"],
        "prefill_mfu": fit.fixed["prefill_mfu"],
        **{k: float(f"{fit.coef[k]:.4g}") for k in COEFFS},
    }
    print(f"step_model.{era}: " + ", ".join(f"{k}: {v:.4g}" for k, v in step.items()))
    if args.out is not None:
        raw = _profile_raw(ref)
        raw["step_model"] = {**(raw.get("step_model") or {}), era: step}
        load_hardware(raw, "calibrated profile")  # what is written loads
        header = (
            f"# {hw.name}, calibrated by `tiered-kv calibrate` on {len(runs)} measured runs of {engine} "
            f"({', '.join(r.id for r in runs)}):\n"
            f"# step_model.{era} fitted (mfu and prefill_mfu kept); median abs error "
            f"{statistics.median(errs) * 100:.1f}%, {within} of {len(errs)} means within +-15%.\n"
        )
        write_text(args.out, header + yaml.safe_dump(raw, sort_keys=False), "--out")
        print(f"wrote {args.out}")
    if args.plot is not None:
        _plot(args.plot, residuals, f"{hw.name}, {engine}")
        print(f"wrote {args.plot}")
    return 0


def _plot(path: Path, residuals: list, title: str) -> None:
    """Predicted against measured, one marker per metric, with y = x and the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    markers = {"ttft_mean_ms": ("o", "TTFT"), "itl_mean_ms": ("s", "ITL"), "e2e_mean_ms": ("^", "E2E")}
    lo, hi = float("inf"), 0.0
    for metric, (marker, label) in markers.items():
        pts = [(eq.measured, eq.measured * r) for eq, r in residuals if eq.metric == metric]
        if pts:
            ax.scatter([m for m, _ in pts], [p for _, p in pts], marker=marker, label=label)
            lo = min(lo, *(min(m, p) for m, p in pts))
            hi = max(hi, *(max(m, p) for m, p in pts))
    xs = [lo * 0.8, hi * 1.25]
    ax.plot(xs, xs, color="black", linewidth=1, label="predicted = measured")
    ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="grey", alpha=0.2, label="±15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured mean (ms)")
    ax.set_ylabel("predicted mean (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
