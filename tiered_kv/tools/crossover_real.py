"""Crossover at real size: swap-out + swap-in against recompute for a model of a real model's exact shape.

The model is :class:`~tiered_kv.tools.crossover_model.RandomLlama` (random
weights drawn on the device, nothing downloaded; on a GPU, Llama-3-8B's shape
in bf16).  For each context length it measures, each repeated and reported as
min / median / max:

* recompute: a prefill of the whole context through every layer, writing its
  KV into the paged GPU tier (timed with events on the compute stream);
* swap-out and swap-in of that KV through the real copy engine.

Then decode steps of a few batch sizes and contexts, so the step model
(``intercept + per_token * tokens + per_attn_unit * attention units +
per_kv_token * KV tokens + per_seq * requests``) can be fitted on prefill and
decode steps of the real shape.  The calibration file it writes (cost model:
fitted link and prefill curve; step model; the model's shape) feeds
``tiered-kv simulate --calibration``.

Lengths whose tiers, weights and activations do not fit in memory are left
out before anything is allocated, and the result says which and why.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv.errors import ResourceLimitError
from tiered_kv.manager.cost_model import CostModel, nnls
from tiered_kv.sim.calibration import STEP_TERMS, Calibration
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tools.crossover_link import SwapTimer, blocks_for, check_tiers_fit, link_name, make_tiers
from tiered_kv.tools.crossover_model import LlamaShape, RandomLlama
from tiered_kv.tools.crossover_timing import RowFile, Stopwatch, relative_spread
from tiered_kv.transfer.factory import make_copy_engine


def activation_bytes(shape: LlamaShape, tokens: int) -> int:
    """A generous bound on one prefill's live activations (hidden states, projections, expanded K/V, MLP)."""
    s = shape
    per_token = (
        4 * s.hidden_size
        + 3 * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        + 2 * s.num_heads * s.head_dim
        + 3 * s.intermediate_size
    )
    itemsize = 4 if s.dtype == "float32" else 2
    return tokens * per_token * itemsize


def lengths_that_fit(
    shape: LlamaShape, block_size: int, lengths: Sequence[int], device: str
) -> tuple[list[int], list[dict[str, Any]]]:
    """The lengths whose tiers, weights and activations fit here, and why the others were left out."""
    weights = shape.num_params * (4 if shape.dtype == "float32" else 2)
    keep = sorted(lengths)
    dropped: list[dict[str, Any]] = []
    while keep:
        try:
            check_tiers_fit(
                shape.kv_spec(block_size),
                keep[-1],
                device,
                f"crossover for {shape.name}",
                weights + activation_bytes(shape, keep[-1]),
            )
            break
        except ResourceLimitError as exc:
            dropped.append({"tokens": keep.pop(), "why": str(exc)})
    return keep, dropped


def fit_steps(samples: list[tuple[float, float, float, float, float]]) -> tuple[tuple[float, ...], float]:
    """Non-negative least squares of step seconds on the five step-model terms, weighted by relative error.

    ``samples`` are ``(tokens, attention units, KV tokens, requests, seconds)``; returns the
    coefficients and the mean relative error of the fit on them.
    """
    feats = [[1.0, t, a, kv, r] for t, a, kv, r, _ in samples]
    ys = [y for *_, y in samples]
    coef = nnls([[v / y for v in x] for x, y in zip(feats, ys, strict=True)], [1.0] * len(ys))
    pred = [sum(c * v for c, v in zip(coef, x, strict=True)) for x in feats]
    err = sum(abs(p - y) / y for p, y in zip(pred, ys, strict=True)) / len(ys)
    return tuple(coef), err


def real_crossover(
    shape: LlamaShape,
    block_size: int,
    lengths: Sequence[int],
    repeats: int,
    device: str,
    decode_points: Sequence[tuple[int, int]],
    rows: RowFile,
    stop: Callable[[], bool],
    emit: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
    device_name: str,
) -> tuple[dict[str, Any], Calibration | None]:
    """Measure until done or ``stop()``; ``save`` receives the document after every length."""
    fit, dropped = lengths_that_fit(shape, block_size, lengths, device)
    doc: dict[str, Any] = {
        "model": shape.to_dict(),
        "block_size": block_size,
        "layout": "block_contiguous",
        "repeats": repeats,
        "left_out": dropped,
        "rows": rows.rows,
        "decode": [],
        "stopped": None,
    }
    for d in dropped:
        emit(f"crossover: {d['tokens']} tokens left out: {d['why']}")
    if not fit:
        doc["stopped"] = "no length fits in memory here"
        save(doc)
        return doc, None
    _measure(shape, block_size, fit, repeats, device, decode_points, rows, stop, emit, save, doc)
    measured = rows.rows
    doc["crossover_tokens"] = next(
        (b["tokens"] for a, b in itertools.pairwise(measured) if a["winner"] != b["winner"]), None
    )
    doc["winners"] = {r["tokens"]: r["winner"] for r in measured}
    if len(measured) < 3:
        doc["calibration"] = None
        doc["calibration_why_not"] = f"{len(measured)} lengths measured; a prefill curve needs 3"
        save(doc)
        return doc, None
    cal = _calibrate(doc, measured, shape, block_size, device_name, emit)
    save(doc)
    return doc, cal


@dataclass(slots=True)
class _RealRun:
    """The instruments of one run: the model, its paged GPU tier, the clocks and the engine's chunk size."""

    model: RandomLlama
    gpu: KVStorage
    watch: Stopwatch
    swaps: SwapTimer
    spec: KVSpec
    chunk: int
    repeats: int

    def length_row(self, length: int) -> dict[str, Any]:
        """Recompute (a prefill of the whole context), then swap-out and swap-in of its blocks; the row."""
        nb = blocks_for(length, self.spec.block_size)
        batch = self.model.prepare([list(range(1, nb + 1))], 0, length, self.spec.block_size)
        recompute = self.watch.repeat(lambda: self.model.forward(batch, self.gpu), self.repeats)
        m = self.swaps.measure(nb, self.repeats)
        out_s, in_s, re_s = m["swap_out"]["median"], m["swap_in"]["median"], recompute["median"]
        return {
            "tokens": length,
            "blocks": nb,
            "bytes": nb * self.spec.bytes_per_block,
            "copies": math.ceil(nb / self.chunk),
            "recompute": recompute,
            **m,
            "recompute_s": re_s,
            "swap_out_s": out_s,
            "swap_in_s": in_s,
            "swap_s": out_s + in_s,
            "winner": "swap" if out_s + in_s < re_s else "recompute",
        }

    def decode_step(self, batch_size: int, ctx: int) -> dict[str, Any]:
        """One decode step of ``batch_size`` requests with ``ctx`` tokens of context each."""
        table = list(range(1, blocks_for(ctx + 1, self.spec.block_size) + 1))
        batch = self.model.prepare([table] * batch_size, ctx, 1, self.spec.block_size)
        t = self.watch.repeat(lambda: self.model.forward(batch, self.gpu), self.repeats)
        return {"batch": batch_size, "context": ctx, "step": t, "step_s": t["median"]}


def _measure(
    shape: LlamaShape,
    block_size: int,
    fit: list[int],
    repeats: int,
    device: str,
    decode_points: Sequence[tuple[int, int]],
    rows: RowFile,
    stop: Callable[[], bool],
    emit: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
    doc: dict[str, Any],
) -> None:
    """Allocate the model, tiers and copy engine; measure the lengths, then the decode points; always free them."""
    spec = shape.kv_spec(block_size)
    model = RandomLlama(shape, device)
    tiers = make_tiers(spec, max(fit), "block_contiguous", device)
    engine = make_copy_engine(tiers)
    doc["link"] = link_name(engine, device)
    chunk = engine.max_blocks_per_chunk
    run = _RealRun(model, tiers["GPU"], Stopwatch(device), SwapTimer(engine, device), spec, chunk, repeats)
    emit(
        f"crossover at real size: {shape.name} ({shape.num_params / 1e9:.2f}B parameters, {shape.dtype}), "
        f"{spec.bytes_per_token} bytes of KV per token; link: {doc['link']}"
    )
    emit(f"{'tokens':>7} {'MiB':>8} {'recompute ms':>13} {'swap-out ms':>12} {'swap-in ms':>11} {'spread':>7}  winner")
    try:
        for length in fit:
            if stop():
                doc["stopped"] = f"out of time before {length} tokens"
                break
            row = run.length_row(length)
            rows.add(row)
            worst = max(relative_spread(x) for x in (row["recompute"], row["swap_out"], row["swap_in"]))
            emit(
                f"{length:7d} {row['bytes'] / 2**20:8.1f} {row['recompute_s'] * 1e3:13.3f} "
                f"{row['swap_out_s'] * 1e3:12.3f} {row['swap_in_s'] * 1e3:11.3f} {worst:7.0%}  {row['winner']}"
            )
            save(doc)
        _measure_decode(run, decode_points, max((r["tokens"] for r in rows.rows), default=0), doc, stop, emit, save)
    finally:
        if hasattr(engine, "close"):
            engine.close()
        for t in tiers.values():
            t.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _measure_decode(
    run: _RealRun,
    decode_points: Sequence[tuple[int, int]],
    longest: int,
    doc: dict[str, Any],
    stop: Callable[[], bool],
    emit: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
) -> None:
    """Time the decode points whose context the measured lengths cover, into ``doc["decode"]``."""
    for batch_size, ctx in decode_points:
        if stop():
            doc["stopped"] = doc["stopped"] or "out of time in the decode steps"
            break
        if ctx + 1 > longest:
            continue
        step = run.decode_step(batch_size, ctx)
        doc["decode"].append(step)
        emit(f"decode step: {batch_size} requests x {ctx} tokens of context: {step['step_s'] * 1e3:.3f} ms")
        save(doc)


def _calibrate(
    doc: dict[str, Any],
    measured: list[dict[str, Any]],
    shape: LlamaShape,
    block_size: int,
    device_name: str,
    emit: Callable[[str], None],
) -> Calibration:
    """Fit the link, the prefill curve and the step model to the measured rows and decode steps; fill ``doc``."""
    directions = (("D2H", "swap_out_s"), ("H2D", "swap_in_s"))
    # One contiguous run per swap (the engine's chunking of it is not a run the cost model counts):
    # fitting runs that grow with bytes splits the time between bandwidth and per-run overhead
    # arbitrarily (an H200 run fitted 76 GB/s and 0.7 ms per copy to a 55 GB/s link).  The device
    # time of the copies is the link; the host's wake-up after them is not a copy cost.
    transfers = [
        (d, r["bytes"], 1, r[f"{k[:-2]}_engine"]["median"] if f"{k[:-2]}_engine" in r else r[k])
        for r in measured
        for d, k in directions
    ]
    prefills = [(r["tokens"], r["recompute_s"]) for r in measured]
    spec = shape.kv_spec(block_size)
    cm = CostModel(kv_bytes_per_token=spec.bytes_per_token, block_size=block_size).calibrated(transfers, prefills)
    steps = [(float(n), float(n * n), float(n), 1.0, s) for n, s in prefills]
    for d in doc["decode"]:
        b, c = d["batch"], d["context"]
        steps.append((float(b), float(b * ((c + 1) ** 2 - c * c)), float(b * (c + 1)), float(b), d["step_s"]))
    coef, err = fit_steps(steps)
    cal = Calibration(device_name, block_size, "block_contiguous", shape.to_dict(), cm, coef)  # type: ignore[arg-type]
    doc["calibration"] = cal.to_dict()
    doc["step_fit_error"] = err
    doc["step_model"] = dict(zip(STEP_TERMS, coef, strict=True))
    emit(
        f"calibrated: D2H {cm.d2h_bytes_per_s / 1e9:.2f} GB/s, H2D {cm.h2d_bytes_per_s / 1e9:.2f} GB/s, prefill "
        f"{cm.prefill_tokens_per_s:.0f} tok/s + {cm.prefill_quadratic_s_per_token2:.3e} s/tok^2; step model fit "
        f"error {err:.1%} on {len(steps)} prefill and decode steps"
    )
    return cal
