"""Where a replayed trace's gain comes from: reuse per tier, prefill avoided, bytes moved; and its two plots.

For a workload replayed from a trace, ``simulate`` adds a table that explains
each run's difference from its baseline in the mechanisms' own units:

* prefix hit rate on the GPU and in the CPU tier, and tokens loaded from a disk
  or remote tier;
* tokens computed, and how many fewer than the baseline computed (prefill the
  run's caches avoided), with the tokens recomputed after preemptions;
* gigabytes swapped out and in, and loaded from the CPU tier as prefix hits.

And two plots: the workload's prefix hit rate against cache capacity (an LRU
prefix cache of ``C`` tokens, ``C`` from 10^4 to 10^9 on a log axis, as in
Mooncake's paper) with each run's capacity marked, and TTFT per run.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tiered_kv.sim import trace_stats
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.report import save_figure
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
    bs = st.block_size
    out = {"GPU": st.num_gpu_blocks * bs}
    total = out["GPU"]
    if st.num_cpu_blocks:
        total += st.num_cpu_blocks * bs
        out["+CPU"] = total
    for t in st.tiers.tiers:
        total += t.num_blocks * bs
        out[f"+{t.name}"] = total
    return out


def gains_table(runs: list[dict[str, Any]], block_size: int) -> str:
    """One row per run: hit rates, tokens computed against its baseline, recomputed tokens, GB moved."""
    by_name = {r["run"]: r for r in runs}
    head = (
        f"{'run':20} {'vs':>20} {'hit GPU':>7} {'hit CPU':>7} {'lower-tier tok':>14} {'computed tok':>12} "
        f"{'avoided vs base':>15} {'recomputed':>10} {'GB swap out/in':>14} {'GB from CPU':>11} {'TTFT p50 s':>10}"
    )
    lines = [
        "where the difference comes from (tokens of KV; 'avoided' = the baseline's computed tokens minus this run's):",
        head,
        "-" * len(head),
    ]
    for r in runs:
        ref = by_name.get(r.get("vs") or "") if r is not runs[0] else None
        if ref is None and r is not runs[0]:
            ref = runs[0]
        avoided = f"{ref['tokens_computed'] - r['tokens_computed']:+d}" if ref is not None else "(baseline)"
        lower = sum(t.get("loaded_blocks", 0) for t in (r.get("lower_tiers") or {}).values()) * block_size
        lines.append(
            f"{r['run'][:20]:20} {(ref['run'] if ref else '')[:20]:>20} {r['gpu_prefix_hit_rate']:7.1%} "
            f"{r['cpu_prefix_hit_rate']:7.1%} {lower:14d} {r['tokens_computed']:12d} {avoided:>15} "
            f"{r['tokens_recomputed']:10d} {r['gb_swapped_out']:6.1f}/{r['gb_swapped_in']:<7.1f} "
            f"{r['gb_onboarded']:11.1f} {r['ttft_s']['p50']:10.2f}"
        )
    return "\n".join(lines)


def plot(
    workload: list[SimRequest], runs: list[dict[str, Any]], setups: list[RunSetup], outdir: Path, title: str
) -> list[Path]:
    """``prefix_hit_vs_capacity.png`` and ``ttft_per_run.png`` (matplotlib, imported by the caller's check)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = capacity_curve(workload)
    caps = [float(c) for c in curve if c != "inf"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(caps, [curve[str(round(c))] * 100 for c in caps], marker="o", color="tab:blue", label="LRU prefix cache")
    ax.axhline(curve["inf"] * 100, color="tab:gray", ls=":", lw=1, label=f"unbounded: {curve['inf']:.1%}")
    marks: dict[str, int] = {}
    for st in setups:
        marks.update(cache_tokens(st))
    for k, (name, tokens) in enumerate(sorted(marks.items(), key=lambda kv: kv[1])):
        ax.axvline(tokens, color=f"C{k + 1}", ls="--", lw=1, label=f"{name}: {tokens / 1e6:.3g}M tokens")
    ax.set_xscale("log")
    ax.set_xlim(1e4, 1e9)
    ax.set_ylim(0, max(5.0, curve["inf"] * 100 * 1.15))
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    paths = [save_figure(fig, outdir / "prefix_hit_vs_capacity.png", f"{title}: prefix reuse against capacity")]

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["run"] for r in runs]
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["ttft_s"]["p50"] for r in runs], width=0.4, label="p50", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], [r["ttft_s"]["p90"] for r in runs], width=0.4, label="p90", color="tab:orange")
    ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, outdir / "ttft_per_run.png", f"{title}: TTFT per run"))
    return paths
