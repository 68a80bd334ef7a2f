"""The report of the tiers below the CPU: what each tier of each run held, moved and lost.

Printed after a regime's other tables (:mod:`tiered_kv.sim.run_tables`) when some
run has a disk or remote tier: one row per run and tier, in blocks of the run's
block size.  The gains such a run makes are in the latency table, against the
run it adds to; the share of prompt tokens found below the GPU is in the table
of where the prompts' KV came from.
"""

from __future__ import annotations

from typing import Any

from tiered_kv.sim.run_tables import Column, Group, RunRow, Table, rows


def has_tiers(runs: list[dict[str, Any]]) -> bool:
    """Whether some run had a tier below the CPU."""
    return any(r.get("lower_tiers") for r in runs)


def _count(key: str) -> Any:
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
                    _count("hit_blocks"),
                    "prefix blocks of admitted requests it was the highest tier to hold",
                ),
                Column("loaded", 8, _count("loaded_blocks"), "staged from this tier into the CPU tier"),
                Column("stored", 8, _count("stored_blocks"), "written into this tier from the CPU tier"),
                Column(
                    "declined", 9, _count("declined_blocks"), "hits not loaded: dearer than recomputing, or no room"
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


def tier_table(runs: list[dict[str, Any]], legend: bool = True) -> str:
    """One row per run and tier below its CPU tier, numbered as in the other tables."""
    out = []
    for row in rows(runs):
        for name, counters in (row.run.get("lower_tiers") or {}).items():
            out.append(RunRow(row.run, row.number, row.ref, row.ref_number, (name, counters)))
    return TIERS.render(out, legend)
