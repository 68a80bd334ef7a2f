"""``tiered-kv crossover``: where does swapping beat recomputing, on this hardware?

For context lengths from 256 tokens up to what fits, with the real model and
the real copy engine, it measures:

* swap-out time (GPU tier -> CPU tier) and swap-in time (back, into other blocks);
* swap time with compute running beside it (a decode loop on another request);
* recompute time (a prefill of the whole context).

Each point runs once untimed, then ``repeats`` times; a row carries the
median and the spread (min/median/max) and is handed to a row file as soon as
it is measured.  It prints a table with the winner per length and the
crossover point, plots it, and writes a calibration file: the manager's cost
model (bandwidth per direction, per-copy overhead, prefill curve) fitted to
these measurements, and
the engine's step-time model fitted to real engine steps, for
``tiered-kv simulate --calibration`` and the cost-aware policy.

This measures the built-in small model end to end.  For a user's model
profile, see :mod:`tiered_kv.tools.crossover_profile`; at a real model's size
on a GPU, :mod:`tiered_kv.tools.crossover_real`.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv.engine.engine import Engine
from tiered_kv.engine.engine_config import EngineConfig
from tiered_kv.engine.model import ModelConfig
from tiered_kv.manager.cost_model import CostModel, nnls
from tiered_kv.sim.calibration import STEP_TERMS, Calibration, model_config_dict
from tiered_kv.sim.progress import PhaseHook
from tiered_kv.tools.crossover_rig import SwapRig
from tiered_kv.tools.crossover_timing import RowFile, relative_spread


def measure_lengths(
    config: ModelConfig,
    block_size: int,
    layout: str,
    lengths: Sequence[int],
    repeats: int,
    device: str,
    emit: Callable[[str], None],
    progress: PhaseHook | None = None,
    rows: RowFile | None = None,
) -> list[dict[str, Any]]:
    """Swap-out, swap-in, swap beside compute, and recompute, per context length.

    Each point runs once untimed (first-call set-up: allocator, kernel choice,
    page faults), then ``repeats`` times; a row holds the median of each
    (``swap_out_s``...) and its spread (``swap_out``: min/median/max), and
    goes to ``rows`` as soon as it is measured.
    """
    spec = config.kv_spec(block_size)
    max_blocks = -(-max(lengths) // block_size)
    rig = SwapRig(config, block_size, layout, max_blocks, repeats, device)
    rng = random.Random(0)
    out_rows = rows if rows is not None else RowFile(None)
    emit(
        f"{'tokens':>7} {'blocks':>6} {'MiB':>7} {'swap-out ms':>11} {'swap-in ms':>10} {'swap+compute ms':>15} "
        f"{'recompute ms':>12} {'spread':>6}  winner"
    )
    phase = "measuring swap and recompute"
    if progress is not None:
        progress(phase, 0, len(lengths))
    for length in lengths:
        nb = -(-length // block_size)
        table = list(range(1, nb + 1))
        other = list(range(max_blocks + 1, max_blocks + 1 + nb))
        tokens = [rng.randrange(config.vocab_size) for _ in range(length)]
        recompute = rig.point(lambda tokens=tokens, table=table: rig.prefill(tokens, table))
        out = rig.point(lambda table=table: rig.transfer("GPU", "CPU", table, table))
        back = rig.point(lambda table=table, other=other: rig.transfer("CPU", "GPU", table, other))
        with_compute = rig.point(lambda table=table, other=other: rig.beside_compute(table, other))
        row = _length_row(length, nb, nb * spec.bytes_per_block, out, back, with_compute, recompute)
        out_rows.add(row)
        _emit_length_row(emit, row)
        if progress is not None:
            progress(phase, len(out_rows.rows), len(lengths))
    rig.close()
    return out_rows.rows


def _length_row(
    length: int,
    nb: int,
    nbytes: int,
    out: dict[str, Any],
    back: dict[str, Any],
    with_compute: dict[str, Any],
    recompute: dict[str, Any],
) -> dict[str, Any]:
    """One length's row: the medians, the winner on out + in against recompute, and each spread."""
    return {
        "tokens": length,
        "blocks": nb,
        "bytes": nbytes,
        "swap_out_s": out["median"],
        "swap_in_s": back["median"],
        "swap_with_compute_s": with_compute["median"],
        "recompute_s": recompute["median"],
        "winner": "swap" if out["median"] + back["median"] < recompute["median"] else "recompute",
        "swap_out": out,
        "swap_in": back,
        "swap_with_compute": with_compute,
        "recompute": recompute,
    }


def _emit_length_row(emit: Callable[[str], None], row: dict[str, Any]) -> None:
    """The table line of one length; ``spread`` is the widest relative spread of its four points."""
    worst = max(relative_spread(row[k]) for k in ("swap_out", "swap_in", "swap_with_compute", "recompute"))
    emit(
        f"{row['tokens']:7d} {row['blocks']:6d} {row['bytes'] / 2**20:7.2f} {row['swap_out_s'] * 1e3:11.3f} "
        f"{row['swap_in_s'] * 1e3:10.3f} {row['swap_with_compute_s'] * 1e3:15.3f} {row['recompute_s'] * 1e3:12.3f} "
        f"{worst:6.0%}  {row['winner']}"
    )


def fit_step_model(
    config: ModelConfig,
    block_size: int,
    layout: str,
    device: str,
    repeats: int,
    seed: int = 1,
    scale: float = 1.0,
    max_prompt: int = 400,
    progress: PhaseHook | None = None,
) -> tuple[tuple[float, float, float, float, float], float]:
    """Fit the engine's step time on real engine steps; return the model and its mean relative error.

    Short engine runs with 4, 8 and 16 running requests at most give steps whose
    size, context and request count vary independently enough to separate the
    terms; a fourth run under swap churn adds the cost of preemption and copies.
    The fit is non-negative and weighted by relative error, so a millisecond
    decode step counts as much as a long prefill.
    """
    rng = random.Random(seed)
    steps: list[tuple] = []
    # Three runs without memory pressure, then one under swap churn with a write-through CPU
    # tier, so the fit also carries what preemption and copy threads cost a step.
    free = 4096 // block_size + 2
    runs = [
        (4, free, "recompute", "none"),
        (8, free, "recompute", "none"),
        (16, free, "recompute", "none"),
        (16, 1024 // block_size, "swap", "write_through"),
    ]
    phase = "fitting the step model on engine runs"
    if progress is not None:
        progress(phase, 0, len(runs))
    for k, (max_seqs, gpu_blocks, mode, offload) in enumerate(runs, 1):
        e = Engine(
            config,
            EngineConfig(
                num_gpu_blocks=gpu_blocks,
                num_cpu_blocks=8192 // block_size,
                block_size=block_size,
                layout=layout,
                max_num_batched_tokens=512,
                max_num_seqs=max_seqs,
                device=device,
                mode=mode,
                offload=offload,
            ),
        )
        for i in range(max(4, int(scale * (3 * max_seqs + 8)))):
            prompt = [rng.randrange(config.vocab_size) for _ in range(rng.randrange(16, max_prompt))]
            e.add_request(i, prompt, rng.randrange(4, 48))
        e.run()
        e.close()
        steps.extend(e.stats.step_log)
        if progress is not None:
            progress(phase, k, len(runs))
    feats = [[1.0, float(t), float(a), float(kv), float(k)] for t, a, kv, k, _dt, _c in steps]
    ys = [dt for *_, dt, _c in steps]
    coef = nnls([[v / y for v in x] for x, y in zip(feats, ys, strict=True)], [1.0] * len(ys))
    pred = [sum(c * v for c, v in zip(coef, x, strict=True)) for x in feats]
    err = sum(abs(p - y) / y for p, y in zip(pred, ys, strict=True)) / len(ys)
    return tuple(coef), err  # type: ignore[return-value]


def default_lengths(config: ModelConfig, max_tokens: int | None = None) -> list[int]:
    """256 tokens and doublings up to ``max_tokens`` or what fits.

    "What fits": this model's prefill materialises its attention scores, heads
    x L^2 floats; they are kept under 512 MiB.
    """
    cap = max_tokens or int((512 * 2**20 / (4 * config.num_heads)) ** 0.5)
    return [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384) if n <= cap]


def crossover(
    config: ModelConfig,
    block_size: int = 16,
    layout: str = "block_contiguous",
    lengths: Sequence[int] | None = None,
    max_tokens: int | None = None,
    repeats: int = 3,
    device: str | None = None,
    emit: Callable[[str], None] = print,
    step_scale: float = 1.0,
    progress: PhaseHook | None = None,
    rows: RowFile | None = None,
) -> tuple[dict[str, Any], Calibration]:
    """Measure, fit and summarise; ``progress`` hears about each length and each step-fit engine run.

    Each point is the median of ``repeats`` runs (after one untimed run); its
    spread is in the row.  ``rows`` receives every row as it is measured.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if lengths is None:
        lengths = default_lengths(config, max_tokens)
    emit(
        f"device: {device}; model: {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads} heads / {config.num_kv_heads} KV heads x {config.head_dim}, {config.dtype}; "
        f"block {block_size} tokens, {layout}"
    )
    rows = measure_lengths(config, block_size, layout, lengths, repeats, device, emit, progress, rows)
    cm = _fit_links(rows, config.kv_spec(block_size).bytes_per_token, block_size)
    coef, fit_err = fit_step_model(
        config,
        block_size,
        layout,
        device,
        repeats,
        scale=step_scale,
        max_prompt=min(400, max(lengths)),
        progress=progress,
    )
    cal = Calibration(device, block_size, layout, model_config_dict(config), cm, tuple(coef))  # type: ignore[arg-type]
    cross, summary = _crossing(rows)
    emit(f"\n{summary}")
    _emit_fits(emit, cm, coef, fit_err)
    doc = {
        "device": device,
        "model": model_config_dict(config),
        "block_size": block_size,
        "layout": layout,
        "rows": rows,
        "crossover_tokens": cross,
        "summary": summary,
        "repeats": repeats,
        "step_fit_error": fit_err,
        "calibration": cal.to_dict(),
    }
    return doc, cal


def _fit_links(rows: list[dict[str, Any]], kv_bytes_per_token: int, block_size: int) -> CostModel:
    """The cost model fitted to the rows: the links to their copies, the prefill curve to their recomputes."""
    # The link is fitted to the copies that ran beside compute: during serving every copy
    # does, and on a shared machine the contention is part of what a copy costs.
    transfers = [(d, r["bytes"], 1, r["swap_with_compute_s"]) for r in rows for d in ("D2H", "H2D")]
    prefills = [(r["tokens"], r["recompute_s"]) for r in rows]
    return CostModel(kv_bytes_per_token=kv_bytes_per_token, block_size=block_size).calibrated(transfers, prefills)


def _crossing(rows: list[dict[str, Any]]) -> tuple[int | None, str]:
    """The first length where the winner changes (``None`` if it never does) and the one-line summary."""
    cross = None
    for a, b in itertools.pairwise(rows):
        if a["winner"] != b["winner"]:
            cross = b["tokens"]
            break
    winners = {r["winner"] for r in rows}
    summary = (
        f"swap wins at every length measured ({rows[0]['tokens']}-{rows[-1]['tokens']} tokens)"
        if winners == {"swap"}
        else f"recompute wins at every length measured ({rows[0]['tokens']}-{rows[-1]['tokens']} tokens)"
        if winners == {"recompute"}
        else f"crossover at about {cross} tokens"
    )
    return cross, summary


def _emit_fits(emit: Callable[[str], None], cm: CostModel, coef: Sequence[float], fit_err: float) -> None:
    """Print the fitted cost model and step model."""
    emit(
        f"calibrated: D2H {cm.d2h_bytes_per_s / 1e9:.2f} GB/s, H2D {cm.h2d_bytes_per_s / 1e9:.2f} GB/s, "
        f"per-copy overhead {cm.per_copy_overhead_s * 1e6:.1f} us, prefill {cm.prefill_tokens_per_s:.0f} tok/s "
        f"+ {cm.prefill_quadratic_s_per_token2:.3e} s/tok^2"
    )
    emit(
        "step model ("
        + ", ".join(f"{t}={c:.3e}" for t, c in zip(STEP_TERMS, coef, strict=True))
        + f"): mean abs error {fit_err:.1%} on real engine steps"
    )


def plot(doc: dict[str, Any], outdir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    rows = doc["rows"]
    x = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [1e3 * (r["swap_out_s"] + r["swap_in_s"]) for r in rows], marker="o", label="swap out + in")
    if all("swap_with_compute_s" in r for r in rows):
        ax.plot(x, [1e3 * r["swap_with_compute_s"] for r in rows], marker="s", label="swap beside compute")
    ax.plot(x, [1e3 * r["recompute_s"] for r in rows], marker="^", label="recompute (prefill)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("time (ms)")
    summary = doc.get("summary") or doc.get("answer")
    ax.set_title(f"swap vs recompute on {doc['device']}: {summary}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = outdir / "crossover.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
