"""Fit the step-time coefficients to published measurements (``python -m tiered_kv.sim.fit``).

The points marked ``fit: true`` in the given validation configs are
simulated with trial coefficients, and the coefficients that minimise the
sum of squared log ratios (predicted / published) are kept.  What is fitted:

* ``hbm_efficiency`` and ``prefill_mfu`` of each hardware profile among the
  points (the memory roof, and the compute roof of prefill chunks: properties
  of the GPU and its kernels);
* ``mfu``, ``step_overhead_s``, ``per_seq_s`` and ``frontend_s``, shared by all of
  them (the compute roof of decode rows, the serving engine's per-step and
  per-sequence overheads and its front end's cost per request: properties of
  the engine version, which the published points share).

Sharing keeps the fit over-determined (more points than coefficients), so
its residuals mean something.  The search is Nelder-Mead over bounded
transforms of the coefficients; every trial is a full simulation of every
fit point, so a fit takes minutes.  It prints the coefficients and the
residual of every point; they are copied into the hardware profiles by hand,
with the fit's date and residuals beside them.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tiered_kv.sim.config import config_from_raw
from tiered_kv.sim.profiles import load_hardware
from tiered_kv.sim.validate import Point, Predictor, ValidationFile, validation_files

SHARED = ("mfu", "step_overhead_s", "per_seq_s", "frontend_s")
PER_GPU = ("hbm_efficiency", "prefill_mfu")
# (low, high) bounds of each coefficient.
BOUNDS = {
    "mfu": (0.2, 0.9),
    "prefill_mfu": (0.2, 0.95),
    "hbm_efficiency": (0.4, 0.98),
    "step_overhead_s": (1e-5, 0.02),
    "per_seq_s": (1e-7, 1e-3),
    "frontend_s": (1e-4, 0.2),
}
# The config key each coefficient overrides.
KEYS = {k: f"compute.{k}" for k in BOUNDS}


def _to_unit(v: float, lo: float, hi: float) -> float:
    """A coefficient in (lo, hi) as an unbounded number (logit of its position, in log space for wide ranges)."""
    v = min(max(v, lo), hi)
    if hi / lo > 100:
        lo, hi, v = math.log(lo), math.log(hi), math.log(v)
    p = (v - lo) / (hi - lo)
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def _from_unit(x: float, lo: float, hi: float) -> float:
    p = 1.0 / (1.0 + math.exp(-x))
    if hi / lo > 100:
        return math.exp(math.log(lo) + p * (math.log(hi) - math.log(lo)))
    return lo + p * (hi - lo)


def nelder_mead(
    f: Callable[[list[float]], float], x0: list[float], step: float = 0.5, iters: int = 60, tol: float = 1e-4
) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (a small, dependency-free Nelder-Mead)."""
    n = len(x0)
    simplex = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [centroid[j] + (centroid[j] - worst[j]) for j in range(n)]
        fr = f(refl)
        if fr < values[0]:
            exp = [centroid[j] + 2 * (centroid[j] - worst[j]) for j in range(n)]
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = [centroid[j] + 0.5 * (worst[j] - centroid[j]) for j in range(n)]
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[best[j] + 0.5 * (x[j] - best[j]) for j in range(n)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=lambda k: values[k])
    return simplex[i], values[i]


def _fitted(p: Point) -> bool:
    return bool(p.spec["fit"]) and p.spec["kind"] == "sim"


def _scaled(p: Point, scale: float) -> Point:
    """``p`` with the requests of its run scaled (a faster search; ``validate`` then checks at full size)."""
    if scale == 1.0:
        return p
    spec = dict(p.spec)
    overrides = dict(spec["overrides"] or {})
    n = overrides.get("workload.num_requests")
    if n is not None:
        overrides["workload.num_requests"] = max(1, round(n * scale))
    spec["overrides"] = overrides
    return Point(p.file, spec)


class Fit:
    """The fit of the step coefficients over the ``fit`` points of ``files``."""

    def __init__(
        self, files: list[ValidationFile], emit: Callable[[str], None] = print, requests_scale: float = 1.0
    ) -> None:
        self.files = [
            ValidationFile(vf.name, vf.raw, [_scaled(p, requests_scale) for p in vf.points if _fitted(p)])
            for vf in files
        ]
        self.files = [vf for vf in self.files if vf.points]
        self.hardware = {vf.name: config_from_raw(vf.raw, vf.name)["hardware"] for vf in self.files}
        self.gpus = sorted(set(self.hardware.values()))
        self.names = [*SHARED, *(f"{k}[{g}]" for k in PER_GPU for g in self.gpus)]
        self.emit = emit
        self.trials = 0

    def coefficients(self, x: Sequence[float]) -> dict[str, float]:
        out = {}
        for name, v in zip(self.names, x, strict=True):
            base = name.split("[")[0]
            out[name] = _from_unit(v, *BOUNDS[base])
        return out

    def start(self, given: dict[str, float] | None = None) -> list[float]:
        """The profiles' current coefficients (the first GPU's for the shared ones), or those ``given``."""
        given = given or {}
        hw = {g: load_hardware(g) for g in self.gpus}
        first = hw[self.gpus[0]].step
        x = [_to_unit(given.get(k, getattr(first, k)), *BOUNDS[k]) for k in SHARED]
        x += [_to_unit(given.get(f"{k}[{g}]", getattr(hw[g].step, k)), *BOUNDS[k]) for k in PER_GPU for g in self.gpus]
        return x

    def points(self, coef: dict[str, float]) -> list[Point]:
        def extra(vf: ValidationFile) -> dict[str, Any]:
            g = self.hardware[vf.name]
            out = {KEYS[k]: coef[k] for k in SHARED}
            out.update({KEYS[k]: coef[f"{k}[{g}]"] for k in PER_GPU})
            return out

        pred = Predictor(extra)
        out = []
        for vf in self.files:
            for p in vf.points:
                q = Point(p.file, p.spec)
                q.predicted = pred.predict(vf, q)
                out.append(q)
        return out

    def loss(self, x: list[float]) -> float:
        coef = self.coefficients(x)
        pts = self.points(coef)
        value = sum(math.log(p.predicted / p.spec["published"]) ** 2 for p in pts)
        self.trials += 1
        shown = ", ".join(f"{k}={v:.4g}" for k, v in coef.items())
        self.emit(f"trial {self.trials}: loss {value:.5f}  {shown}")
        return value

    def run(self, iters: int, given: dict[str, float] | None = None) -> tuple[dict[str, float], list[Point]]:
        x, _ = nelder_mead(self.loss, self.start(given), step=1.0, iters=iters)
        coef = self.coefficients(x)
        return coef, self.points(coef)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tiered_kv.sim.fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="validation configs whose `fit: true` points are fitted")
    ap.add_argument("--iters", type=int, default=40, help="Nelder-Mead iterations (default 40)")
    ap.add_argument("--start", nargs="*", default=[], metavar="NAME=VALUE", help="starting coefficients")
    ap.add_argument(
        "--requests-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="scale the points' workload.num_requests during the search (default 1; the residuals printed "
        "at the end are at this scale too, so check the result with `tiered-kv validate`)",
    )
    args = ap.parse_args(argv)
    given = {k: float(v) for k, v in (item.split("=", 1) for item in args.start)}
    if not args.requests_scale > 0:
        ap.error(f"--requests-scale: must be > 0, got {args.requests_scale}")
    fit = Fit(
        validation_files(args.configs),
        emit=lambda s: print(s, file=sys.stderr, flush=True),
        requests_scale=args.requests_scale,
    )
    coef, points = fit.run(args.iters, given)
    print("coefficients:")
    for k, v in coef.items():
        print(f"  {k}: {v:.4g}")
    print("residuals (predicted / published):")
    for p in points:
        print(f"  {p.id}: {p.predicted:.4g} / {p.spec['published']:g} = {p.ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
