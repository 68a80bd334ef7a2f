"""The report of the tiers below the CPU: where each run's prefixes came from, and what each tier bought.

Printed after the main table when some run of a regime has a disk or remote
tier.  Per run: its gains over the run it names in ``vs`` (requests per second,
median TTFT), the share of prompt tokens past the GPU that were loaded rather
than recomputed (from the CPU tier or staged through it), and per tier below
the CPU the prefix blocks it was the highest tier to hold (``hit``), the
blocks it loaded into the CPU tier (``load``), the blocks written to it
(``stored``) and the simulated seconds its read lane was busy.  ``lost``
counts blocks the CPU tier evicted while no tier below held them.
"""

from __future__ import annotations

from typing import Any


def has_tiers(runs: list[dict[str, Any]]) -> bool:
    """Whether some run had a tier below the CPU."""
    return any(r.get("lower_tiers") for r in runs)


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den else "-"


def tier_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: gains over its ``vs`` run, where its prefixes were found, what each lower tier moved."""
    by_name = {r["run"]: r for r in runs}
    # A column per tier any run has, highest first as the runs list them.
    names = list(dict.fromkeys(name for r in runs for name in r.get("lower_tiers") or {}))
    cols = "".join(f" {name + ' hit/load/stored':>28} {name + ' rd s':>10}" for name in names)
    head = f"{'run':20} {'vs':>20} {'tput':>6} {'TTFT':>6} {'loaded past GPU':>15}{cols} {'lost':>7}"
    lines = ["tiers below the CPU (blocks)", head, "-" * len(head)]
    for r in runs:
        ref = by_name.get(r.get("vs") or "")
        if ref is None:
            vs, tput, ttft = "(baseline)", "", ""
        else:
            vs = ref["run"][:20]
            tput = _ratio(r["throughput_rps"], ref["throughput_rps"])
            ttft = _ratio(ref["ttft_s"]["p50"], r["ttft_s"]["p50"])
        row = f"{r['run'][:20]:20} {vs:>20} {tput:>6} {ttft:>6} {r['cpu_prefix_hit_rate']:15.2f}"
        tiers = r.get("lower_tiers") or {}
        for name in names:
            t = tiers.get(name)
            if t is None:
                row += f" {'-':>28} {'-':>10}"
            else:
                moved = f"{t['hit_blocks']}/{t['loaded_blocks']}/{t['stored_blocks']}"
                row += f" {moved:>28} {t['load_busy_s']:10.2f}"
        row += f" {r.get('chain_lost_blocks', 0):7d}" if tiers else f" {'-':>7}"
        lines.append(row)
    notes = [f"  {r['run']}: {r['tiers']}" for r in runs if r.get("tiers")]
    return "\n".join(lines + notes)
