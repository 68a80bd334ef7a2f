"""Simulation output: the KV demand, a regime's verdict, the JSON document and the matplotlib plots.

The tables are :mod:`tiered_kv.sim.run_tables`'; the trace's plots :mod:`tiered_kv.sim.trace_report`'s.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import OutputError
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.extras import import_extra
from tiered_kv.sim.files import make_dir, write_text
from tiered_kv.sim.run_tables import WIDTH


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
    bs = setup.manager.block_size
    sizes = sorted((-(-(r.prompt_len + len(r.output) - 1) // bs) for r in workload), reverse=True)
    k = min(setup.scheduler.max_num_seqs, len(sizes))
    return KVDemand(k, sum(sizes[:k]), max(setup.manager.num_gpu_blocks - 1, 1))


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


def fit_lines(emit: Callable[[str], None], width: int = WIDTH) -> Callable[[str], None]:
    """``emit`` with every line of a text longer than ``width`` wrapped, its continuation indented.

    Tables are built narrow (:mod:`tiered_kv.sim.run_tables`); this keeps the prose around
    them (the run's first line, a regime's verdict) within a terminal of 100 columns too.
    A word longer than the line (a long path) is kept whole.
    """

    def out(text: str) -> None:
        lines = []
        for line in text.split("\n"):
            if len(line) <= width:
                lines.append(line)
                continue
            indent = " " * (len(line) - len(line.lstrip(" ")) + 2)
            lines += textwrap.wrap(
                line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
            )
        emit("\n".join(lines))

    return out


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` with sorted keys, so equal results are equal files."""
    write_text(path, json.dumps(doc, indent=1, sort_keys=True), "--json")


def save_figure(fig: Any, path: Path, title: str) -> Path:
    """Title, lay out, write and close one figure; shared by every module that draws plots.

    A figure built with a layout engine (``layout="constrained"``, which makes room for
    a legend placed outside the axes) keeps it; any other is laid out tightly.  The
    figure is closed even when the write fails, so a failed ``--plots`` leaks no figures.

    Raises:
        OutputError: the file cannot be written (naming ``--plots`` and the path).
    """
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise OutputError(f"--plots {path}: cannot write ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (the ``sim`` extra; a clear error without it)."""
    matplotlib = import_extra("matplotlib", "--plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_label(run: dict[str, Any]) -> str:
    """A run's name in a legend: ``regime: run`` when the config has regimes."""
    return f"{run['regime']}: {run['run']}" if run.get("regime") else run["run"]


def run_colors(runs: Sequence[dict[str, Any]]) -> dict[str, str]:
    """One colour per run (by :func:`run_label`), the same in every panel and figure (a panel may show only some)."""
    return {run_label(r): f"C{k % 10}" for k, r in enumerate(runs)}


def usage_figure(runs: Sequence[dict[str, Any]]) -> Any:
    """GPU KV usage over time for every run; the CPU tier's panels only for runs that have a CPU tier.

    The simulator's usage samples are ``[time, GPU usage, CPU blocks held, CPU tier
    fill]``, each a fraction.  A run without a CPU tier has no CPU series at all (a
    flat zero would read as an empty tier).  A run without write-through still fills
    its CPU tier: swap-outs store their full blocks there, and they stay cached after
    the swap-in.  The legend sits under the panels, never over a curve.
    """
    plt = pyplot()
    colors = run_colors(runs)
    with_cpu = [r for r in runs if r["cpu_blocks"]]
    n = 3 if with_cpu else 1
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n + 1.2), sharex=True, squeeze=False, layout="constrained")
    axes = axes[:, 0]
    for r in runs:
        t = [u[0] for u in r["usage"]]
        axes[0].plot(t, [u[1] for u in r["usage"]], label=run_label(r), lw=1, color=colors[run_label(r)])
    axes[0].set_ylabel("GPU KV usage")
    if with_cpu:
        for r in with_cpu:
            t = [u[0] for u in r["usage"]]
            for ax, col in ((axes[1], 2), (axes[2], 3)):
                ax.plot(t, [u[col] for u in r["usage"]], lw=1, color=colors[run_label(r)], label=run_label(r))
        axes[1].set_ylabel("CPU tier: held\n(swapped, loading,\nbeing written)")
        axes[2].set_ylabel("CPU tier: fill\n(every cached block,\nwrite-through or swap-out)")
        if len(with_cpu) < len(runs):
            axes[1].set_title("CPU tier panels: runs with a CPU tier only", fontsize=9)
    axes[-1].set_xlabel("simulated time (s)")
    for ax in (axes[0], axes[-1]):  # fractions; the held panel keeps its own scale (a few percent)
        ax.set_ylim(-0.02, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()  # every run once (the CPU panels show some)
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(runs)), fontsize=8)
    return fig


def latency_figure(runs: Sequence[dict[str, Any]]) -> Any:
    """TTFT and end-to-end latency CDFs, one curve per run; the legend under the panels."""
    plt = pyplot()
    colors = run_colors(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), layout="constrained")
    for r in runs:
        for ax, key in zip(axes, ("ttft_s", "e2e_s"), strict=True):
            xs = r["latency_samples"][key]
            ax.plot(
                xs, [(i + 1) / len(xs) for i in range(len(xs))], lw=1, color=colors[run_label(r)], label=run_label(r)
            )
    axes[0].set_xlabel("time to first token (s)")
    axes[1].set_xlabel("end-to-end latency (s)")
    axes[0].set_ylabel("fraction of requests")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(runs)), fontsize=8)
    return fig


def policies_figure(runs: Sequence[dict[str, Any]]) -> Any:
    """Throughput, p99 end-to-end latency and preemptions by mode, one horizontal bar per run.

    The runs are rows named on the y axis (first run on top), so long names never
    overlap; each bar carries its value; the legend of the preemption modes sits
    under the panels.
    """
    plt = pyplot()
    names = [run_label(r) for r in runs]
    ys = list(range(len(runs)))
    fig, axes = plt.subplots(1, 3, figsize=(12, 1.2 + 0.45 * len(runs) + 0.9), sharey=True, layout="constrained")
    panels = (
        (axes[0], [r["throughput_rps"] for r in runs], "throughput (req/s)", "tab:blue", "{:.3g}"),
        (axes[1], [r["e2e_s"]["p99"] for r in runs], "p99 end-to-end latency (s)", "tab:orange", "{:.3g}"),
    )
    for ax, values, title, color, fmt in panels:
        bars = ax.barh(ys, values, color=color)
        ax.bar_label(bars, [fmt.format(v) for v in values], padding=2, fontsize=8)
        ax.set_title(title, fontsize=10)
    swap = [r["preemptions_swap"] for r in runs]
    rec = [r["preemptions_recompute"] for r in runs]
    axes[2].barh(ys, swap, color="tab:green", label="swap")
    bars = axes[2].barh(ys, rec, left=swap, color="tab:red", label="recompute")
    axes[2].bar_label(bars, [f"{a + b}" for a, b in zip(swap, rec, strict=True)], padding=2, fontsize=8)
    axes[2].set_title("preemptions, by mode", fontsize=10)
    axes[0].set_yticks(ys, names, fontsize=8)
    axes[0].invert_yaxis()  # the first run on top, as in the tables
    totals = (panels[0][1], panels[1][1], [a + b for a, b in zip(swap, rec, strict=True)])
    for ax, values in zip(axes, totals, strict=True):
        # room on the right for the values (explicit: a stacked bar's left edge would pin the autoscale)
        ax.set_xlim(0, 1.25 * max(values, default=0) or 1)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    return fig


def plot(runs: list[dict[str, Any]], outdir: Path, title: str) -> list[Path]:
    """Usage over time, latency CDFs, and the policies side by side."""
    make_dir(outdir, "--plots")
    return [
        save_figure(usage_figure(runs), outdir / "usage_over_time.png", f"{title}: KV usage over time"),
        save_figure(latency_figure(runs), outdir / "latency_cdf.png", f"{title}: latency CDFs"),
        save_figure(policies_figure(runs), outdir / "policies.png", f"{title}: policies side by side"),
    ]


def plot_sweep(rows: list[dict[str, Any]], outdir: Path, title: str) -> Path:
    plt = pyplot()
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
    return save_figure(fig, outdir / "sweep.png", title)
