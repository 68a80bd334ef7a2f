"""``tiered-kv crossover --model PROFILE``: swap or recompute for the user's own model, and from which length.

The copy link is measured here, on this machine, with the model's KV shape
(layers x KV heads per GPU x head dim x dtype, from the model profile):
swap-out and swap-in of a request's blocks through the real copy engine, each
point repeated and reported as min / median / max.  On a machine without a
GPU the two tiers are both in host memory and the output says so: that link
is memory bandwidth, not PCIe.

Compute, the cost of recomputing a context, comes from one of:

* ``--calibration``: a calibration measured on the *same* model (its prefill
  curve; ``tiered-kv gpu-check`` writes one for Llama-3-8B on a GPU);
* ``--hardware``: the hardware profile's roofline at ``--mfu``, priced exactly
  as the simulator and the manager's :class:`~tiered_kv.manager.cost_model.CostModel` price it.

The answer is given twice: per measured length (median swap-out + swap-in
against recompute), and as the length where the fitted link line and the
compute curve cross, which needs no measured point to land on it.

The calibration it writes carries the user's model (per GPU), the measured
link, the compute source's prefill curve and a step model, so
``tiered-kv simulate --calibration`` simulates *this* model on *this* link.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.cost_model import CostModel, nnls
from tiered_kv.sim.calibration import Calibration
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.profiles import HardwareProfile, ModelProfile
from tiered_kv.sim.progress import PhaseHook
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tools.crossover_link import SwapTimer, blocks_for, link_name, make_tiers
from tiered_kv.tools.crossover_timing import RowFile
from tiered_kv.transfer.factory import make_copy_engine

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
            row["swap_profile_s"] = 2 * (nbytes / hw.pcie_bytes_per_s + copies * hw.per_copy_overhead_s)
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
        if hasattr(engine, "close"):
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
        # One contiguous run per swap: its chunks grow with its bytes, so fitting them as runs
        # would split the time between bandwidth and overhead arbitrarily.
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
