"""A replayed trace's reuse against cache capacity, and TTFT per run: the two plots of a replay.

* ``prefix_hit_vs_capacity.png``: the workload's prefix hit rate against cache
  capacity (an LRU prefix cache of ``C`` tokens, ``C`` from 10^4 to 10^9 on a
  log axis, as in Mooncake's paper), with each tier's capacity marked and each
  run's measured hit rate at its total capacity.  Curve and points are one
  quantity, the one the KV table prints: prompt tokens found cached at a
  request's first admission.  A recompute victim's re-admission finds its own
  KV again; that is not reuse, and neither counts it.
* ``ttft_per_run.png``: TTFT p50 and p90 per run, each p50 with its speed-up
  over the run it adds to.

The tables of a run, replayed or not, are :mod:`tiered_kv.sim.run_tables`'.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tiered_kv.sim import trace_stats
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.report import pyplot, run_colors, run_label, save_figure
from tiered_kv.sim.run_tables import rows, speedup
from tiered_kv.sim.workload import SimRequest


def capacity_curve(workload: list[SimRequest]) -> dict[str, float]:
    """Prefix hit rate of the workload's prompts for each capacity of :data:`trace_stats.CURVE_TOKENS` and unbounded."""
    reqs = []
    for r in sorted(workload, key=lambda r: (r.arrival, r.rid)):
        blocks = trace_stats.prompt_blocks(r.prompt_len, r.hashes, r.hash_block_size, r.prompt or None)
        reqs.append((r.prompt_len, blocks or []))
    caps = (*trace_stats.CURVE_TOKENS, math.inf)
    return dict(zip(map(str, caps), trace_stats.hit_rates(reqs, caps), strict=True))


def cache_tokens(st: RunSetup) -> dict[str, int]:
    """A run's tiers' capacities in tokens, cumulative from the GPU down (``GPU``, ``+CPU``, ``+disk`` ...)."""
    bs = st.manager.block_size
    out = {"GPU": st.manager.num_gpu_blocks * bs}
    total = out["GPU"]
    if st.manager.num_cpu_blocks:
        total += st.manager.num_cpu_blocks * bs
        out["+CPU"] = total
    for t in st.tiers.tiers:
        total += t.num_blocks * bs
        out[f"+{t.name}"] = total
    return out


def measured_hit_rate(run: dict[str, Any]) -> float:
    """The run's prefix hit rate at first admissions: prompt tokens found on the GPU or in a tier below it.

    The same quantity as the capacity curve's (and as the KV table's GPU and CPU columns added):
    re-admissions of preempted requests are left out, as their hits are their own KV found again.
    """
    first = run["lookup_tokens"]["first"]
    return (first["gpu"] + first["cpu"]) / first["tokens"] if first["tokens"] else 0.0


def capacity_figure(workload: list[SimRequest], runs: list[dict[str, Any]], setups: list[RunSetup]) -> Any:
    """The workload's prefix hit rate against cache capacity, each tier's capacity, and each run's measured rate.

    A run's point sits at its total capacity (GPU, CPU tier and tiers below) at the height of
    :func:`measured_hit_rate`, the table's GPU and CPU columns added.  The legend sits to the
    right of the axes, never over the curve.
    """
    plt = pyplot()
    curve = capacity_curve(workload)
    caps = [float(c) for c in curve if c != "inf"]
    fig, ax = plt.subplots(figsize=(10, 4.8), layout="constrained")
    ax.plot(caps, [curve[str(round(c))] * 100 for c in caps], marker="o", color="tab:blue", label="LRU prefix cache")
    ax.axhline(curve["inf"] * 100, color="tab:gray", ls=":", lw=1, label=f"unbounded: {curve['inf']:.1%}")
    marks: dict[str, int] = {}
    for st in setups:
        marks.update(cache_tokens(st))
    for k, (name, tokens) in enumerate(sorted(marks.items(), key=lambda kv: kv[1])):
        ax.axvline(tokens, color="0.55", ls=("--", "-.", ":")[k % 3], lw=1, label=f"{name}: {tokens / 1e6:.3g}M tokens")
    colors = run_colors(runs)
    rates = []
    for r, st in zip(runs, setups, strict=True):
        rate = measured_hit_rate(r) * 100
        rates.append(rate)
        ax.plot([max(cache_tokens(st).values())], [rate], ls="none", marker="D", ms=6, color=colors[run_label(r)],
                label=f"{run_label(r)} (measured): {rate:.1f}%")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlim(1e4, 1e9)
    ax.set_ylim(0, max(5.0, curve["inf"] * 100 * 1.15, *(x * 1.15 for x in rates)))
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside right center", fontsize=8)
    return fig


def ttft_figure(runs: list[dict[str, Any]]) -> Any:
    """TTFT p50 and p90 per run, one pair of horizontal bars each, each p50 with its speed-up over its vs run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.55 * len(runs)), layout="constrained")
    ys = list(range(len(runs)))
    p50 = [r["ttft_s"]["p50"] for r in runs]
    ax.barh([y - 0.2 for y in ys], p50, height=0.4, label="p50", color="tab:blue")
    ax.barh([y + 0.2 for y in ys], [r["ttft_s"]["p90"] for r in runs], height=0.4, label="p90", color="tab:orange")
    for row, y, v in zip(rows(runs), ys, p50, strict=True):
        gain = f"  {speedup(row.ref['ttft_s']['p50'], v)} vs {row.ref['run']}" if row.ref is not None else ""
        ax.annotate(f"{v:.2f} s{gain}", (v, y - 0.2), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=8)  # fmt: skip
    ax.set_yticks(ys, [run_label(r) for r in runs], fontsize=8)
    ax.invert_yaxis()  # the first run on top, as in the tables
    ax.margins(x=0.45)
    ax.set_xlabel("time to first token (s); each p50 with its speed-up over the run it adds to")
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    return fig


def plot(
    workload: list[SimRequest], runs: list[dict[str, Any]], setups: list[RunSetup], outdir: Path, title: str
) -> list[Path]:
    """``prefix_hit_vs_capacity.png`` and ``ttft_per_run.png``."""
    return [
        save_figure(
            capacity_figure(workload, runs, setups),
            outdir / "prefix_hit_vs_capacity.png",
            f"{title}: prefix reuse against capacity",
        ),
        save_figure(ttft_figure(runs), outdir / "ttft_per_run.png", f"{title}: TTFT per run"),
    ]
