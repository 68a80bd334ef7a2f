"""Measured runs against the simulator: per run, stage and metric, measured, predicted and their ratio.

The real-run half of ``tiered-kv validate`` (the published points are
:mod:`tiered_kv.sim.validate`'s).  Each run of a set
(:mod:`~tiered_kv.sim.measured_runs`) is simulated once, at full length; the
predicted TTFT, ITL and E2E means of every measured stage are compared with
the measured ones.  A set is summarised by the median absolute error
(``|predicted / measured - 1|``) and the count within ±15%, for its stages
(each stage of each run: a single-stage run's one stage is its whole run)
and for its whole-run means (``summary``), over the runs used to fit, the
runs used only to check, and all of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.measured_runs import METRICS, MeasuredRun, RunSet, predicted_metrics, run_config, stages_of
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

TOLERANCE = 0.15
SHORT = {"ttft_mean_ms": "TTFT", "itl_mean_ms": "ITL", "e2e_mean_ms": "E2E"}


@dataclass(frozen=True)
class MetricRow:
    """One measured mean and its prediction."""

    set_name: str
    run: str
    stage: str
    metric: str
    measured: float
    predicted: float
    fit: bool

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    @property
    def error(self) -> float:
        return abs(self.ratio - 1.0)

    @property
    def ok(self) -> bool:
        return self.error <= TOLERANCE


def simulate_run(
    run: MeasuredRun,
    engine: str,
    overrides: dict[str, Any] | None = None,
    stage_scale: float = 1.0,
    hardware: Any = None,
) -> tuple[dict[str, dict[str, float]], Simulator]:
    """Simulate one measured run; its predicted means per stage, and the simulator (for its records and steps).

    ``overrides`` are dotted config keys (a fit's trial coefficients); ``stage_scale`` shortens every
    stage (a fit's faster search).
    """
    raw = run_config(run, engine, stage_scale, hardware)
    cfg = config_from_raw(raw, raw["name"], overrides)
    sim = Simulator(setup(cfg, 0), generate(cfg["workload"], cfg["seed"]))
    sim.run()
    return predicted_metrics(run, list(sim.records.values()), stages_of(cfg["workload"])), sim


def rows_of(run: MeasuredRun, predicted: dict[str, dict[str, float]]) -> list[MetricRow]:
    out = []
    for stage in run.stages:
        if stage not in predicted:
            continue
        for metric in METRICS:
            measured = float(run.raw["measured"][stage][metric])
            out.append(MetricRow(run.set_name, run.id, stage, metric, measured, predicted[stage][metric], run.fit))
    return out


def validate_set(
    rs: RunSet,
    progress: Callable[[str], None] | None = None,
    overrides: dict[str, Any] | None = None,
    hardware: Any = None,
    stage_scale: float = 1.0,
    skipped: list[tuple[str, str]] | None = None,
    uncalibrated: list[tuple[str, str]] | None = None,
) -> list[MetricRow]:
    """Simulate every run of ``rs`` (at full length, unless ``stage_scale``); its rows, run by run.

    ``hardware``: a profile to simulate every run on instead of each run's own.  A run the
    simulator cannot express (a model with no profile, one that does not fit its GPU) is not
    simulated: with ``skipped`` given, ``(run id, reason)`` is appended to it and the others go on;
    without, the error is raised.  ``uncalibrated``: ``(run id, why)`` is appended to it for each run
    whose GPU profile has no step model of the set's engine era (it ran with the uncalibrated default).
    """
    out: list[MetricRow] = []
    for run in rs.runs:
        try:
            predicted, sim = simulate_run(run, rs.engine, overrides, stage_scale, hardware)
        except ConfigError as exc:
            if skipped is None:
                raise
            skipped.append((run.id, str(exc)))
            continue
        if uncalibrated is not None and sim.setup.uncalibrated:
            uncalibrated.append((run.id, sim.setup.uncalibrated))
        out.extend(rows_of(run, predicted))
        if progress is not None:
            progress(f"{rs.name}: {run.id}")
    return out


@dataclass(frozen=True)
class Summary:
    """Median absolute error and the count within ±15% of some rows."""

    label: str
    n: int
    median_abs_error: float
    within: int

    def line(self) -> str:
        if not self.n:
            return f"  {self.label:34} (none)"
        return (
            f"  {self.label:34} median abs error {self.median_abs_error * 100:5.1f}%, "
            f"{self.within:3d} of {self.n:3d} within ±{TOLERANCE * 100:.0f}% ({self.within / self.n * 100:.0f}%)"
        )


def summarise(rows: list[MetricRow], label: str) -> Summary:
    errs = [r.error for r in rows]
    return Summary(label, len(rows), statistics.median(errs) if errs else float("nan"), sum(r.ok for r in rows))


def summaries(rows: list[MetricRow]) -> list[Summary]:
    """Per stage and whole-run means, over fit, check and all runs (module docstring)."""
    out = []
    for kind, pick in (("stages", lambda r: r.stage != "summary"), ("whole runs", lambda r: r.stage == "summary")):
        chosen = [r for r in rows if pick(r)]
        for which, sel in (("check", lambda r: not r.fit), ("fit", lambda r: r.fit), ("all", lambda r: True)):
            part = [r for r in chosen if sel(r)]
            if part:
                out.append(summarise(part, f"{kind}, {which} runs"))
        for metric in METRICS:
            out.append(summarise([r for r in chosen if r.metric == metric], f"{kind}, all runs, {SHORT[metric]}"))
    return out


def table(
    rs: RunSet,
    rows: list[MetricRow],
    skipped: list[tuple[str, str]] | None = None,
    uncalibrated: list[tuple[str, str]] | None = None,
) -> str:
    """Measured against predicted, one row per run, stage and metric; then the set's summaries.

    ``skipped``: runs that were not simulated, each with its reason (listed, counted in no summary).
    ``uncalibrated``: runs simulated with the uncalibrated default step model, each with the note
    that says so (listed above the table: their predictions are not a calibrated GPU's).
    """
    head = f"{'run':18} {'stage':7} {'metric':6} {'measured':>9} {'predicted':>9} {'ratio':>6} {'use':5} status"
    lines = [f"{rs.name}: measured runs of {rs.engine} (means in ms)"]
    notes: dict[str, list[str]] = {}
    for run_id, why in uncalibrated or []:
        notes.setdefault(why, []).append(run_id)
    lines.extend(f"note: runs {', '.join(ids)}: {why}" for why, ids in notes.items())
    lines += [head, "-" * len(head)]
    for r in rows:
        status = "ok" if r.ok else f"OUTSIDE ±{TOLERANCE * 100:.0f}%"
        lines.append(
            f"{r.run[:18]:18} {r.stage:7} {SHORT[r.metric]:6} {r.measured:9.2f} {r.predicted:9.2f} "
            f"{r.ratio:6.2f} {'fit' if r.fit else 'check':5} {status}"
        )
    lines.append("")
    lines.append(f"{rs.name}:")
    lines.extend(s.line() for s in summaries(rows))
    fit = sorted({r.run for r in rows if r.fit})
    check = sorted({r.run for r in rows if not r.fit})
    lines.append(f"  fit on: {', '.join(fit) or '(none)'}; only checked: {', '.join(check) or '(none)'}")
    for run_id, reason in skipped or []:
        lines.append(f"  NOT SIMULATED {run_id}: {reason}")
    return "\n".join(lines)


def row_dicts(rows: list[MetricRow]) -> list[dict[str, Any]]:
    return [
        {
            "set": r.set_name,
            "run": r.run,
            "stage": r.stage,
            "metric": r.metric,
            "measured": r.measured,
            "predicted": r.predicted,
            "ratio": r.ratio,
            "ok": r.ok,
            "fit": r.fit,
        }
        for r in rows
    ]


def summary_dicts(rows: list[MetricRow]) -> list[dict[str, Any]]:
    return [
        {"label": s.label, "n": s.n, "median_abs_error": s.median_abs_error, "within_15pct": s.within}
        for s in summaries(rows)
    ]
