"""``tiered-kv validate``: the simulator's predictions against published measurements.

Each file in ``configs/validation/`` reproduces one published setup (same
model, GPU, lengths and concurrency) as an ordinary experiment config, plus a
``points:`` list.  A point names what to predict and what was published:

* ``metric``: one of :data:`SIM_METRICS` (read from a run's results) or, with
  ``kind: link``, one of :data:`LINK_METRICS` (measured on the simulated link
  alone, with ``bytes_per_copy`` and ``copies`` or ``vs_bytes_per_copy``);
* ``run``: the run it is read from; ``relative_to``: another run, to predict
  the ratio of the two; ``overrides``: dotted config keys changed for this
  point (a block size, a rate);
* ``published``: the number, compared as predicted / published, within
  ``tolerance`` (default 15%); or ``expect: {min:, max:}`` for a published
  direction or shape (the vLLM paper's "swap loses at small blocks");
* ``source``: where the number was published; ``fit``: true when the point was
  used to fit the hardware profile's step coefficients (it then checks the
  fit, not the model); ``reason``: why a point is known to be outside.

Runs are cached per (config, overrides), so a point costs one simulation at most.

A file of ``configs/validation/`` with an ``experiments`` list instead is a
set of measured runs (:mod:`~tiered_kv.sim.measured_runs`), compared run by
run by :mod:`~tiered_kv.sim.validate_runs`; :func:`validation_files` leaves
those to :func:`run_sets`.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, resolve_paths, setup
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.link import CopyGeometry, SimLink
from tiered_kv.sim.measured_runs import RunSet, is_run_set, load_run_set
from tiered_kv.sim.profiles import load_hardware
from tiered_kv.sim.schema import Field, choice, num, positive, validate
from tiered_kv.sim.shipped import shipped, shipped_names
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate
from tiered_kv.transfer.plan import CPU, GPU, PlanKind, TransferPlan

SIM_METRICS: dict[str, Callable[[dict[str, Any]], float]] = {
    "tpot_p50_ms": lambda r: r["tpot_s"]["p50"] * 1e3,
    "ttft_p50_ms": lambda r: r["ttft_s"]["p50"] * 1e3,
    "e2e_p50_ms": lambda r: r["e2e_s"]["p50"] * 1e3,
    "output_tps": lambda r: r["throughput_output_tps"],
    "request_tps": lambda r: r["throughput_rps"],
    "norm_latency_s": lambda r: r["norm_latency_s"],
}
LINK_METRICS = ("one_way_gbps", "bidir_gbps", "speedup")

POINT_SCHEMA = {
    "id": Field((str,)),
    "kind": choice("sim", "sim", "link"),
    "metric": Field((str,)),
    "run": Field((str,), None, nullable=True),
    "relative_to": Field((str,), None, nullable=True),
    "overrides": Field((dict,), None, nullable=True),
    "published": num(None, positive, nullable=True),
    "expect": {"min": num(None, nullable=True), "max": num(None, nullable=True)},
    "tolerance": num(0.15, positive),
    "unit": Field((str,), ""),
    "source": Field((str,)),
    "fit": Field((bool,), False),
    "reason": Field((str,), ""),
    "hardware": Field((str,), None, nullable=True),
    "direction": choice("H2D", "H2D", "D2H"),
    "bytes_per_copy": Field((int,), None, None, (positive,), nullable=True),
    "vs_bytes_per_copy": Field((int,), None, None, (positive,), nullable=True),
    "copies": Field((int,), 1000, None, (positive,)),
}


@dataclass
class Point:
    """One published number and the simulator's prediction of it."""

    file: str
    spec: dict[str, Any]
    predicted: float = math.nan
    hardware: str = ""

    @property
    def id(self) -> str:
        return self.spec["id"]

    @property
    def ratio(self) -> float | None:
        pub = self.spec["published"]
        return self.predicted / pub if pub else None

    @property
    def ok(self) -> bool:
        s = self.spec
        if s["published"] is not None:
            r = self.ratio
            return r is not None and abs(r - 1.0) <= s["tolerance"]
        lo, hi = s["expect"]["min"], s["expect"]["max"]
        return (lo is None or self.predicted >= lo) and (hi is None or self.predicted <= hi)

    @property
    def published_text(self) -> str:
        s = self.spec
        if s["published"] is not None:
            return f"{s['published']:g}"
        lo, hi = s["expect"]["min"], s["expect"]["max"]
        if lo is not None and hi is not None:
            return f"{lo:g}..{hi:g}"
        return f">= {lo:g}" if lo is not None else f"<= {hi:g}"


@dataclass
class ValidationFile:
    name: str
    raw: dict[str, Any]
    points: list[Point] = field(default_factory=list)


def load_file(path: Path | Any, name: str) -> ValidationFile:
    raw = read_yaml(path, f"validation {name}")
    if not isinstance(raw, dict):
        raise ConfigError(f"validation {name}: expected a mapping, got {type(raw).__name__}")
    if isinstance(path, Path):
        raw = resolve_paths(raw, path.resolve().parent)
    raw = copy.deepcopy(raw)
    specs = raw.pop("points", None)
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"validation {name}.points: must list at least one point")
    vf = ValidationFile(name, raw)
    for i, s in enumerate(specs):
        spec = validate(s, POINT_SCHEMA, f"validation {name}.points[{i}]")
        where = f"validation {name}.points[{i}]"
        if (spec["published"] is None) == (spec["expect"]["min"] is None and spec["expect"]["max"] is None):
            raise ConfigError(f"{where}: give either 'published' or 'expect' (min and/or max), not both or neither")
        allowed = LINK_METRICS if spec["kind"] == "link" else tuple(SIM_METRICS)
        if spec["metric"] not in allowed:
            raise ConfigError(f"{where}.metric: must be one of {list(allowed)}, got {spec['metric']!r}")
        if spec["kind"] == "link" and spec["bytes_per_copy"] is None:
            raise ConfigError(f"{where}.bytes_per_copy: a link point needs the bytes of one copy")
        vf.points.append(Point(name, spec))
    return vf


def _resolve(ref: str) -> tuple[Any, str]:
    p = Path(ref)
    if p.suffix in (".yaml", ".yml", ".json") and p.exists():
        return p, p.stem
    found = shipped("validation", ref)
    if found is None:
        raise ConfigError(
            f"validation: no config {ref!r} (shipped: {', '.join(shipped_names('validation'))}; or give a path)"
        )
    return found, ref


def _is_run_set_file(path: Any, name: str) -> bool:
    if str(path).endswith(".json"):
        return True
    return is_run_set(read_yaml(path, f"validation {name}"))


def validation_files(names: list[str] | None = None) -> list[ValidationFile]:
    """The shipped validation configs of published points (all, or those named), or files given by path.

    Sets of measured runs among them are left out (:func:`run_sets` reads those).
    """
    out = []
    for ref in names or shipped_names("validation"):
        path, name = _resolve(ref)
        if not _is_run_set_file(path, name):
            out.append(load_file(path, name))
    return out


def run_sets(names: list[str] | None = None) -> list[RunSet]:
    """The sets of measured runs among the shipped validation configs (all, or those named), or given by path."""
    out = []
    for ref in names or shipped_names("validation"):
        path, name = _resolve(ref)
        if _is_run_set_file(path, name):
            out.append(load_run_set(path, name))
    return out


def _key(overrides: dict[str, Any] | None) -> str:
    return json.dumps(overrides or {}, sort_keys=True)


class Predictor:
    """Runs the simulations the points need, each once; ``extra`` overrides apply to every config (fits)."""

    def __init__(self, extra: Callable[[ValidationFile], dict[str, Any]] | None = None) -> None:
        self.extra = extra
        self.cache: dict[tuple, dict[str, dict[str, Any]]] = {}
        self.simulations = 0

    def results(self, vf: ValidationFile, overrides: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        extra = self.extra(vf) if self.extra is not None else {}
        key = (vf.name, _key(overrides), _key(extra))
        if key not in self.cache:
            cfg = config_from_raw(vf.raw, vf.name, {**extra, **(overrides or {})})
            workload = generate(cfg["workload"], cfg["seed"])
            runs = {}
            for i in range(len(cfg["runs"])):
                res = Simulator(setup(cfg, i), workload).run()
                self.simulations += 1
                runs[res["run"]] = res
            self.cache[key] = runs
        return self.cache[key]

    def predict(self, vf: ValidationFile, p: Point) -> float:
        s = p.spec
        if s["kind"] == "link":
            hw = load_hardware(s["hardware"] or vf.raw.get("hardware", "h200"))
            p.hardware = hw.name
            return link_metric(hw.link, s)
        runs = self.results(vf, s["overrides"])
        # the GPU this point runs on: its own overrides may name another than the file's
        p.hardware = load_hardware(config_from_raw(vf.raw, vf.name, s["overrides"] or {})["hardware"]).name
        name = s["run"] or next(iter(runs))
        if name not in runs:
            raise ConfigError(f"validation {vf.name}.{p.id}.run: no run {name!r} (runs: {list(runs)})")
        value = SIM_METRICS[s["metric"]](runs[name])
        if s["relative_to"] is not None:
            if s["relative_to"] not in runs:
                raise ConfigError(
                    f"validation {vf.name}.{p.id}.relative_to: no run {s['relative_to']!r} (runs: {list(runs)})"
                )
            base = SIM_METRICS[s["metric"]](runs[s["relative_to"]])
            value = value / base if base else math.inf
        return value


def link_metric(link: Any, spec: dict[str, Any]) -> float:
    """Move ``copies`` copies of ``bytes_per_copy`` on the simulated link and measure the rate.

    ``one_way_gbps``: one direction alone.  ``bidir_gbps``: both directions at
    once, the total.  ``speedup``: one way at ``bytes_per_copy`` over one way
    at ``vs_bytes_per_copy`` (same total bytes).
    """

    def rate(nbytes: int, directions: tuple[str, ...]) -> float:
        loop = EventLoop()
        eng = SimLink(loop, link, CopyGeometry(nbytes, 1, "block_contiguous", coalesce=False))
        n = max(1, spec["copies"] * spec["bytes_per_copy"] // nbytes)
        for k, d in enumerate(directions):
            src, dst = (GPU, CPU) if d == "D2H" else (CPU, GPU)
            ids = tuple(range(1, n + 1))
            eng.submit(TransferPlan(k + 1, src, dst, ids, ids, PlanKind.COPY))
        while True:
            ev = loop.pop_until(math.inf)
            if ev is None:
                break
            eng.on_event(ev[2])
        return n * nbytes * len(directions) / loop.now / 1e9

    d = spec["direction"]
    if spec["metric"] == "one_way_gbps":
        return rate(spec["bytes_per_copy"], (d,))
    if spec["metric"] == "bidir_gbps":
        return rate(spec["bytes_per_copy"], ("H2D", "D2H"))
    return rate(spec["bytes_per_copy"], (d,)) / rate(spec["vs_bytes_per_copy"], (d,))


def run_validation(
    files: list[ValidationFile], predictor: Predictor | None = None, progress: Callable[[str], None] | None = None
) -> list[Point]:
    predictor = predictor or Predictor()
    points = []
    for vf in files:
        for p in vf.points:
            p.predicted = predictor.predict(vf, p)
            points.append(p)
            if progress is not None:
                progress(f"{vf.name}: {p.id}")
    return points


def table(points: list[Point]) -> str:
    """Predicted against published, one row per point; sources are listed below by number."""
    head = (
        f"{'#':>2} {'point':34} {'GPU':14} {'metric':15} {'predicted':>10} {'published':>11} {'ratio':>6} "
        f"{'use':5} {'status'}"
    )
    lines = [head, "-" * len(head)]
    sources: list[str] = []
    for i, p in enumerate(points, 1):
        s = p.spec
        metric = s["metric"] + (f" / {s['relative_to']}" if s["relative_to"] else "")
        ratio = f"{p.ratio:6.2f}" if p.ratio is not None else "     -"
        if p.ok:
            status = "ok"
        elif s["published"] is not None:
            status = f"OUTSIDE ±{s['tolerance'] * 100:.0f}%"
        else:
            status = "WRONG SHAPE"
        if not p.ok and s["reason"]:
            status += f": {s['reason']}"
        lines.append(
            f"{i:2d} {p.id[:34]:34} {p.hardware[:14]:14} {metric[:15]:15} {p.predicted:10.4g} "
            f"{p.published_text:>11} {ratio} {'fit' if s['fit'] else 'check':5} {status}"
        )
        sources.append(f"[{i}] {s['source']}")
    n_ok = sum(p.ok for p in points)
    checks = [p for p in points if not p.spec["fit"]]
    lines.append("")
    lines.append(
        f"{n_ok}/{len(points)} points within tolerance or of the published shape; "
        f"{sum(p.ok for p in checks)}/{len(checks)} of the points not used in any fit."
    )
    lines.append("")
    lines.extend(sources)
    return "\n".join(lines)


def rows(points: list[Point]) -> list[dict[str, Any]]:
    return [
        {
            "file": p.file,
            "id": p.id,
            "hardware": p.hardware,
            "metric": p.spec["metric"],
            "relative_to": p.spec["relative_to"],
            "predicted": p.predicted,
            "published": p.spec["published"],
            "expect": p.spec["expect"],
            "ratio": p.ratio,
            "ok": p.ok,
            "fit": p.spec["fit"],
            "source": p.spec["source"],
            "reason": p.spec["reason"],
        }
        for p in points
    ]
