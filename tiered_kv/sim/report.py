"""Simulation output: a terminal table, a JSON document and matplotlib plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import OutputError
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.extras import import_extra
from tiered_kv.sim.files import make_dir, write_text


@dataclass(frozen=True, slots=True)
class KVDemand:
    """The most KV a workload can hold on the GPU at once, against the GPU pool.

    At most ``max_num_seqs`` requests run at once, and never more than the
    workload has: the figure is the KV of the ``requests`` largest requests at
    full length (prompt and output, less the last sampled token, which is never
    computed), in whole blocks and without prefix sharing, over the pool's
    usable blocks (block 0 is the null block).  Above 1, the workload can
    oversubscribe the pool; below 1, it never fills it, whatever its timing.
    """

    requests: int
    blocks: int
    pool_blocks: int

    @property
    def ratio(self) -> float:
        return self.blocks / self.pool_blocks

    def describe(self, max_num_seqs: int) -> str:
        """The figure with what it is: which requests, and why no more of them."""
        why = f"no more than {max_num_seqs} run at once" if self.requests == max_num_seqs else "every request"
        return (
            f"KV demand: the {self.requests} largest requests at full length ({why}) = {self.ratio:.2f}x the GPU pool"
        )


def kv_demand(setup: RunSetup, workload: Sequence[Any]) -> KVDemand:
    """:class:`KVDemand` of ``workload`` under ``setup``'s GPU pool and ``max_num_seqs``."""
    bs = setup.block_size
    sizes = sorted((-(-(len(r.prompt) + len(r.output) - 1) // bs) for r in workload), reverse=True)
    k = min(setup.max_num_seqs, len(sizes))
    return KVDemand(k, sum(sizes[:k]), max(setup.num_gpu_blocks - 1, 1))


def regime_verdict(runs: list[dict[str, Any]], offered_rps: float) -> dict[str, Any]:
    """Below capacity or overloaded, from the measurements of the regime's first run (its baseline).

    Overloaded when requests wait in the queue for most of their time to first
    token (median wait for admission over median TTFT above one half), or when
    the runs finish fewer requests per second than arrive (below 90% of the
    offered rate, the queue grows).  Otherwise latency is service time.
    """
    base = runs[0]
    ttft = base["ttft_s"]["p50"]
    queue = base["queue_s"]["p50"]
    share = queue / ttft if ttft > 0 else 0.0
    served = base["throughput_rps"] / offered_rps if offered_rps > 0 else 1.0
    over = share > 0.5 or served < 0.9
    what = "overloaded: latency is queueing" if over else "below capacity: latency is service time"
    text = (
        f"{what} (baseline {base['run']}: median wait for admission {queue * 1e3:.0f} ms of "
        f"{ttft * 1e3:.0f} ms to first token; {base['throughput_rps']:.1f} requests/s served)"
    )
    return {"regime": "over" if over else "below", "queue_share_of_ttft": share, "served_share": served, "text": text}


def _gain(run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    """(throughput ratio, end-to-end p50 speed-up) of ``run`` over ``ref``; above 1 is better."""
    tput = run["throughput_rps"] / ref["throughput_rps"] if ref["throughput_rps"] else 0.0
    e2e = ref["e2e_s"]["p50"] / run["e2e_s"]["p50"] if run["e2e_s"]["p50"] else 0.0
    return tput, e2e


def table(runs: list[dict[str, Any]]) -> str:
    """One row per run; each run's gain is over the run it names in ``vs`` (its baseline), else the first run.

    The gain columns attribute the difference to what the run adds over its
    baseline: ``tput`` is the ratio of requests served per second, ``E2E`` the
    ratio of median end-to-end latencies (baseline / run), both above 1 when
    the run is better.
    """
    by_name = {r["run"]: r for r in runs}
    head = (
        f"{'run':20} {'req/s':>6} {'vs':>20} {'tput':>5} {'E2E':>5} {'out tok/s':>9} {'TTFT p50/p99 s':>15} "
        f"{'TPOT p50/p99 ms':>16} {'E2E p50/p99 s':>14} {'swap':>5} {'recmp':>5} {'GB out/in':>11} "
        f"{'recomp tok':>10} {'hit GPU/CPU':>11} {'xfer hid/exp s':>14} {'stall s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in runs:
        ref_name = r.get("vs") or (runs[0]["run"] if r is not runs[0] else None)
        ref = by_name.get(ref_name) if ref_name else None
        if ref is None:
            vs, tput, e2e = "(baseline)", "", ""
        else:
            g_tput, g_e2e = _gain(r, ref)
            vs, tput, e2e = ref["run"][:20], f"{g_tput:.2f}x", f"{g_e2e:.2f}x"
        lines.append(
            f"{r['run'][:20]:20} {r['throughput_rps']:6.2f} {vs:>20} {tput:>5} {e2e:>5} "
            f"{r['throughput_output_tps']:9.0f} "
            f"{r['ttft_s']['p50']:7.2f}/{r['ttft_s']['p99']:<7.2f} "
            f"{r['tpot_s']['p50'] * 1e3:7.1f}/{r['tpot_s']['p99'] * 1e3:<8.1f} "
            f"{r['e2e_s']['p50']:6.2f}/{r['e2e_s']['p99']:<7.2f} "
            f"{r['preemptions_swap']:5d} {r['preemptions_recompute']:5d} "
            f"{r['gb_swapped_out']:5.1f}/{r['gb_swapped_in']:<5.1f} {r['tokens_recomputed']:10d} "
            f"{r['gpu_prefix_hit_rate']:5.2f}/{r['cpu_prefix_hit_rate']:<5.2f} "
            f"{r['transfer_hidden_s']:6.2f}/{r['transfer_exposed_s']:<7.2f} {r.get('stall_s', 0.0):7.2f}"
        )
    notes = [f"  {r['run']}: {r['note']}" for r in runs if r.get("note")]
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines)


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` with sorted keys, so equal results are equal files."""
    write_text(path, json.dumps(doc, indent=1, sort_keys=True), "--json")


def _save(fig: Any, path: Path, title: str) -> Path:
    """Title, lay out, write and close one figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise OutputError(f"--plots {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return path


def plot(runs: list[dict[str, Any]], outdir: Path, title: str) -> list[Path]:
    """Usage over time, latency CDFs, and the policies side by side."""
    matplotlib = import_extra("matplotlib", "--plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    make_dir(outdir, "--plots")
    paths = []

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for r in runs:
        t = [u[0] for u in r["usage"]]
        for ax, col in zip(axes, (1, 2, 3), strict=True):
            ax.plot(t, [u[col] for u in r["usage"]], label=r["run"], lw=1)
    # The simulator's usage samples: [time, GPU usage, CPU blocks held, CPU tier fill], each a fraction.
    axes[0].set_ylabel("GPU KV usage")
    axes[1].set_ylabel("CPU KV held\n(swapped, loading,\nbeing written)")
    axes[2].set_ylabel("CPU tier fill\n(every cached block)")
    axes[2].set_xlabel("simulated time (s)")
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, outdir / "usage_over_time.png", f"{title}: KV usage over time"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in runs:
        for ax, key in zip(axes, ("ttft_s", "e2e_s"), strict=True):
            xs = r["latency_samples"][key]
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["run"], lw=1)
    axes[0].set_xlabel("time to first token (s)")
    axes[1].set_xlabel("end-to-end latency (s)")
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, outdir / "latency_cdf.png", f"{title}: latency CDFs"))

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    names = [r["run"] for r in runs]
    axes[0].bar(names, [r["throughput_rps"] for r in runs], color="tab:blue")
    axes[0].set_title("throughput (req/s)")
    axes[1].bar(names, [r["e2e_s"]["p99"] for r in runs], color="tab:orange")
    axes[1].set_title("p99 end-to-end latency (s)")
    axes[2].bar(names, [r["preemptions_swap"] for r in runs], label="swap", color="tab:green")
    axes[2].bar(
        names,
        [r["preemptions_recompute"] for r in runs],
        bottom=[r["preemptions_swap"] for r in runs],
        label="recompute",
        color="tab:red",
    )
    axes[2].set_title("preemptions")
    axes[2].legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.margins(y=0.12)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    paths.append(_save(fig, outdir / "policies.png", f"{title}: policies side by side"))
    return paths


def plot_sweep(rows: list[dict[str, Any]], outdir: Path, title: str) -> Path:
    matplotlib = import_extra("matplotlib", "--plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    make_dir(outdir, "--plots")
    rates = sorted({r["rate"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for run in dict.fromkeys(r["run"] for r in rows):
            pts = sorted((r["gpu_kv_gib"], r["throughput_rps"]) for r in rows if r["run"] == run and r["rate"] == rate)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run)
        ax.set_xlabel("GPU KV memory (GiB)")
        ax.set_ylabel("throughput (req/s)")
        ax.set_title(f"arrival rate {rate}/s")
        ax.legend(fontsize=8)
    return _save(fig, outdir / "sweep.png", title)
