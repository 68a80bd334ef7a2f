"""Fit a GPU's step model to measured serving runs: the simulator, linearised about its own schedule.

What is fitted (:data:`COEFFS`), for one GPU and one engine era: the serving
front end's cost per request (``frontend_s``), the engine's cost per step
(``step_overhead_s``), per decoder layer in a step (``per_layer_s``) and per
request in a step (``per_seq_s``), and the fraction of the HBM bandwidth that
weight and KV reads reach (``hbm_efficiency``).  The compute efficiencies
(``mfu``, ``prefill_mfu``) are kept as given: a serving run whose prefix cache
is warm decodes at the memory roof and prefills a few tokens a request, so it
does not constrain them (:attr:`RunFit.compute_bound_share` says how many of
the simulated steps were compute-bound).

How (a Gauss-Newton iteration on the simulator itself):

1. Simulate every run with the current coefficients, recording each step's
   terms (:meth:`~tiered_kv.sim.compute.ComputeModel.parts`) and when it ran.
2. Every measured mean is then, for that schedule, a linear function of the
   coefficients: a request's TTFT is the front end, the rest of the step in
   progress when it reached the scheduler and every step up to its first
   token; its E2E adds the steps to its last token; each step is ``per_step +
   per_layer x layers + per_seq x requests + bytes / (HBM x efficiency)`` (a
   compute-bound step's compute time and every all-reduce are constants).
   Summed over a stage's requests this gives one linear equation per measured
   mean (ITL: ``(E2E - TTFT) / (client tokens - 1)``).
3. The coefficients that minimise the squared *relative* errors within
   :data:`BOUNDS` are found by bounded least squares (:func:`bounded_lstsq`),
   and the next simulation runs with them (damped, so that a run near
   saturation, whose batch grows with its steps, does not oscillate).

At the fixed point the linear predictions are the simulator's own: the fit
is of the simulator, queueing, batching and async scheduling included, not of
a formula beside it.  A few iterations converge (each one prints its
coefficients and its relative error).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from tiered_kv.errors import ConfigError
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.measured_runs import MeasuredRun, group_by_stage, output_len_of, run_config, stages_of
from tiered_kv.sim.profiles import StepProfile
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

COEFFS = ("frontend_s", "step_overhead_s", "per_layer_s", "per_seq_s", "hbm_efficiency")
#: (low, high) of each fitted coefficient: physical limits, wide enough never to bind on a sane fit.
BOUNDS = {
    "frontend_s": (0.0, 0.2),
    "step_overhead_s": (0.0, 0.02),
    "per_layer_s": (0.0, 2e-4),
    "per_seq_s": (0.0, 5e-4),
    "hbm_efficiency": (0.3, 1.0),
}


class _Recording:
    """A step-time model that records every step's terms while the real one prices it (duck-typed for the simulator)."""

    def __init__(self, real: ComputeModel) -> None:
        self.real = real
        self.frontend_s = real.frontend_s
        self.scheduler_steps = real.scheduler_steps
        self.parts: list[Any] = []

    def step_time(self, *args: Any) -> float:
        self.parts.append(self.real.parts(*args))
        return self.real.step_time(*args)


@dataclass(frozen=True)
class Equation:
    """One measured mean as a linear function of ``x`` (:func:`to_x`): ``a . x + c``."""

    run: str
    stage: str
    metric: str
    measured: float
    a: tuple[float, ...]
    c: float

    def predict(self, x: Sequence[float]) -> float:
        return sum(ai * xi for ai, xi in zip(self.a, x, strict=True)) + self.c


def to_x(coef: dict[str, float], hbm_bytes_per_s: float) -> list[float]:
    """The coefficients as the linear unknowns: the efficiency as seconds per byte, ``1 / (HBM x eff)``."""
    return [
        coef["frontend_s"],
        coef["step_overhead_s"],
        coef["per_layer_s"],
        coef["per_seq_s"],
        1.0 / (hbm_bytes_per_s * coef["hbm_efficiency"]),
    ]


def from_x(x: Sequence[float], hbm_bytes_per_s: float) -> dict[str, float]:
    return {
        "frontend_s": x[0],
        "step_overhead_s": x[1],
        "per_layer_s": x[2],
        "per_seq_s": x[3],
        "hbm_efficiency": 1.0 / (hbm_bytes_per_s * x[4]),
    }


def x_bounds(hbm_bytes_per_s: float) -> list[tuple[float, float]]:
    lo, hi = BOUNDS["hbm_efficiency"]
    return [BOUNDS[k] for k in COEFFS[:4]] + [(1.0 / (hbm_bytes_per_s * hi), 1.0 / (hbm_bytes_per_s * lo))]


def linearize(
    run: MeasuredRun,
    engine: str,
    coef: dict[str, float],
    fixed: dict[str, float],
    stage_scale: float = 1.0,
    hardware: Any = None,
) -> tuple[list[Equation], dict[str, Any]]:
    """Simulate ``run`` with ``coef`` (and ``fixed``: mfu, prefill_mfu) and linearise its measured means.

    Returns the equations (one per measured stage and metric; the whole run's when no stage is
    measured) and facts of the simulation (the share of compute-bound steps, the GPU's HBM bandwidth).
    """
    overrides = {f"compute.{k}": v for k, v in {**fixed, **coef}.items()}
    raw = run_config(run, engine, stage_scale, hardware)
    cfg = config_from_raw(raw, raw["name"], overrides)
    st = setup(cfg, 0)
    rec = _Recording(st.compute)
    sim = Simulator(
        replace(st, compute=cast(ComputeModel, rec)), generate(cfg["workload"], cfg["seed"]), keep_timeline=True
    )
    sim.run()
    steps, parts = sim.steps or [], rec.parts
    assert len(steps) == len(parts), "one recorded step-time call per simulated step"
    layers = float(st.model.num_layers)
    u = 1.0 / (st.hardware.hbm_bytes_per_s * coef["hbm_efficiency"])
    # Prefix sums over the steps of each coefficient's factor (per_step, per_layer, per_seq, seconds
    # per byte), of the constant part (a compute-bound step's compute, every all-reduce) and of the
    # step's length, so that a request's window of steps costs O(1).
    n_steps = len(parts)
    pre = [[0.0] * (n_steps + 1) for _ in range(6)]
    bound = 0
    for i, p in enumerate(parts):
        memory_bound = p.memory_bytes * u >= p.compute_s
        bound += not memory_bound
        row = (
            1.0,
            layers,
            float(p.num_seqs),
            p.memory_bytes if memory_bound else 0.0,
            (0.0 if memory_bound else p.compute_s) + p.allreduce_s,
            steps[i].end - steps[i].start,
        )
        for k in range(6):
            pre[k][i + 1] = pre[k][i] + row[k]
    ends = [s.end for s in steps]
    front = coef["frontend_s"]
    groups = group_by_stage(list(sim.records.values()), stages_of(cfg["workload"]))
    measured = run.raw["measured"]
    wanted = [s for s in run.stages if s != "summary"] or ["summary"]
    eqs: list[Equation] = []
    for stage in wanted:
        recs = groups.get(stage, [])
        if not recs:
            continue
        # per window kind: the factors of (front, per_step, per_layer, per_seq, seconds per byte) and a constant
        sums = {"ttft": [0.0] * 6, "e2e": [0.0] * 6}
        for r in recs:
            t0 = r.arrival + front
            s0 = bisect.bisect_right(ends, t0)
            frac = 1.0
            if s0 < n_steps and steps[s0].start < t0 and ends[s0] > steps[s0].start:
                frac = (ends[s0] - t0) / (ends[s0] - steps[s0].start)
            for key, end_t in (("ttft", r.first_token), ("e2e", r.finish)):
                last = bisect.bisect_left(ends, end_t - 1e-12)  # the step that ends at end_t
                acc = sums[key]
                acc[0] += 1.0
                if last < s0:  # no step in the window (it cannot happen to a finished request)
                    acc[5] += end_t - t0
                    continue
                for k in range(4):
                    acc[k + 1] += frac * (pre[k][s0 + 1] - pre[k][s0]) + pre[k][last + 1] - pre[k][s0 + 1]
                konst = frac * (pre[4][s0 + 1] - pre[4][s0]) + pre[4][last + 1] - pre[4][s0 + 1]
                covered = frac * (pre[5][s0 + 1] - pre[5][s0]) + pre[5][last + 1] - pre[5][s0 + 1]
                acc[5] += konst + (end_t - t0) - covered  # plus idle time, which is no step's
        n = len(recs)
        a_t = tuple(v / n for v in sums["ttft"][:5])
        a_e = tuple(v / n for v in sums["e2e"][:5])
        c_t, c_e = sums["ttft"][5] / n, sums["e2e"][5] / n
        m = measured[stage]
        tokens = float(m.get("client_output_mean") or output_len_of(run))
        ms = 1e3
        eqs.append(Equation(run.id, stage, "ttft_mean_ms", m["ttft_mean_ms"], tuple(v * ms for v in a_t), c_t * ms))
        eqs.append(Equation(run.id, stage, "e2e_mean_ms", m["e2e_mean_ms"], tuple(v * ms for v in a_e), c_e * ms))
        scale = ms / (tokens - 1)
        eqs.append(
            Equation(
                run.id,
                stage,
                "itl_mean_ms",
                m["itl_mean_ms"],
                tuple((e - t) * scale for e, t in zip(a_e, a_t, strict=True)),
                (c_e - c_t) * scale,
            )
        )
    facts = {"compute_bound": bound, "steps": n_steps, "hbm_bytes_per_s": st.hardware.hbm_bytes_per_s}
    return eqs, facts


def bounded_lstsq(
    rows: Sequence[Sequence[float]], rhs: Sequence[float], bounds: Sequence[tuple[float, float]], sweeps: int = 4000
) -> list[float]:
    """``argmin ||rows x - rhs||^2`` with ``lo <= x <= hi``: cyclic coordinate descent on the scaled columns.

    Convex, so it converges to the bounded minimum; a few parameters need no library.
    """
    n = len(bounds)
    norms = [math.sqrt(sum(r[k] ** 2 for r in rows)) or 1.0 for k in range(n)]
    cols = [[r[k] / norms[k] for r in rows] for k in range(n)]
    lo = [b[0] * norms[k] for k, b in enumerate(bounds)]
    hi = [b[1] * norms[k] for k, b in enumerate(bounds)]
    y = [min(max(0.5 * (lo[k] + hi[k]), lo[k]), hi[k]) if math.isfinite(hi[k]) else lo[k] for k in range(n)]
    resid = [rhs[i] - sum(cols[k][i] * y[k] for k in range(n)) for i in range(len(rhs))]
    for _ in range(sweeps):
        moved = 0.0
        for k in range(n):
            col = cols[k]
            step = sum(c * r for c, r in zip(col, resid, strict=True))  # columns have unit norm
            new = min(max(y[k] + step, lo[k]), hi[k])
            d = new - y[k]
            if d:
                y[k] = new
                for i, c in enumerate(col):
                    resid[i] -= c * d
                moved = max(moved, abs(d) / (abs(new) + 1e-30))
        if moved < 1e-12:
            break
    return [y[k] / norms[k] for k in range(n)]


def solve(eqs: Sequence[Equation], hbm_bytes_per_s: float, held: dict[int, float] | None = None) -> list[float]:
    """The bounded least-squares ``x`` of the equations' relative errors; ``held``: index -> value kept."""
    rows = [[ai / e.measured for ai in e.a] for e in eqs]
    rhs = [1.0 - e.c / e.measured for e in eqs]
    bounds = x_bounds(hbm_bytes_per_s)
    for k, v in (held or {}).items():
        bounds[k] = (v, v)
    return bounded_lstsq(rows, rhs, bounds)


def check_enough(runs: Sequence[MeasuredRun]) -> list[str]:
    """Refuse runs that cannot determine the coefficients; the names of those held at their start instead.

    Every coefficient needs measured means that move it apart from the others: at least two
    measured loads (a run's stages, or runs) and more means than coefficients; ``per_layer_s``
    needs models of two depths, else it cannot be told from ``step_overhead_s`` and keeps its value.
    """
    loads = sum(len([s for s in r.stages if s != "summary"]) or 1 for r in runs)
    means = 3 * loads
    if loads < 2 or means <= len(COEFFS):
        raise ConfigError(
            f"calibrate: {len(runs)} run(s) with {loads} measured load(s) ({means} means) cannot determine the "
            f"{len(COEFFS)} coefficients ({', '.join(COEFFS)}); measure at least two loads"
        )
    depths = set()
    for r in runs:
        from tiered_kv.sim.measured_runs import model_of
        from tiered_kv.sim.profiles import load_model

        depths.add(load_model(model_of(r)).num_layers)
    return [] if len(depths) > 1 else ["per_layer_s"]


@dataclass
class RunFit:
    """The result of :func:`fit_runs`: the coefficients and the last simulation's equations.

    The last iteration simulates at the fitted coefficients, so each equation's prediction at
    them is the simulator's own mean.
    """

    coef: dict[str, float]
    fixed: dict[str, float]
    equations: list[Equation] = field(default_factory=list)
    iterations: int = 0
    compute_bound_share: float = 0.0
    hbm_bytes_per_s: float = 0.0
    held: list[str] = field(default_factory=list)

    def residuals(self) -> list[tuple[Equation, float]]:
        """Each equation and its ratio, predicted / measured, at the fitted coefficients."""
        x = to_x(self.coef, self.hbm_bytes_per_s)
        return [(e, e.predict(x) / e.measured) for e in self.equations]

    def median_abs_error(self) -> float:
        return statistics.median(abs(r - 1) for _, r in self.residuals())


def fit_runs(
    runs: Sequence[MeasuredRun],
    engine: str,
    start: StepProfile,
    iters: int = 6,
    stage_scale: float = 0.25,
    damping: float = 0.7,
    emit: Callable[[str], None] | None = None,
    hardware: Any = None,
    final_scale: float = 1.0,
) -> RunFit:
    """Fit :data:`COEFFS` to ``runs`` (all on one GPU), starting from ``start`` (module docstring).

    ``stage_scale`` shortens the runs' stages during the iterations, ``final_scale`` in the last one
    (the residuals); the compute efficiencies stay ``start``'s.  ``hardware``: the GPU's profile
    (default: each run's own).  A coefficient the runs cannot determine apart from the others
    (:func:`check_enough`) keeps ``start``'s value, and :attr:`RunFit.held` names it.
    """
    if not runs:
        raise ConfigError("calibrate: no runs to fit")
    held_names = check_enough(runs)
    coef = {k: float(getattr(start, k)) for k in COEFFS}
    if "per_layer_s" in held_names:
        coef["per_layer_s"] = 0.0  # one depth: per-layer and per-step costs are one constant, fitted as the latter
    fixed = {"mfu": start.mfu, "prefill_mfu": start.prefill_mfu}
    result = RunFit(coef, fixed, held=held_names)
    for it in range(iters + 1):
        last = it == iters
        eqs: list[Equation] = []
        bound = steps = 0
        bw = 0.0
        for run in runs:
            e, facts = linearize(run, engine, coef, fixed, final_scale if last else stage_scale, hardware)
            eqs.extend(e)
            bound += facts["compute_bound"]
            steps += facts["steps"]
            bw = facts["hbm_bytes_per_s"]
        x0 = to_x(coef, bw)
        err0 = statistics.median(abs(e.predict(x0) / e.measured - 1) for e in eqs)
        result = RunFit(dict(coef), fixed, eqs, it, bound / max(steps, 1), bw, held_names)
        if emit is not None:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in coef.items())
            emit(f"iteration {it}: median relative error {err0 * 100:.1f}% over {len(eqs)} means; {shown}")
        if last:
            break
        x1 = solve(eqs, bw, {COEFFS.index(k): x0[COEFFS.index(k)] for k in held_names})
        xd = [a + damping * (b - a) for a, b in zip(x0, x1, strict=True)]
        coef = from_x(xd, bw)
    return result
