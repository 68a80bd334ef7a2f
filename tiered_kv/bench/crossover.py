"""``tiered-kv crossover``: where does swapping beat recomputing, on this hardware?

One question, three ways to measure it, one step-model fit (:func:`fit_steps`)
and one device sync path (:func:`~tiered_kv.bench.timing.sync_device`):

* **the built-in small model, end to end** (:func:`crossover`).  For context
  lengths from 256 tokens up to what fits, with the real model and the real
  copy engine: swap-out time (GPU tier -> CPU tier), swap-in time (back, into
  other blocks), both with compute running beside them (a decode loop on
  another request), and recompute time (a prefill of the whole context).  The
  step model is fitted on real engine steps (:func:`fit_step_model`).
* **a real model's exact shape** (:func:`real_crossover`, gpu-check's crossover
  part).  The model is :class:`~tiered_kv.bench.model.RandomLlama` (random
  weights drawn on the device, nothing downloaded; on a GPU, Llama-3-8B's shape
  in bf16).  Recompute is a prefill through every layer writing its KV into the
  paged GPU tier, timed with events on the compute stream; then decode steps of
  a few batch sizes and contexts, so the step model (``intercept + per_token *
  tokens + per_attn_unit * attention units + per_kv_token * KV tokens + per_seq
  * requests``) is fitted on prefill and decode steps of the real shape.
  Lengths whose tiers, weights and activations do not fit in memory are left
  out before anything is allocated, and the result says which and why.
* **the user's model profile** (:func:`profile_crossover`, ``--model``).  The
  copy link is measured here with the model's KV shape (layers x KV heads per
  GPU x head dim x dtype); on a machine without a GPU both tiers are in host
  memory and the output says so (that link is memory bandwidth, not PCIe).
  Recompute is priced by a calibration measured on the *same* model, or by the
  hardware profile's roofline at ``--mfu``, exactly as the simulator and the
  manager's :class:`~tiered_kv.manager.pricing.CostModel` price it.  The
  answer is given per measured length and as the length where the fitted link
  line and the compute curve cross, which needs no measured point to land on it.

Each point runs once untimed, then ``repeats`` times; a row carries the median
and the spread (min/median/max) and is handed to a row file as soon as it is
measured.  Each form writes a calibration (the cost model fitted to these
measurements, a step model, the model's shape) for ``tiered-kv simulate
--calibration`` and the cost-aware victim policy.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiered_kv.bench.model import LlamaShape, RandomLlama
from tiered_kv.bench.swap_timer import SwapTimer, blocks_for, check_tiers_fit, link_name, make_tiers
from tiered_kv.bench.timing import RowFile, Stopwatch, relative_spread, spread, sync_device
from tiered_kv.engine.engine import Engine
from tiered_kv.engine.engine_config import EngineConfig
from tiered_kv.engine.model import ModelConfig, TinyLlama
from tiered_kv.errors import ConfigError, ResourceLimitError
from tiered_kv.manager.manager_config import ManagerConfig
from tiered_kv.manager.pricing import CostModel, nnls
from tiered_kv.sched.config import SchedulerConfig
from tiered_kv.sim.calibration import STEP_TERMS, Calibration, model_config_dict
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.profiles import HardwareProfile, ModelProfile
from tiered_kv.sim.progress import PhaseHook
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer.factory import make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan


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


# The small model: two tiers, the copy engine and the model, timing one operation at a time.


class SwapRig:
    """What one measurement run times with: a GPU and a CPU tier, the copy engine and the model.

    Blocks ``1..max_blocks`` hold the measured context, ``max_blocks+1..``
    receive its swap-in, and a scratch context of 256 tokens after both runs
    the decode loop that computes beside the copies.
    """

    __slots__ = ("copy", "device", "model", "next_plan_id", "repeats", "scratch", "tiers")

    def __init__(
        self, config: ModelConfig, block_size: int, layout: str, max_blocks: int, repeats: int, device: str
    ) -> None:
        spec = config.kv_spec(block_size)
        scratch_blocks = 256 // block_size
        n_blocks = 2 * max_blocks + 2 + scratch_blocks
        self.tiers = {
            "GPU": KVStorage(spec, n_blocks, "GPU", layout, device=device),
            "CPU": KVStorage(spec, n_blocks, "CPU", layout),
        }
        for t in self.tiers.values():
            t.byte_view().zero_()
        self.copy = make_copy_engine(self.tiers)
        self.model = TinyLlama(config, device)
        self.device = device
        self.repeats = repeats
        self.next_plan_id = 0
        self.scratch = list(range(2 * max_blocks + 1, 2 * max_blocks + 1 + scratch_blocks))

    def submit(self, src_m: str, dst_m: str, src: list[int], dst: list[int]) -> TransferHandle:
        """Hand one copy to the engine (a swap-in is urgent) and return its handle."""
        self.next_plan_id += 1
        kind = PlanKind.SWAP_OUT if dst_m == "CPU" else PlanKind.SWAP_IN
        plan = TransferPlan(self.next_plan_id, src_m, dst_m, tuple(src), tuple(dst), kind, urgent=dst_m == "GPU")
        return self.copy.submit(plan)

    def transfer(self, src_m: str, dst_m: str, src: list[int], dst: list[int]) -> float:
        """Seconds from submitting one copy, nothing else queued, until it has landed."""
        sync_device(self.device)
        t0 = time.perf_counter()
        h = self.submit(src_m, dst_m, src, dst)
        if not h.wait(60):
            raise RuntimeError(f"copy failed: {h.error}")
        return time.perf_counter() - t0

    def beside_compute(self, table: list[int], other: list[int]) -> float:
        """Both directions at once while a decode loop runs on a third context.

        Timed by the copies' own completion stamps (set when each finishes), so the
        result is not rounded up to whole decode steps.
        """
        sync_device(self.device)
        handles = [self.submit("GPU", "CPU", table, table), self.submit("CPU", "GPU", table, other)]
        while not all(h.done() for h in handles):
            self.model.forward_chunk([1], 255, self.scratch, self.tiers["GPU"])  # one decode step
        for h in handles:
            if not h.wait(60):
                raise RuntimeError(f"copy failed: {h.error}")
        return max(h.elapsed_s for h in handles)

    def prefill(self, tokens: list[int], table: list[int]) -> float:
        """Seconds of a prefill of ``tokens`` into the blocks of ``table``: the recompute."""
        sync_device(self.device)
        t0 = time.perf_counter()
        self.model.forward_chunk(tokens, 0, table, self.tiers["GPU"])
        sync_device(self.device)
        return time.perf_counter() - t0

    def point(self, fn: Callable[[], float]) -> dict[str, Any]:
        """The spread of ``repeats`` timed calls of ``fn``, after one untimed."""
        fn()  # untimed: the first call pays for set-up, not for the work
        return spread([fn() for _ in range(self.repeats)])

    def close(self) -> None:
        self.copy.close()


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
    rng = random.Random(1)
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
                manager=ManagerConfig(
                    num_gpu_blocks=gpu_blocks, num_cpu_blocks=8192 // block_size, block_size=block_size, offload=offload
                ),
                scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_seqs, mode=mode),
                layout=layout,
                device=device,
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
    coef, err = fit_steps([(float(t), float(a), float(kv), float(k), dt) for t, a, kv, k, dt, _c in steps])
    return coef, err  # type: ignore[return-value]


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
    cross = next((b["tokens"] for a, b in itertools.pairwise(rows) if a["winner"] != b["winner"]), None)
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


# The real shape: RandomLlama, prefills and decode steps timed on the compute stream.


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


# The user's model profile: the link measured here, compute from a calibration or a roofline.

#: Default context lengths for a user's model (the issue's 512 to 32k).
PROFILE_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
#: The fitted crossover is searched up to this context length.
SEARCH_MAX_TOKENS = 1 << 21


@dataclass(frozen=True)
class ComputeSource:
    """Where recompute time comes from.

    Attributes:
        name: In words, for the table and the calibration file.
        prefill: A cost model whose prefill terms price recompute.
        step_model: The engine step model for the calibration file.
    """

    name: str
    prefill: CostModel
    step_model: tuple[float, float, float, float, float]


def model_spec(model: ModelProfile, block_size: int) -> KVSpec:
    """The KV shape one GPU holds for ``model`` (KV heads divided by tensor parallelism)."""
    return KVSpec(model.num_layers, model.kv_heads_per_gpu, model.head_dim, model.dtype, block_size)


def per_gpu_model(model: ModelProfile) -> dict[str, Any]:
    """The model as one GPU runs it: the calibration's ``model`` entry (it has no tensor-parallel field)."""
    return {
        "name": model.name,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_heads": max(1, model.num_heads // model.tensor_parallel),
        "num_kv_heads": model.kv_heads_per_gpu,
        "head_dim": model.head_dim,
        "dtype": model.dtype,
        "num_params": model.params_per_gpu,
        "tensor_parallel": model.tensor_parallel,
    }


def compute_from_roofline(
    model: ModelProfile, hw: HardwareProfile, mfu: float, hbm_efficiency: float = 0.8
) -> ComputeSource:
    """Recompute priced by the roofline, as the simulator prices it without a calibration.

    The step model (a linear form, which the calibration file needs) is the
    roofline with its two roofs *added* instead of maxed: exact where one roof
    dominates (long prefills, small decode batches), at most twice the roofline
    at the ridge point between them.
    """
    cm_model = ComputeModel(hw, model, mfu, hbm_efficiency)
    prefill = CostModel(
        kv_bytes_per_token=model.kv_bytes_per_token,
        prefill_tokens_per_s=cm_model.prefill_tokens_per_s(),
        prefill_quadratic_s_per_token2=cm_model.prefill_quadratic(),
    )
    rate = hw.peak_bf16_flops * mfu
    hbm = hw.hbm_bytes_per_s * hbm_efficiency
    step = (
        cm_model.step_overhead_s + model.weight_bytes_per_gpu / hbm,
        2.0 * model.params_per_gpu / rate,
        2.0 * model.num_layers * model.attn_dim_per_gpu / rate,
        model.kv_bytes_per_token / hbm,
        0.0,
    )
    return ComputeSource(f"roofline of {hw.name} at MFU {mfu:g}", prefill, step)


def compute_from_calibration(model: ModelProfile, cal: Calibration, where: str) -> ComputeSource:
    """Recompute priced by a calibration measured on the same model; refuse one measured on another model."""
    mine = per_gpu_model(model)
    for key in ("num_layers", "hidden_size", "num_kv_heads", "head_dim"):
        if cal.model.get(key) != mine[key]:
            raise ConfigError(
                f"--calibration {where}: measured on a model with {key} {cal.model.get(key)}, but --model "
                f"{model.name} has {mine[key]}; its compute times do not apply (measure this model, or give "
                "--hardware to price compute by the roofline)"
            )
    return ComputeSource(f"calibration {where} ({cal.device})", cal.cost_model, cal.step_model)


def fit_link(samples: Sequence[tuple[str, int, int, float]]) -> dict[str, float]:
    """Bandwidth per direction and per-copy overhead from ``(direction, bytes, copies, seconds)`` samples.

    A non-negative least-squares line per direction (``seconds = bytes / bw +
    copies * overhead``); with one sample, or a line through zero bandwidth,
    bytes over seconds.
    """
    out: dict[str, float] = {}
    overheads = []
    for d in ("D2H", "H2D"):
        rows = [(b, c, t) for dd, b, c, t in samples if dd == d]
        if not rows:
            raise ValueError(f"no {d} samples")
        inv_bw, ovh = 0.0, 0.0
        if len(rows) > 1:
            inv_bw, ovh = nnls([[float(b), float(c)] for b, c, _ in rows], [t for *_, t in rows])
        if inv_bw <= 0:
            inv_bw, ovh = sum(t for *_, t in rows) / sum(b for b, _, _ in rows), 0.0
        out[f"{d.lower()}_bytes_per_s"] = 1.0 / inv_bw
        overheads.append(ovh)
    out["per_copy_overhead_s"] = sum(overheads) / len(overheads)
    return out


def swap_seconds(cm: CostModel, tokens: int, copies: int) -> float:
    nb = blocks_for(tokens, cm.block_size)
    return cm.swap_out_time(nb, copies) + cm.swap_in_time(nb, copies)


def fitted_crossover(cm: CostModel, copies_per_block: float, lo: int, hi: int = SEARCH_MAX_TOKENS) -> dict[str, Any]:
    """Where the fitted swap line and the recompute curve cross, searched over ``[lo, hi]`` tokens.

    Returns ``{"short": winner at lo, "long": winner at hi, "tokens": first length where the
    winner changes, or None}``.
    """

    def swap_wins(t: int) -> bool:
        copies = max(1, math.ceil(blocks_for(t, cm.block_size) * copies_per_block))
        return swap_seconds(cm, t, copies) < cm.recompute_time(t)

    grid = sorted({lo, hi, *(int(lo * 2 ** (k / 8)) for k in range(0, 8 * 22) if lo * 2 ** (k / 8) <= hi)})
    first = swap_wins(grid[0])
    change = next((t for t in grid if swap_wins(t) != first), None)
    name = {True: "swap", False: "recompute"}
    if change is None:
        return {"short": name[first], "long": name[first], "tokens": None}
    a, b = grid[grid.index(change) - 1], change
    while b - a > 1:  # bisect to the token
        mid = (a + b) // 2
        a, b = (mid, b) if swap_wins(mid) == first else (a, mid)
    return {"short": name[first], "long": name[not first], "tokens": b}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


@dataclass(slots=True)
class _LinkBench:
    """What every measured length of one run shares.

    Attributes:
        timer: Times swap-out and swap-in through the run's copy engine.
        spec: The model's KV shape per GPU.
        compute: Prices the recompute each row is compared with.
        repeats: Timed runs per point.
        chunk: Blocks per copy of the engine: a swap of ``n`` blocks is ``ceil(n / chunk)`` copies.
        hardware: When given, each row also carries the profile's own swap estimate.
    """

    timer: SwapTimer
    spec: KVSpec
    compute: ComputeSource
    repeats: int
    chunk: int
    hardware: HardwareProfile | None

    def row(self, length: int) -> dict[str, Any]:
        """Measure one length: swap-out and swap-in spreads, their medians, recompute and the winner."""
        nb = blocks_for(length, self.spec.block_size)
        m = self.timer.measure(nb, self.repeats)
        nbytes = nb * self.spec.bytes_per_block
        copies = math.ceil(nb / self.chunk)
        out_s, in_s = m["swap_out"]["median"], m["swap_in"]["median"]
        recompute = self.compute.prefill.recompute_time(length)
        row: dict[str, Any] = {
            "tokens": length,
            "blocks": nb,
            "bytes": nbytes,
            "copies": copies,
            **m,
            "swap_out_s": out_s,
            "swap_in_s": in_s,
            "swap_s": out_s + in_s,
            "recompute_s": recompute,
            "recompute_source": self.compute.name,
            "winner": "swap" if out_s + in_s < recompute else "recompute",
        }
        if self.hardware is not None:
            hw = self.hardware
            row["swap_profile_s"] = 2 * (nbytes / hw.link.h2d_bytes_per_s + copies * hw.per_copy_overhead_s)
        return row


def profile_crossover(
    model: ModelProfile,
    compute: ComputeSource,
    block_size: int,
    layout: str,
    lengths: Sequence[int],
    repeats: int,
    device: str,
    rows: RowFile,
    emit: Callable[[str], None] = print,
    progress: PhaseHook | None = None,
    hardware: HardwareProfile | None = None,
) -> tuple[dict[str, Any], Calibration]:
    """Measure the link for ``model``'s KV shape at each length; answer swap or recompute.

    Every row is added to ``rows`` (flushed) as soon as it is measured.
    """
    spec = model_spec(model, block_size)
    tiers = make_tiers(spec, max(lengths), layout, device)
    engine = make_copy_engine(tiers)
    link = link_name(engine, device)
    bench = _LinkBench(SwapTimer(engine, device), spec, compute, repeats, engine.max_blocks_per_chunk, hardware)
    _emit_header(emit, model, bench, layout, link)
    try:
        samples = _measure_link(bench, lengths, rows, emit, progress)
    finally:
        engine.close()
        for t in tiers.values():
            t.close()
    link_fit = fit_link(samples)
    cm = _link_cost_model(spec, link_fit, compute.prefill)
    fitted = fitted_crossover(cm, 1.0 / bench.chunk, block_size)
    measured = rows.rows
    change = next((b["tokens"] for a, b in itertools.pairwise(measured) if a["winner"] != b["winner"]), None)
    answer = _answer(fitted)
    _emit_summary(emit, model.name, answer, measured, cm, link)
    cal = Calibration(f"{device}: {link}", block_size, layout, per_gpu_model(model), cm, compute.step_model)
    doc = {
        "model": per_gpu_model(model),
        "device": device,
        "link": link,
        "compute": compute.name,
        "block_size": block_size,
        "layout": layout,
        "repeats": repeats,
        "rows": measured,
        "fitted_link": link_fit,
        "fitted_crossover": fitted,
        "measured_crossover_tokens": change,
        "answer": answer,
        "calibration": cal.to_dict(),
    }
    return doc, cal


def _emit_header(emit: Callable[[str], None], model: ModelProfile, bench: _LinkBench, layout: str, link: str) -> None:
    """The model, link and compute lines, then the table's column names."""
    spec = bench.spec
    emit(
        f"model: {model.name} ({model.num_layers} layers x {model.kv_heads_per_gpu} KV heads per GPU x "
        f"{model.head_dim}, {model.dtype}: {spec.bytes_per_token} bytes of KV per token); block {spec.block_size} "
        f"tokens, {layout}"
    )
    emit(f"link: measured here, {link}; contiguous block ids, {bench.repeats} repeats per point (min/median/max)")
    emit(f"compute: {bench.compute.name}")
    emit(
        f"{'tokens':>7} {'MiB':>9} {'swap-out ms (min/med/max)':>27} {'swap-in ms (min/med/max)':>27} "
        f"{'swap ms':>9} {'recompute ms':>12}  winner"
    )


def _measure_link(
    bench: _LinkBench,
    lengths: Sequence[int],
    rows: RowFile,
    emit: Callable[[str], None],
    progress: PhaseHook | None,
) -> list[tuple[str, int, int, float]]:
    """Measure every length, adding and printing each row as it lands; return the link's fit samples."""
    phase = "measuring the copy link"
    if progress is not None:
        progress(phase, 0, len(lengths))
    samples: list[tuple[str, int, int, float]] = []
    for k, length in enumerate(lengths, 1):
        row = bench.row(length)
        rows.add(row)
        samples += [("D2H", row["bytes"], 1, row["swap_out_s"]), ("H2D", row["bytes"], 1, row["swap_in_s"])]
        so, si = row["swap_out"], row["swap_in"]
        emit(
            f"{length:7d} {row['bytes'] / 2**20:9.1f} "
            f"{_ms(so['min']):>8}/{_ms(so['median']):>8}/{_ms(so['max']):>9} "
            f"{_ms(si['min']):>8}/{_ms(si['median']):>8}/{_ms(si['max']):>9} "
            f"{_ms(row['swap_s']):>9} {_ms(row['recompute_s']):>12}  {row['winner']}"
        )
        if progress is not None:
            progress(phase, k, len(lengths))
    return samples


def _link_cost_model(spec: KVSpec, link_fit: dict[str, float], prefill: CostModel) -> CostModel:
    """The fitted link joined to the compute source's prefill curve."""
    return CostModel(
        kv_bytes_per_token=spec.bytes_per_token,
        block_size=spec.block_size,
        d2h_bytes_per_s=link_fit["d2h_bytes_per_s"],
        h2d_bytes_per_s=link_fit["h2d_bytes_per_s"],
        per_copy_overhead_s=link_fit["per_copy_overhead_s"],
        prefill_tokens_per_s=prefill.prefill_tokens_per_s,
        prefill_quadratic_s_per_token2=prefill.prefill_quadratic_s_per_token2,
        prefill_overhead_s=prefill.prefill_overhead_s,
    )


def _answer(fitted: dict[str, Any]) -> str:
    """The answer in words, from the fitted crossover."""
    if fitted["tokens"] is None:
        return f"{fitted['short']} at every context length (fitted line, up to {SEARCH_MAX_TOKENS} tokens)"
    return f"{fitted['short']} below about {fitted['tokens']} tokens, {fitted['long']} from there up"


def _emit_summary(
    emit: Callable[[str], None], name: str, answer: str, measured: list[dict[str, Any]], cm: CostModel, link: str
) -> None:
    """The answer, the winner per measured length, the fitted link and the widest swap-out spread."""
    winners = ", ".join(f"{r['winner']} at {r['tokens']}" for r in measured)
    emit(f"\n{name}: {answer}")
    emit(f"measured: {winners}")
    emit(
        f"fitted link: D2H {cm.d2h_bytes_per_s / 1e9:.2f} GB/s, H2D {cm.h2d_bytes_per_s / 1e9:.2f} GB/s, "
        f"{cm.per_copy_overhead_s * 1e6:.1f} us per copy ({link})"
    )
    spreads = [(r["swap_out"]["max"] - r["swap_out"]["min"]) / r["swap_out"]["median"] for r in measured]
    emit(f"largest spread of a swap-out point: {max(spreads):.0%} of its median")
