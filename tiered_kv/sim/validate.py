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
  fit, not the model); ``reason``: why a point is known to be outside;
* ``stage``: for a metric of :data:`STAGE_METRICS`, the stage of a
  ``workload.shared_prefix`` whose requests it averages (by send time; none: all
  requests);
* ``vs``: another point of the file, published and predicted alike: the table's
  *direction* column says whether the simulator moves the same way as the
  measurement from that point to this one (more load, a CPU tier, more memory).

Runs are cached per (config, overrides), so a point costs one simulation at most.

A file may also say ``pool_replicas: true`` (with ``workload.shared_prefix.replicas``
N): the measurement is of N servers behind a prefix-aware router, so every point is
predicted from the requests of all N servers' simulations together (each server
simulated on its own, :mod:`~tiered_kv.sim.shared_prefix`); such a file's points use
:data:`STAGE_METRICS`.  ``model: {profile: NAME, tensor_parallel: N}`` runs a shipped
model profile at another tensor-parallel degree.

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
from tiered_kv.sim import shared_prefix
from tiered_kv.sim.config import config_from_raw, resolve_paths, setup
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.link import CopyGeometry, SimLink
from tiered_kv.sim.measured_runs import RunSet, is_run_set, load_run_set
from tiered_kv.sim.profiles import load_hardware, model_profile_raw
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
    "itl_p99_ms": lambda r: r["itl_s"]["p99"] * 1e3,
    # vLLM's preemption counter (vllm:num_preemptions): every preemption, by either mode.
    "preemptions": lambda r: float(r["preemptions_recompute"] + r["preemptions_swap"]),
}
LINK_METRICS = ("one_way_gbps", "bidir_gbps", "speedup")
#: Means over the finished requests of a run (or of one stage, ``stage``), from their records:
#: time to first token and end to end from the send time, and the inter-token latency
#: ``(E2E - TTFT) / (output tokens - 1)`` of those means (as inference-perf's and the BLIS runs' means).
STAGE_METRICS = ("ttft_mean_s", "e2e_mean_s", "itl_mean_ms")

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
    "stage": Field((int,), None, nullable=True),
    "vs": Field((str,), None, nullable=True),
}


@dataclass
class Point:
    """One published number and the simulator's prediction of it."""

    file: str
    spec: dict[str, Any]
    predicted: float = math.nan
    hardware: str = ""
    base: Point | None = None  # the point named by ``vs``

    @property
    def direction(self) -> bool | None:
        """Whether prediction and publication move the same way from :attr:`base` to this point.

        ``None`` without a ``vs``.  A change counts by its sign; a published change of zero is
        matched by any predicted change within the point's tolerance of none.
        """
        b = self.base
        if b is None:
            return None
        pub, base_pub = self.spec["published"], b.spec["published"]
        pub_change = pub - base_pub
        pred_change = self.predicted - b.predicted
        if pub_change == 0:
            return abs(pred_change) <= self.spec["tolerance"] * abs(b.predicted)
        return (pub_change > 0) == (pred_change > 0) and pred_change != 0

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
    pool_replicas: bool = False


def _model_variant(raw: dict[str, Any], name: str) -> None:
    """``model: {profile: NAME, tensor_parallel: N}``: the shipped profile at that degree, in place."""
    m = raw.get("model")
    if isinstance(m, dict) and "profile" in m:
        extra = sorted(set(m) - {"profile", "tensor_parallel"})
        if extra:
            raise ConfigError(
                f"validation {name}.model.{extra[0]}: a profile variant takes only 'profile' and "
                "'tensor_parallel' (give the whole profile instead to change its shapes)"
            )
        variant = model_profile_raw(m["profile"], f"validation {name}.model.profile")
        if "tensor_parallel" in m:
            variant["tensor_parallel"] = m["tensor_parallel"]
            variant["name"] = f"{variant['name']} (TP={m['tensor_parallel']})"
        raw["model"] = variant


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
    pool = raw.pop("pool_replicas", False)
    if not isinstance(pool, bool):
        raise ConfigError(f"validation {name}.pool_replicas: expected true or false, got {pool!r}")
    _model_variant(raw, name)
    vf = ValidationFile(name, raw, pool_replicas=pool)
    for i, s in enumerate(specs):
        spec = validate(s, POINT_SCHEMA, f"validation {name}.points[{i}]")
        where = f"validation {name}.points[{i}]"
        if (spec["published"] is None) == (spec["expect"]["min"] is None and spec["expect"]["max"] is None):
            raise ConfigError(f"{where}: give either 'published' or 'expect' (min and/or max), not both or neither")
        allowed = LINK_METRICS if spec["kind"] == "link" else tuple(SIM_METRICS) + STAGE_METRICS
        if pool:
            allowed = STAGE_METRICS
        if spec["metric"] not in allowed:
            raise ConfigError(f"{where}.metric: must be one of {list(allowed)}, got {spec['metric']!r}")
        if spec["stage"] is not None and spec["metric"] not in STAGE_METRICS:
            raise ConfigError(f"{where}.stage: only the means {list(STAGE_METRICS)} are read per stage")
        if spec["vs"] is not None and spec["published"] is None:
            raise ConfigError(f"{where}.vs: a direction needs a published number at both ends ('published')")
        if spec["kind"] == "link" and spec["bytes_per_copy"] is None:
            raise ConfigError(f"{where}.bytes_per_copy: a link point needs the bytes of one copy")
        vf.points.append(Point(name, spec))
    by_id = {p.id: p for p in vf.points}
    for i, p in enumerate(vf.points):
        ref = p.spec["vs"]
        if ref is None:
            continue
        if ref not in by_id or ref == p.id:
            raise ConfigError(
                f"validation {name}.points[{i}].vs: no other point {ref!r} in the file (ids: {sorted(by_id)})"
            )
        if by_id[ref].spec["published"] is None or by_id[ref].spec["metric"] != p.spec["metric"]:
            raise ConfigError(
                f"validation {name}.points[{i}].vs: {ref!r} must publish the same metric ({p.spec['metric']})"
            )
        p.base = by_id[ref]
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


@dataclass(frozen=True, slots=True)
class Finished:
    """What a point reads of one finished request: send time, first token, last token, tokens out."""

    arrival: float
    first_token: float
    finish: float
    output_tokens: int


class Predictor:
    """Runs the simulations the points need, each once; ``extra`` overrides apply to every config (fits)."""

    def __init__(self, extra: Callable[[ValidationFile], dict[str, Any]] | None = None) -> None:
        self.extra = extra
        self.cache: dict[tuple, dict[str, dict[str, Any]]] = {}
        self.finished: dict[tuple, dict[str, list[Finished]]] = {}
        self.simulations = 0

    def _key(self, vf: ValidationFile, overrides: dict[str, Any] | None) -> tuple:
        extra = self.extra(vf) if self.extra is not None else {}
        return (vf.name, _key(overrides), _key(extra))

    def _run(self, vf: ValidationFile, overrides: dict[str, Any] | None) -> tuple:
        key = self._key(vf, overrides)
        if key in self.cache:
            return key
        extra = self.extra(vf) if self.extra is not None else {}
        given = {**extra, **(overrides or {})}
        cfg = config_from_raw(vf.raw, vf.name, given)
        replicas: list[int | None] = [None]
        if vf.pool_replicas:
            sp = cfg["workload"].get("shared_prefix")
            if sp is None:
                raise ConfigError(
                    f"validation {vf.name}.pool_replicas: pools the servers of a workload.shared_prefix "
                    "with replicas N; this workload has no shared_prefix section"
                )
            replicas = list(range(shared_prefix.parse(sp)["replicas"]))
        runs: dict[str, dict[str, Any]] = {}
        done: dict[str, list[Finished]] = {}
        for rep in replicas:
            c = (
                cfg
                if rep is None
                else config_from_raw(vf.raw, vf.name, {**given, "workload.shared_prefix.replica": rep})
            )
            workload = generate(c["workload"], c["seed"])
            for i in range(len(c["runs"])):
                sim = Simulator(setup(c, i), workload)
                res = sim.run()
                self.simulations += 1
                runs.setdefault(res["run"], res)
                done.setdefault(res["run"], []).extend(
                    Finished(r.arrival, r.first_token, r.finish, r.output_tokens)
                    for r in sim.records.values()
                    if r.finish >= 0 and r.first_token >= 0
                )
        self.cache[key] = runs
        self.finished[key] = done
        return key

    def results(self, vf: ValidationFile, overrides: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        """Each run's results document (of server 0 when the file pools servers)."""
        return self.cache[self._run(vf, overrides)]

    def requests(self, vf: ValidationFile, overrides: dict[str, Any] | None) -> dict[str, list[Finished]]:
        """Each run's finished requests (of every server when the file pools them)."""
        return self.finished[self._run(vf, overrides)]

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
        if s["relative_to"] is not None and s["relative_to"] not in runs:
            raise ConfigError(
                f"validation {vf.name}.{p.id}.relative_to: no run {s['relative_to']!r} (runs: {list(runs)})"
            )
        if s["metric"] in STAGE_METRICS:
            done = self.requests(vf, s["overrides"])
            stages = self._stages(vf, p)
            if stages is not None and stages[1] > 0:
                for run_name in {name, s["relative_to"] or name}:
                    check_drained(done[run_name], stages, f"validation {vf.name}.{p.id} ({run_name})")
            value = stage_metric(done[name], s["metric"], s["stage"], stages)
            if s["relative_to"] is not None:
                base = stage_metric(done[s["relative_to"]], s["metric"], s["stage"], stages)
                value = value / base if base else math.inf
            return value
        value = SIM_METRICS[s["metric"]](runs[name])
        if s["relative_to"] is not None:
            base = SIM_METRICS[s["metric"]](runs[s["relative_to"]])
            value = value / base if base else math.inf
        return value

    def _stages(self, vf: ValidationFile, p: Point) -> tuple[list[tuple[float, float]], float] | None:
        """The shared-prefix stages and their gap, when the point reads one stage."""
        if p.spec["stage"] is None:
            return None
        sp = config_from_raw(vf.raw, vf.name, p.spec["overrides"] or {})["workload"].get("shared_prefix")
        if sp is None:
            raise ConfigError(
                f"validation {vf.name}.{p.id}.stage: stages are a workload.shared_prefix's; this has none"
            )
        spec = shared_prefix.parse(sp)
        if not 0 <= p.spec["stage"] < len(spec["stages"]):
            raise ConfigError(
                f"validation {vf.name}.{p.id}.stage: the workload has stages 0 to {len(spec['stages']) - 1}, "
                f"got {p.spec['stage']}"
            )
        return spec["stages"], spec["stage_gap_s"]


def check_drained(done: list[Finished], stages: tuple[list[tuple[float, float]], float], where: str) -> None:
    """Refuse stages that overlap: with a ``stage_gap_s`` the client waits for each stage to drain.

    inference-perf starts a stage only after every request of the previous one has finished; the
    simulation stands for that only if each stage's last request finished before the next stage's
    first was sent.
    """
    starts = shared_prefix.stage_starts(stages[0], stages[1])
    last: dict[int, float] = {}
    for r in done:
        k = shared_prefix.stage_of(r.arrival, stages[0], stages[1])
        last[k] = max(last.get(k, 0.0), r.finish)
    for k, t in sorted(last.items()):
        if k + 1 < len(starts) and t > starts[k + 1]:
            raise ConfigError(
                f"{where}: stage {k}'s last request finished at {t:.1f} s, after stage {k + 1} started at "
                f"{starts[k + 1]:.1f} s; the client waits for a stage to drain, so raise "
                "workload.shared_prefix.stage_gap_s"
            )


def stage_metric(
    done: list[Finished], metric: str, stage: int | None, stages: tuple[list[tuple[float, float]], float] | None
) -> float:
    """A mean of :data:`STAGE_METRICS` over the requests sent in ``stage`` (all of them for ``None``)."""
    if stage is not None:
        assert stages is not None, "a stage's metric needs the stages"
        done = [r for r in done if shared_prefix.stage_of(r.arrival, stages[0], stages[1]) == stage]
    if not done:
        return math.nan
    ttft = sum(r.first_token - r.arrival for r in done) / len(done)
    e2e = sum(r.finish - r.arrival for r in done) / len(done)
    if metric == "ttft_mean_s":
        return ttft
    if metric == "e2e_mean_s":
        return e2e
    tokens = sum(r.output_tokens for r in done) / len(done)
    return (e2e - ttft) / (tokens - 1) * 1e3 if tokens > 1 else math.nan


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
        f"{'use':5} {'dir':8} {'status'}"
    )
    lines = [head, "-" * len(head)]
    sources: list[str] = []
    row_of = {(p.file, p.id): i for i, p in enumerate(points, 1)}
    for i, p in enumerate(points, 1):
        s = p.spec
        metric = s["metric"] + (f"@{s['stage']}" if s["stage"] is not None else "")
        metric += f" / {s['relative_to']}" if s["relative_to"] else ""
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
            f"{p.published_text:>11} {ratio} {'fit' if s['fit'] else 'check':5} {_direction_text(p, row_of):8} {status}"
        )
        sources.append(f"[{i}] {s['source']}")
    n_ok = sum(p.ok for p in points)
    checks = [p for p in points if not p.spec["fit"]]
    lines.append("")
    lines.append(
        f"{n_ok}/{len(points)} points within tolerance or of the published shape; "
        f"{sum(p.ok for p in checks)}/{len(checks)} of the points not used in any fit."
    )
    pairs = [p for p in points if p.direction is not None]
    if pairs:
        lines.append(
            f"Direction of change (dir: from the row after # to this one) the same as published in "
            f"{sum(bool(p.direction) for p in pairs)} of {len(pairs)} pairs."
        )
    lines.append("")
    lines.extend(sources)
    return "\n".join(lines)


def _direction_text(p: Point, row_of: dict[tuple[str, str], int]) -> str:
    """``same #N`` or ``REV #N`` against the point ``vs`` names (row ``N``), blank without one."""
    if p.direction is None or p.base is None:
        return ""
    return f"{'same' if p.direction else 'REV'} #{row_of[(p.base.file, p.base.id)]}"


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
            "stage": p.spec["stage"],
            "vs": p.spec["vs"],
            "direction_same": p.direction,
        }
        for p in points
    ]
