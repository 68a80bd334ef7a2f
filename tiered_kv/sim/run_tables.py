"""The tables ``tiered-kv simulate`` prints: a few narrow ones, each followed by a legend of its columns.

A regime's report is, in order: the runs (what each is, its CPU tier, the run it
adds to); latency (TTFT and E2E, with each run's speed-up over the run it adds
to); throughput and decode; preemptions and copies; where the prompts' KV came
from; and, when some run has a disk or remote tier, the tiers below the CPU (one
row per run and tier, in blocks of the run's block size: what each held, moved and
lost; the gains such a run makes are in the latency table, the share of prompt tokens
found below the GPU in the table of where the prompts' KV came from).  Every line fits
:data:`WIDTH` columns, and every column is explained, with its unit, in the legend
under its table.

A table is a list of :class:`Group` s of :class:`Column` s.  A group is a heading
over a few columns that share a quantity and a unit (``TTFT, s`` over ``p50 p90
p99 x``); a column is a heading, a width, a cell function and a legend.  Adding a
quantity is adding a column (or a group) to one of the tuples at the end of this
module; the header, the rows and the legend follow.

Speed-ups (``x``) compare a run with the run it adds to: its ``vs:`` in the
config, else the first run; the first run is the baseline (``-``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Every line printed fits a terminal of 100 columns.
WIDTH = 99
#: Run names are cut to this many characters in the tables (the runs list gives them whole).
NAME_WIDTH = 22


@dataclass(frozen=True, slots=True)
class RunRow:
    """One row of a table: a run's results, its number, and the run it is compared with.

    Attributes:
        run: The run's results (one entry of the results document's ``runs``).
        number: Its place in its regime's runs, from 1.
        ref: The results of the run it adds to (its ``vs``, else the first run); ``None`` for the first run.
        ref_number: That run's number.
        tier: For the table of tiers below the CPU: the tier's name and its counters.
    """

    run: dict[str, Any]
    number: int
    ref: dict[str, Any] | None = None
    ref_number: int | None = None
    tier: tuple[str, dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its heading, its width, the text of its cell in a row, and what it is (with its unit).

    ``key`` is what the legend names (default: the heading), so that one entry can
    explain a few columns (``p50 p90 p99``); a column whose heading an earlier entry
    of its table names has an empty ``legend``.
    """

    head: str
    width: int
    cell: Callable[[RunRow], str]
    legend: str
    key: str = ""


@dataclass(frozen=True, slots=True)
class Group:
    """Columns under one heading (``""``: none), which the legend explains once for all of them."""

    label: str
    legend: str
    columns: tuple[Column, ...]

    @property
    def width(self) -> int:
        return sum(c.width + 1 for c in self.columns)


@dataclass(frozen=True, slots=True)
class Table:
    """A titled table: ``#``, ``run``, then its groups of columns."""

    title: str
    groups: tuple[Group, ...]

    @property
    def columns(self) -> list[Column]:
        return [c for g in self.groups for c in g.columns]

    def head(self, name_w: int) -> list[str]:
        """The title, the group headings (if any), the column headings and a rule, for run names ``name_w`` wide."""
        lead = f"{'#':>2} {'run':<{name_w}}"
        lines = [self.title]
        if any(g.label for g in self.groups):
            top = " " * len(lead)
            for g in self.groups:
                top += f" {g.label:^{g.width - 1}}" if g.label else " " * g.width
            lines.append(top.rstrip())
        head = lead + "".join(f" {c.head:>{c.width}}" for c in self.columns)
        return [*lines, head, "-" * len(head)]

    def render(self, rows: Sequence[RunRow], legend: bool = True) -> str:
        """:meth:`head`, one line per row, then (with ``legend``) the legend."""
        name_w = min(NAME_WIDTH, max([3, *(len(r.run["run"]) for r in rows)]))
        lines = self.head(name_w)
        for r in rows:
            cells = "".join(f" {c.cell(r):>{c.width}}" for c in self.columns)
            lines.append(f"{r.number:>2} {r.run['run'][:name_w]:<{name_w}}{cells}")
        if legend:
            lines += self.legend()
        return "\n".join(lines)

    def legend(self) -> list[str]:
        """One entry per group heading and per column legend, in order (a heading that repeats is explained once)."""
        entries: list[tuple[str, str]] = []
        for g in self.groups:
            if g.label:
                entries.append((g.label, g.legend))
            for c in g.columns:
                if c.legend:
                    entries.append((c.key or c.head, c.legend))
        out = []
        for key, text in entries:
            out += textwrap.wrap(
                f"{key}: {text}", WIDTH, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False
            )
        return out


def rows(runs: Sequence[dict[str, Any]]) -> list[RunRow]:
    """A row per run, each with the run it is compared with: its ``vs``, else the first run (none for the first)."""
    number = {r["run"]: i + 1 for i, r in enumerate(runs)}
    out = []
    for i, r in enumerate(runs):
        ref_name = r.get("vs") or (runs[0]["run"] if i else None)
        ref = runs[number[ref_name] - 1] if ref_name in number else None
        out.append(RunRow(r, i + 1, ref, number[ref_name] if ref is not None else None))
    return out


# ---------------------------------------------------------------- cells


def speedup(before: float, after: float) -> str:
    """``before / after`` as ``"3.59x"`` (a time that fell, or a rate that rose, over ``after / before``)."""
    return f"{before / after:.2f}x" if before > 0 and after > 0 else "-"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _vs(r: RunRow) -> str:
    return str(r.ref_number) if r.ref_number is not None else "-"


def _p(key: str, q: str, scale: float = 1.0, fmt: str = ".2f") -> Callable[[RunRow], str]:
    return lambda r: f"{r.run[key][q] * scale:{fmt}}"


def _time_x(key: str) -> Callable[[RunRow], str]:
    return lambda r: speedup(r.ref[key]["p50"], r.run[key]["p50"]) if r.ref is not None else "-"


def _tput_x(r: RunRow) -> str:
    return speedup(r.run["throughput_rps"], r.ref["throughput_rps"]) if r.ref is not None else "-"


def _first(r: RunRow, where: str) -> str:
    lk = r.run["lookup_tokens"]["first"]
    return _pct(lk[where], lk["tokens"])


def _found_again(r: RunRow) -> str:
    lk = r.run["lookup_tokens"]["readmitted"]
    return f"{lk['gpu'] + lk['cpu']:d}"


def _hidden(r: RunRow) -> str:
    return _pct(r.run["transfer_hidden_s"], r.run["transfer_s"])


def _saved(r: RunRow) -> str:
    if r.ref is None:
        return "-"
    return f"{r.ref['tokens_computed'] - r.run['tokens_computed']:+d}"


def cpu_tier(run: dict[str, Any]) -> str:
    """What the run's CPU tier is and what writes it, and the tiers below it.

    A CPU tier without write-through still keeps the full blocks that swap-outs
    store in it, by hash, after they are swapped back in: later requests find
    them as prefix hits, so it is a prefix cache of swapped-out KV.
    """
    if not run["cpu_blocks"]:
        return "no CPU tier"
    what = {
        "write_through": "write-through and swap-outs",
        "write_back": "write-back and swap-outs",
        "none": "swap-outs only (no write-through)",
    }
    below = f"; below it: {run['tiers']}" if run.get("tiers") else ""
    return f"CPU tier {run['cpu_kv_gib']:.4g} GiB, filled by {what.get(run['offload'], run['offload'])}{below}"


def runs_list(runs: Sequence[dict[str, Any]]) -> str:
    """The runs, numbered as in the tables: the note, the CPU tier, and the run each adds to."""
    lines = ["runs (x in the tables: the speed-up over the run it adds to, its vs):"]
    for row in rows(runs):
        r = row.run
        parts = [p for p in (r.get("note"), cpu_tier(r)) if p]
        parts.append(f"vs {row.ref_number} {row.ref['run']}" if row.ref is not None else "the baseline")
        lines += textwrap.wrap(
            f"{row.number:>2} {r['run']}: " + "; ".join(parts),
            WIDTH,
            subsequent_indent="      ",
            break_on_hyphens=False,
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- the tables

_PCT = "percentiles over requests: the median, the 90th, the 99th"

LATENCY = Table(
    "latency",
    (
        Group("", "", (Column("vs", 3, _vs, "the number of the run this one adds to; x compares with it"),)),
        Group(
            "TTFT, s",
            "time to first token, seconds: from the request's arrival (the serving front end included) "
            "to its first output token",
            (
                Column("p50", 7, _p("ttft_s", "p50"), _PCT, "p50 p90 p99"),
                Column("p90", 7, _p("ttft_s", "p90"), ""),
                Column("p99", 7, _p("ttft_s", "p99"), ""),
                Column(
                    "x",
                    6,
                    _time_x("ttft_s"),
                    "speed-up of the median over the vs run's: its p50 / this p50 (>1: faster)",
                ),
            ),
        ),
        Group(
            "E2E, s",
            "end to end, seconds: from the request's arrival to its last output token",
            (
                Column("p50", 7, _p("e2e_s", "p50"), ""),
                Column("p99", 7, _p("e2e_s", "p99"), ""),
                Column("x", 6, _time_x("e2e_s"), ""),
            ),
        ),
        Group(
            "ITL, ms",
            "inter-token latency, milliseconds: the gaps between consecutive output tokens of a request, "
            "pooled over all requests (as vllm bench serve pools them)",
            (
                Column("p50", 7, _p("itl_s", "p50", 1e3, ".1f"), "percentiles over the pooled gaps", "p50 p99"),
                Column("p99", 7, _p("itl_s", "p99", 1e3, ".1f"), ""),
            ),
        ),
    ),
)

THROUGHPUT = Table(
    "throughput and decode",
    (
        Group(
            "",
            "",
            (
                Column(
                    "req/s",
                    6,
                    lambda r: f"{r.run['throughput_rps']:.3f}",
                    "requests per simulated second: all requests / the time the last one finished",
                ),
                Column("x", 6, _tput_x, "throughput over the vs run's (>1: more requests a second)"),
                Column(
                    "out tok/s",
                    9,
                    lambda r: f"{r.run['throughput_output_tps']:.0f}",
                    "output tokens per simulated second",
                ),
            ),
        ),
        Group(
            "TPOT, ms",
            "time per output token after the first, milliseconds: a request's (last token - first token) / "
            "(output tokens - 1)",
            (
                Column(
                    "p50",
                    7,
                    _p("tpot_s", "p50", 1e3, ".1f"),
                    "percentiles over requests: the median, the 99th",
                    "p50 p99",
                ),
                Column("p99", 7, _p("tpot_s", "p99", 1e3, ".1f"), ""),
            ),
        ),
    ),
)

PREEMPTION = Table(
    "preemptions and copies",
    (
        Group(
            "preempted",
            "preemptions, by what became of the victim's KV: swapped out to the CPU tier, or dropped",
            (
                Column("swap", 6, lambda r: f"{r.run['preemptions_swap']:d}", "swapped out, resumed later"),
                Column("recomp", 6, lambda r: f"{r.run['preemptions_recompute']:d}", "dropped; re-admitted as new"),
            ),
        ),
        Group(
            "swapped, GB",
            "KV copied by swaps, GB (1e9 bytes)",
            (
                Column("out", 6, lambda r: f"{r.run['gb_swapped_out']:.1f}", "GPU to CPU tier, by swap-outs"),
                Column("in", 6, lambda r: f"{r.run['gb_swapped_in']:.1f}", "CPU tier to GPU, by swap-ins"),
            ),
        ),
        Group(
            "victims' tokens",
            "tokens of recompute victims at their re-admission",
            (
                Column(
                    "recomputed",
                    10,
                    lambda r: f"{r.run['tokens_recomputed']:d}",
                    "computed a second time: their KV had been dropped",
                ),
                Column(
                    "found",
                    9,
                    _found_again,
                    "found still cached (GPU or CPU tier), so not recomputed: mostly the victim's own "
                    "KV, not reuse between requests (left out of the prefix hit rates)",
                ),
            ),
        ),
        Group(
            "copies",
            "every copy between the GPU and the CPU tier (swaps, prefix loads, stores)",
            (
                Column(
                    "busy s",
                    7,
                    lambda r: f"{r.run['transfer_s']:.1f}",
                    "seconds copies took, summed over copies (both directions)",
                ),
                Column(
                    "hidden",
                    6,
                    _hidden,
                    "share of those seconds during which the GPU computed: overlapped, they cost no time",
                ),
                Column(
                    "stall s",
                    7,
                    lambda r: f"{r.run.get('stall_s', 0.0):.1f}",
                    "seconds the GPU waited for copies (blocking copies; layer-wise loads arriving late)",
                ),
            ),
        ),
    ),
)

KV_SOURCES = Table(
    "where the prompts' KV came from",
    (
        Group(
            "prefix hits",
            "% of the prompt tokens of first admissions (re-admissions of preempted requests excluded, "
            "as in vLLM) found cached instead of computed: prefix reuse between requests, the quantity of "
            "prefix_hit_vs_capacity.png",
            (
                Column("GPU", 6, lambda r: _first(r, "gpu"), "in the GPU prefix cache"),
                Column(
                    "CPU",
                    6,
                    lambda r: _first(r, "cpu"),
                    "in the CPU tier, then loaded: stored there by write-through or by a swap-out, or staged "
                    "into it from a tier below",
                ),
            ),
        ),
        Group(
            "tokens computed",
            "tokens the GPU computed: prefill chunks and decodes",
            (
                Column("all", 10, lambda r: f"{r.run['tokens_computed']:d}", "by this run"),
                Column(
                    "saved",
                    10,
                    _saved,
                    "the vs run's minus this run's: computation this run's caches avoided",
                ),
            ),
        ),
        Group(
            "CPU tier, GB",
            "KV moved for prefixes, GB (1e9 bytes)",
            (
                Column(
                    "loaded",
                    7,
                    lambda r: f"{r.run['gb_onboarded']:.1f}",
                    "loaded from the CPU tier into the GPU as prefix hits (every admission, re-admissions included)",
                ),
                Column(
                    "stored",
                    7,
                    lambda r: f"{r.run['gb_offloaded']:.1f}",
                    "written into the CPU tier by write-through",
                ),
            ),
        ),
    ),
)

# ---------------------------------------------------------------- the tiers below the CPU


def has_tiers(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether some run had a tier below the CPU."""
    return any(r.get("lower_tiers") for r in runs)


def _tier_count(key: str) -> Any:
    return lambda r: f"{r.tier[1][key]:d}"


TIERS = Table(
    "tiers below the CPU",
    (
        Group("", "", (Column("tier", 6, lambda r: r.tier[0], "the tier (disk, remote), below the CPU tier"),)),
        Group(
            "blocks",
            "KV blocks of the run's block size",
            (
                Column(
                    "hit",
                    9,
                    _tier_count("hit_blocks"),
                    "prefix blocks of admitted requests it was the highest tier to hold",
                ),
                Column("loaded", 8, _tier_count("loaded_blocks"), "staged from this tier into the CPU tier"),
                Column("stored", 8, _tier_count("stored_blocks"), "written into this tier from the CPU tier"),
                Column(
                    "declined",
                    9,
                    _tier_count("declined_blocks"),
                    "hits not loaded: dearer than recomputing, or no room",
                ),
            ),
        ),
        Group(
            "",
            "",
            (
                Column("read s", 7, lambda r: f"{r.tier[1]['load_busy_s']:.1f}", "seconds its reads took"),
                Column(
                    "lost",
                    7,
                    lambda r: f"{r.run.get('chain_lost_blocks', 0):d}",
                    "blocks the CPU tier evicted while no tier below held them: their KV left every tier (per run)",
                ),
            ),
        ),
    ),
)


def tier_table(runs: Sequence[dict[str, Any]], legend: bool = True) -> str:
    """One row per run and tier below its CPU tier, numbered as in the other tables."""
    out = []
    for row in rows(runs):
        for name, counters in (row.run.get("lower_tiers") or {}).items():
            out.append(RunRow(row.run, row.number, row.ref, row.ref_number, (name, counters)))
    return TIERS.render(out, legend)


#: The tables of a regime's report, in order (then :data:`TIERS`, where a run has tiers below the CPU).
TABLES = (LATENCY, THROUGHPUT, PREEMPTION, KV_SOURCES)


def report(runs: Sequence[dict[str, Any]], legend: bool = True) -> str:
    """The runs list, then every table of :data:`TABLES` and, if some run has them, the tiers below the CPU.

    Each table is followed by its legend (``legend=False``: without).
    """
    rs = rows(runs)
    tables = [t.render(rs, legend) for t in TABLES]
    if has_tiers(runs):
        tables.append(tier_table(runs, legend))
    return "\n\n".join([runs_list(runs), *tables])
