"""Measured serving runs: a file of real vLLM runs, simulated run by run and compared metric by metric.

A *run set* is a JSON or YAML file with an ``experiments`` list, in the format
of the BLIS / inference-sim campaign's runs (the project's own copy of the
numbers it uses is ``configs/validation/vllm-0.15.1-h100-runs.yaml``; a
held-out file of the same format is judged with ``tiered-kv validate --runs
FILE``).  Each experiment gives:

* ``id``; ``model`` (its Hugging Face id) and optionally ``sim_model`` (the
  name of a model profile); ``hw`` (``H100``, ``A100``, ``L40S``, ``H200``)
  and optionally ``hw_profile`` (a hardware profile's name); ``tp``;
* vLLM's settings: ``max_num_batched_tokens``, ``max_num_seqs``,
  ``gpu_memory_utilization``, ``cpu_offload`` and ``cpu_kv_gib_per_gpu``
  (the CPU offloading connector's size on each GPU);
* ``workload``: ``n_sys``, ``n_users``, ``sys_len``, ``question_len``,
  ``output_len``, ``stages`` and optionally ``prompt_len`` (the measured mean
  prompt length, which the simulation uses: :func:`workload_of`);
* ``vllm_kv_blocks`` (``gpu_blocks``, ``cpu_blocks``; or null);
* ``measured``: per stage (``stage0`` ...) and for the whole run
  (``summary``), the means ``ttft_mean_ms``, ``e2e_mean_ms``,
  ``itl_mean_ms`` and the output tokens the client counted,
  ``client_output_mean``.

The set may also say which runs were used to fit (``split: {fit: [ids]}``)
and which engine ran them (``engine``, default ``vllm-0.15.1``).

How a run is simulated (:func:`run_config`): the hardware profile it names
(``hw_profile``, else the one its ``hw`` matches, :data:`GPU_PROFILES`); the
model profile ``sim_model`` names (without a ``model-`` prefix, ``.yaml`` or
``-tpN``), else the one whose ``hf_repo`` is ``model``, at the run's TP; the
workload as :mod:`~tiered_kv.sim.shared_prefix`; block size 16; chunked
prefill; the CPU offloading connector as a write-through CPU tier of
``cpu_kv_gib_per_gpu``.

How it is compared (:func:`predicted_metrics`): the mean TTFT and E2E of the
simulated requests sent in each stage (and all of them for ``summary``); and
the ITL as the campaign defines it, ``(E2E - TTFT) / (output tokens - 1)``
with the output tokens *the client counted* (``client_output_mean``): the
server generates ``output_len`` tokens (``ignore_eos``), but the client
re-tokenizes the text, and for Llama-2 it counts about a fifth fewer; the
same formula on the predicted means compares like with like.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim import shared_prefix
from tiered_kv.sim.engine_version import DEFAULT_ENGINE, parse_engine
from tiered_kv.sim.files import read_text
from tiered_kv.sim.profiles import load_model, model_profile_raw
from tiered_kv.sim.shipped import shipped, shipped_names

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

METRICS = ("ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms")
#: ``hw`` names (lowercased, as measured runs give them) -> shipped hardware profile.
GPU_PROFILES = (
    ("h200", "h200"),
    ("h100", "h100-sxm"),
    ("l40s", "l40s"),
    ("a100-40", "a100-sxm4-40gb"),
    ("a100-sxm4-40", "a100-sxm4-40gb"),
    ("a100-pcie", "a100-80gb-pcie"),
    ("a100", "a100-80gb-sxm"),
)
BLOCK_SIZE = 16  # vLLM's default on CUDA


@dataclass
class MeasuredRun:
    """One measured run of a set (module docstring)."""

    raw: dict[str, Any]
    set_name: str
    fit: bool = False

    @property
    def id(self) -> str:
        return str(self.raw["id"])

    @property
    def stages(self) -> list[str]:
        """The measured stages in order (``stage0`` ...), then ``summary`` when given."""
        keys = sorted((k for k in self.raw["measured"] if k.startswith("stage")), key=lambda k: int(k[5:]))
        return keys + (["summary"] if "summary" in self.raw["measured"] else [])


@dataclass
class RunSet:
    """A file of measured runs: its name, the engine that ran them, and the runs."""

    name: str
    engine: str
    runs: list[MeasuredRun] = field(default_factory=list)
    description: str = ""

    def select(self, which: str) -> list[MeasuredRun]:
        """``fit``, ``check`` (the runs not used to fit) or ``all``."""
        if which == "all":
            return list(self.runs)
        return [r for r in self.runs if r.fit == (which == "fit")]


def is_run_set(raw: Any) -> bool:
    return isinstance(raw, dict) and "experiments" in raw


def _need(d: Any, key: str, where: str, types: tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"{where}.{key}: required key is missing")
    v = d[key]
    if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
        names = "/".join(t.__name__ for t in types)
        raise ConfigError(f"{where}.{key}: expected {names}, got {type(v).__name__} {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}.{key}: must be a finite number, got {v!r}")
    return v


def _check_run(e: Any, where: str) -> None:
    if not isinstance(e, dict):
        raise ConfigError(f"{where}: expected a mapping (one measured run), got {type(e).__name__}")
    _need(e, "id", where, (str, int))
    _need(e, "model", where, (str,))
    _need(e, "hw", where, (str,))
    tp = _need(e, "tp", where, (int,))
    if tp < 1:
        raise ConfigError(f"{where}.tp: must be >= 1, got {tp}")
    for k in ("max_num_batched_tokens", "max_num_seqs"):
        if _need(e, k, where, (int,)) < 1:
            raise ConfigError(f"{where}.{k}: must be >= 1, got {e[k]}")
    gmu = _need(e, "gpu_memory_utilization", where, (int, float))
    if not 0 < gmu <= 1:
        raise ConfigError(f"{where}.gpu_memory_utilization: must be in (0, 1], got {gmu}")
    if "sim_workload" in e:  # a run read from another format (tiered_kv.sim.measurements): a workload section
        _need(e, "sim_workload", where, (dict,))
        n_stages = 1
    else:
        w = _need(e, "workload", where, (dict,))
        workload_of(e, f"{where}.workload")  # every workload key checked
        n_stages = len(w["stages"])
    m = _need(e, "measured", where, (dict,))
    if not m:
        raise ConfigError(f"{where}.measured: lists no stage (stage0, ..., summary)")
    for k, v in m.items():
        if not (k == "summary" or (re.fullmatch(r"stage\d+", k) and int(k[5:]) < n_stages)):
            raise ConfigError(
                f"{where}.measured.{k}: not a stage of the workload (stage0 to stage{n_stages - 1}, or summary)"
            )
        for metric in METRICS:
            x = _need(v, metric, f"{where}.measured.{k}", (int, float))
            if x <= 0:
                raise ConfigError(f"{where}.measured.{k}.{metric}: must be > 0, got {x}")
        if "client_output_mean" in v and v["client_output_mean"] is not None:
            co = _need(v, "client_output_mean", f"{where}.measured.{k}", (int, float))
            if co <= 1:
                raise ConfigError(f"{where}.measured.{k}.client_output_mean: must be > 1 token, got {co}")
    if e.get("cpu_offload"):
        gib = _need(e, "cpu_kv_gib_per_gpu", where, (int, float))
        if gib <= 0:
            raise ConfigError(f"{where}.cpu_kv_gib_per_gpu: must be > 0 with cpu_offload, got {gib}")


def parse_run_set(raw: Any, name: str) -> RunSet:
    """A run set from a parsed file; every key the simulation needs is checked and named (``name.experiments[i]``)."""
    if not is_run_set(raw):
        got = f"keys {sorted(raw)[:6]}" if isinstance(raw, dict) else type(raw).__name__
        raise ConfigError(
            f"{name}: not a file of measured runs (it needs an 'experiments' list, in the format of "
            f"configs/validation/vllm-0.15.1-h100-runs.yaml; got {got})"
        )
    exps = raw["experiments"]
    if not isinstance(exps, list) or not exps:
        raise ConfigError(f"{name}.experiments: must list at least one measured run")
    engine = raw.get("engine", DEFAULT_ENGINE)
    parse_engine(engine, f"{name}.engine")
    for i, e in enumerate(exps):
        _check_run(e, f"{name}.experiments[{i}]")
    ids = [str(e["id"]) for e in exps]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ConfigError(f"{name}.experiments: run ids must be unique, {dup[0]!r} appears twice")
    fit_ids: set[str] = set()
    split = raw.get("split")
    if split is not None:
        if not isinstance(split, dict) or not isinstance(split.get("fit"), list):
            raise ConfigError(f"{name}.split: expected {{fit: [run ids]}}, got {split!r}")
        fit_ids = {str(i) for i in split["fit"]}
        unknown = sorted(fit_ids - set(ids))
        if unknown:
            raise ConfigError(f"{name}.split.fit: no run {unknown[0]!r} in the set")
    desc = raw.get("description", "")
    runs = [MeasuredRun(e, name, str(e["id"]) in fit_ids) for e in exps]
    return RunSet(name, engine, runs, desc if isinstance(desc, str) else "")


def load_run_set(path: Path | Traversable, name: str | None = None) -> RunSet:
    """Read a run set (JSON, or YAML with the ``sim`` extra) from ``path``."""
    label = name or Path(str(path)).stem
    text = read_text(path, label)
    if str(path).endswith(".json"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{label}: '{path}' is not JSON ({exc})") from None
    else:
        from tiered_kv.sim.files import read_yaml

        raw = read_yaml(path, label)
    return parse_run_set(raw, label)


def workload_of(e: dict[str, Any], where: str = "workload") -> dict[str, Any]:
    """The run's ``workload.shared_prefix`` section.

    The system prompt keeps its ``sys_len`` tokens; the question takes the rest of the
    measured mean prompt (``prompt_len``, the client's count), else ``question_len``.
    """
    w = e["workload"] if "workload" in e else None
    if not isinstance(w, dict):
        raise ConfigError(f"{where}: required key is missing")
    for k in ("n_sys", "n_users", "sys_len", "question_len", "output_len"):
        v = _need(w, k, where, (int,))
        if v < (0 if k == "sys_len" else 1):
            raise ConfigError(f"{where}.{k}: must be >= {0 if k == 'sys_len' else 1}, got {v}")
    _need(w, "stages", where, (list,))
    prompt = w.get("prompt_len")
    if prompt is not None:
        prompt = round(_need(w, "prompt_len", where, (int, float)))
        if prompt <= w["sys_len"]:
            raise ConfigError(f"{where}.prompt_len: {prompt} leaves no question after {w['sys_len']} system tokens")
    question = (prompt - w["sys_len"]) if prompt is not None else w["question_len"]
    spec = {
        "systems": w["n_sys"],
        "users_per_system": w["n_users"],
        "system_len": w["sys_len"],
        "question_len": question,
        "output_len": w["output_len"],
        "stages": [list(s) if isinstance(s, list | tuple) else s for s in w["stages"]],
    }
    shared_prefix.parse(spec, where)
    return spec


def hardware_of(run: MeasuredRun) -> str:
    """The shipped hardware profile of a run (module docstring)."""
    e = run.raw
    prof = e.get("hw_profile")
    if isinstance(prof, str) and shipped("hardware", prof) is not None:
        return prof
    hw = str(e["hw"]).lower().replace(" ", "-").replace("_", "-")
    for needle, name in GPU_PROFILES:
        if needle in hw:
            return name
    raise ConfigError(
        f"{run.set_name}.{run.id}.hw: no hardware profile for {e['hw']!r} (shipped: "
        f"{', '.join(shipped_names('hardware'))}; give hw_profile)"
    )


def _repo_key(repo: str) -> str:
    """A Hugging Face id without what does not change the weights' shapes or precision.

    The organisation, ``Meta-`` and the ``-Instruct``, ``-chat`` and ``-hf`` variants of one
    architecture share a profile; a quantized checkpoint (``-FP8``, ``-w4a16``) does not.
    """
    name = repo.lower().rsplit("/", 1)[-1].removeprefix("meta-")
    return re.sub(r"-(instruct|chat|hf)(?=-|$)", "", name)


def model_of(run: MeasuredRun) -> str:
    """The shipped model profile of a run: by ``sim_model``, else by its Hugging Face id (:func:`_repo_key`)."""
    e = run.raw
    sim = e.get("sim_model")
    if isinstance(sim, str):
        stem = sim.removeprefix("model-").removesuffix(".yaml")
        for cand in (stem, re.sub(r"-tp\d+$", "", stem)):
            if shipped("models", cand) is not None:
                return cand
    hf = _repo_key(str(e["model"]))
    for name in shipped_names("models"):
        repo = load_model(name).hf_repo
        if repo is not None and _repo_key(repo) == hf:
            return name
    raise ConfigError(
        f"{run.set_name}.{run.id}.model: no model profile for {e['model']!r} (add configs/models/<name>.yaml "
        f"with hf_repo: {e['model']}, docs/hardware.md)"
    )


def run_config(run: MeasuredRun, engine: str, stage_scale: float = 1.0, hardware: Any = None) -> dict[str, Any]:
    """The simulator config of a run (module docstring); ``stage_scale`` shortens every stage (fits).

    ``hardware``: a hardware profile (name, path or mapping) to simulate on instead of the run's own.
    """
    e = run.raw
    model = model_profile_raw(model_of(run), f"{run.set_name}.{run.id}.model")
    model["tensor_parallel"] = e["tp"]
    if "sim_workload" in e:
        workload = dict(e["sim_workload"])
        if stage_scale != 1.0 and "num_requests" in workload:
            workload["num_requests"] = max(1, round(workload["num_requests"] * stage_scale))
    else:
        wl = workload_of(e)
        if stage_scale != 1.0:
            wl["stages"] = [[rate, seconds * stage_scale] for rate, seconds in wl["stages"]]
        workload = {"shared_prefix": wl}
    offload = bool(e.get("cpu_offload"))
    cpu_gib = float(e["cpu_kv_gib_per_gpu"]) if offload else 0.0
    return {
        "name": f"{run.set_name}.{run.id}",
        "seed": 0,
        "engine": engine,
        "hardware": hardware if hardware is not None else hardware_of(run),
        "model": model,
        "hash": "fast",
        "memory": {
            "block_size": BLOCK_SIZE,
            "gpu_memory_utilization": float(e["gpu_memory_utilization"]),
            "cpu_kv_gib": cpu_gib,
        },
        "scheduler": {
            "max_num_batched_tokens": e["max_num_batched_tokens"],
            "max_num_seqs": e["max_num_seqs"],
            "chunked_prefill": True,
        },
        "workload": workload,
        "runs": [
            {
                "name": "vllm",
                "victim_policy": "last_admitted",
                "mode": "recompute",
                "offload": "write_through" if offload else "none",
                "cpu_kv_gib": cpu_gib,
            }
        ],
    }


def stages_of(workload: dict[str, Any]) -> list[tuple[float, float]]:
    """The ``(rate, seconds)`` stages of a validated workload section (one endless stage but for shared prefixes)."""
    if workload.get("shared_prefix") is not None:
        stages: list[tuple[float, float]] = shared_prefix.parse(workload["shared_prefix"])["stages"]
        return stages
    return [(1.0, math.inf)]


def group_by_stage(records: list[Any], stages: list[tuple[float, float]]) -> dict[str, list[Any]]:
    """Finished request records by the stage they were sent in (``stage0`` ...), and all of them (``summary``)."""
    groups: dict[str, list[Any]] = {"summary": []}
    for r in records:
        if r.finish < 0 or r.first_token < 0:
            continue
        groups.setdefault(f"stage{shared_prefix.stage_of(r.arrival, stages)}", []).append(r)
        groups["summary"].append(r)
    return groups


def output_len_of(run: MeasuredRun) -> float:
    """The tokens each request generates (the workload's)."""
    e = run.raw
    if "sim_workload" in e:
        ol = e["sim_workload"].get("output_len", {})
        return float(ol.get("value", ol.get("mean", 2)))
    return float(e["workload"]["output_len"])


def predicted_metrics(run: MeasuredRun, records: list[Any], stages: list[tuple[float, float]]) -> dict[str, dict]:
    """Per measured stage (and ``summary``): predicted TTFT, ITL and E2E means in ms (module docstring).

    ``records`` are the simulation's request records (``arrival``, ``first_token``, ``finish``),
    ``stages`` the simulated ``(rate, seconds)`` stages the arrivals fall in.
    """
    groups = group_by_stage(records, stages)
    out_len = output_len_of(run)
    out: dict[str, dict] = {}
    for key in run.stages:
        done = groups.get(key, [])
        if not done:
            continue
        ttft = sum(r.first_token - r.arrival for r in done) / len(done) * 1e3
        e2e = sum(r.finish - r.arrival for r in done) / len(done) * 1e3
        client = run.raw["measured"][key].get("client_output_mean")
        tokens = float(client) if client is not None else float(out_len)
        out[key] = {"ttft_mean_ms": ttft, "e2e_mean_ms": e2e, "itl_mean_ms": (e2e - ttft) / (tokens - 1)}
    return out
