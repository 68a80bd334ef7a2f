"""A user's own measurements of vLLM, read into measured runs (:mod:`~tiered_kv.sim.measured_runs`) to calibrate on.

What ``tiered-kv calibrate`` reads (:func:`read_measurements`), each file by
its content, not its name:

* **a file of measured runs** (JSON or YAML with ``experiments``): the format
  of ``configs/validation/vllm-0.15.1-h100-runs.yaml``;
* **the JSON of ``vllm bench serve --save-result``** (vLLM's
  ``benchmarks/serve.py``: ``model_id``, ``num_prompts``, ``request_rate``,
  ``burstiness``, ``max_concurrency``, ``completed``, ``total_input_tokens``,
  ``total_output_tokens``, ``mean_ttft_ms``, ``mean_tpot_ms``,
  ``mean_itl_ms``, ``mean_e2el_ms`` when asked for): one run of
  ``num_prompts`` requests with the mean prompt and output lengths, sent as a
  Poisson process at ``request_rate`` (or all at once for ``inf``), at most
  ``max_concurrency`` in flight when it was given (``workload.concurrency``:
  the closed loop of ``--max-concurrency``);
* **an inference-perf results directory**: its ``stage_N_lifecycle_metrics.json``
  (``successes.latency.time_to_first_token.mean`` and
  ``request_latency.mean`` in seconds, ``successes.output_len.mean``) and the
  inference-perf config beside them (a YAML with ``data.shared_prefix`` and
  ``load.stages``), in the directory or its parent;
* **the server's start-up log** (a text file): ``non-default args: {...}``
  (the model, ``tensor_parallel_size``, ``max_num_batched_tokens``,
  ``max_num_seqs``, ``gpu_memory_utilization``), the version line and ``GPU KV
  cache size: N tokens``; these settings apply to the benchmark results given
  with it (flags of the command win over the log).

Anything else is refused with one line that says what was expected.  So are
bursty arrivals (``burstiness`` other than 1: vLLM's gamma-distributed gaps,
which the simulator's arrival processes do not draw).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.engine_version import DEFAULT_ENGINE
from tiered_kv.sim.files import read_text
from tiered_kv.sim.measured_runs import MeasuredRun, is_run_set, load_run_set, parse_run_set

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Settings:
    """vLLM's settings of the measured server: from the command's flags, else the start-up log."""

    model: str | None = None
    tp: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    engine: str | None = None
    hw: str | None = None
    gpu_blocks: int | None = None

    def merged(self, other: Settings) -> Settings:
        """These settings, with ``other``'s where these give none."""
        return Settings(*(a if a is not None else b for a, b in zip(self._values(), other._values(), strict=True)))

    def _values(self) -> tuple[Any, ...]:
        return (
            self.model,
            self.tp,
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.gpu_memory_utilization,
            self.engine,
            self.hw,
            self.gpu_blocks,
        )


def _arg(text: str, key: str) -> Any:
    """One value of the log's ``non-default args: {...}`` dict (its literals only)."""
    m = re.search(rf"'{key}': ([^,}}]+)", text)
    if m is None:
        return None
    try:
        return ast.literal_eval(m.group(1).strip())
    except (ValueError, SyntaxError):
        return None


def read_startup_log(path: Path) -> Settings:
    """The settings a vLLM server's start-up log states (module docstring); ConfigError if it states none."""
    text = read_text(path, "calibrate")
    version = re.search(r"vLLM (?:API )?server version ([0-9]+\.[0-9]+(?:\.[0-9]+)?)", text)
    tokens = re.search(r"GPU KV cache size: ([0-9,]+) tokens", text)
    blocks = re.search(r"# GPU blocks: ([0-9]+)", text)
    chunked = re.search(r"max_num_batched_tokens=([0-9]+)", text)
    model = _arg(text, "model")
    s = Settings(
        model=model if isinstance(model, str) else None,
        tp=_arg(text, "tensor_parallel_size"),
        max_num_batched_tokens=_arg(text, "max_num_batched_tokens") or (int(chunked.group(1)) if chunked else None),
        max_num_seqs=_arg(text, "max_num_seqs"),
        gpu_memory_utilization=_arg(text, "gpu_memory_utilization"),
        engine=f"vllm-{version.group(1)}" if version else None,
        gpu_blocks=(
            int(tokens.group(1).replace(",", "")) // BLOCK_SIZE if tokens else int(blocks.group(1)) if blocks else None
        ),
    )
    if all(v is None for v in s._values()):
        raise ConfigError(
            f"calibrate: '{path}' is not a vLLM start-up log (no version line, non-default args or "
            "'GPU KV cache size'); give the server's log, a `vllm bench serve --save-result` JSON, an "
            "inference-perf results directory or a file of measured runs"
        )
    return s


def _num(d: dict[str, Any], key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"{where}.{key}: expected a number, got {v!r}")
    return float(v)


def is_bench_result(raw: Any) -> bool:
    return isinstance(raw, dict) and "mean_ttft_ms" in raw and "request_rate" in raw


def _run_header(name: str, model: str, settings: Settings) -> dict[str, Any]:
    """A measured run's identity and server settings, vLLM's defaults where the measurement does not say."""
    return {
        "id": name,
        "model": model,
        "hw": settings.hw or "unknown",
        "tp": settings.tp or 1,
        "cpu_offload": False,
        "gpu_memory_utilization": settings.gpu_memory_utilization or 0.9,
        "max_num_batched_tokens": settings.max_num_batched_tokens or 8192,
        "max_num_seqs": settings.max_num_seqs or 256,
        "vllm_kv_blocks": {"gpu_blocks": settings.gpu_blocks} if settings.gpu_blocks else None,
    }


def bench_run(raw: dict[str, Any], name: str, settings: Settings) -> dict[str, Any]:
    """A measured run (the run-set format) from a ``vllm bench serve --save-result`` JSON."""
    rate = raw["request_rate"]
    cap = raw.get("max_concurrency")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"{name}.max_concurrency: expected a whole number >= 1 or null, got {cap!r}")
    burst = raw.get("burstiness", 1.0)
    if burst not in (None, 1, 1.0):
        raise ConfigError(f"{name}.burstiness: {burst!r}: only Poisson arrivals (burstiness 1) are simulated")
    completed = _num(raw, "completed", name)
    if completed < 2:
        raise ConfigError(f"{name}.completed: {completed:g} requests are too few to measure a mean")
    mean_in = _num(raw, "total_input_tokens", name) / completed
    mean_out = _num(raw, "total_output_tokens", name) / completed
    ttft = _num(raw, "mean_ttft_ms", name)
    tpot = raw.get("mean_tpot_ms", raw.get("mean_itl_ms"))
    if isinstance(tpot, bool) or not isinstance(tpot, int | float):
        raise ConfigError(f"{name}.mean_tpot_ms: expected a number (or mean_itl_ms), got {tpot!r}")
    e2e = raw.get("mean_e2el_ms")
    if not isinstance(e2e, int | float) or isinstance(e2e, bool):
        e2e = ttft + float(tpot) * (mean_out - 1)  # no E2E saved: the mean request's
    n = int(raw.get("num_prompts") or completed)
    if rate == "inf" or rate == math.inf:
        # All ready at 0: with a cap, the closed loop (.inf is a load only with a concurrency);
        # without one, one burst (a rate no step can tell from all at once).
        arrival = {"process": "fixed", "rate": math.inf if cap else 1.0e9}
    else:
        arrival = {"process": "poisson", "rate": _num(raw, "request_rate", name)}
    model = settings.model or raw.get("model_id")
    if not isinstance(model, str):
        raise ConfigError(f"{name}.model_id: no model named (give --model)")
    return {
        **_run_header(name, model, settings),
        "sim_workload": {
            "num_requests": n,
            "arrival": arrival,
            "prompt_len": {"dist": "fixed", "value": max(1, round(mean_in))},
            "output_len": {"dist": "fixed", "value": max(2, round(mean_out))},
            **({"concurrency": cap} if cap else {}),
        },
        "measured": {
            "summary": {
                "ttft_mean_ms": ttft,
                "itl_mean_ms": (e2e - ttft) / (mean_out - 1) if mean_out > 1 else float(tpot),
                "e2e_mean_ms": float(e2e),
                "client_output_mean": mean_out,
            }
        },
    }


def _inference_perf_config(directory: Path) -> dict[str, Any]:
    """The inference-perf config (``data`` and ``load``) in ``directory`` or its parent."""
    from tiered_kv.sim.files import read_yaml

    for d in (directory, directory.parent):
        for p in sorted(d.glob("*.y*ml")):
            raw = read_yaml(p, "calibrate")
            if isinstance(raw, dict) and isinstance(raw.get("data"), dict) and isinstance(raw.get("load"), dict):
                return raw
    raise ConfigError(
        f"calibrate: no inference-perf config (a YAML with data: and load:) in '{directory}' or its parent; "
        "it says the workload the results were measured on"
    )


def inference_perf_run(directory: Path, settings: Settings) -> dict[str, Any]:
    """A measured run (the run-set format) from an inference-perf results directory."""
    files = {p.name: p for p in directory.glob("*lifecycle_metrics.json")}
    if not files:
        raise ConfigError(
            f"calibrate: '{directory}' holds no inference-perf *_lifecycle_metrics.json; give an inference-perf "
            "results directory, a `vllm bench serve --save-result` JSON or a file of measured runs"
        )
    cfg = _inference_perf_config(directory)
    data, load = cfg["data"], cfg["load"]
    sp = data.get("shared_prefix")
    if data.get("type") != "shared_prefix" or not isinstance(sp, dict):
        raise ConfigError(f"calibrate: '{directory}': only inference-perf's shared_prefix data is simulated")
    stages = load.get("stages")
    if load.get("type", "constant") != "constant" or not isinstance(stages, list) or not stages:
        raise ConfigError(f"calibrate: '{directory}': only inference-perf's constant-rate load stages are simulated")
    workload = {
        "n_sys": sp.get("num_unique_system_prompts", sp.get("num_groups")),
        "n_users": sp.get("num_users_per_system_prompt", sp.get("num_prompts_per_group")),
        "sys_len": sp.get("system_prompt_len"),
        "question_len": sp.get("question_len"),
        "output_len": sp.get("output_len"),
        "stages": [[s.get("rate"), s.get("duration")] for s in stages if isinstance(s, dict)],
    }
    measured: dict[str, Any] = {}
    for fname, p in files.items():
        m = re.fullmatch(r"stage_(\d+)_lifecycle_metrics\.json", fname)
        key = f"stage{m.group(1)}" if m else "summary" if fname.startswith("summary") else None
        if key is None:
            continue
        try:
            doc = json.loads(read_text(p, "calibrate"))
            ok = doc["successes"]
            lat = ok["latency"]
            ttft = float(lat["time_to_first_token"]["mean"]) * 1e3
            e2e = float(lat["request_latency"]["mean"]) * 1e3
            out = float(ok["output_len"]["mean"])
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"calibrate: '{p}' is not an inference-perf lifecycle report (successes.latency."
                f"time_to_first_token.mean ...): {exc}"
            ) from None
        measured[key] = {
            "ttft_mean_ms": ttft,
            "e2e_mean_ms": e2e,
            "itl_mean_ms": (e2e - ttft) / (out - 1) if out > 1 else e2e - ttft,
            "client_output_mean": out,
        }
    model = settings.model or (cfg.get("server") or {}).get("model_name")
    if not isinstance(model, str):
        raise ConfigError(f"calibrate: '{directory}': no model named (give --model)")
    return {
        **_run_header(directory.name, model, settings),
        "workload": workload,
        "measured": measured,
    }


def read_measurements(paths: list[Path], flags: Settings) -> tuple[list[MeasuredRun], str | None]:
    """Every measured run in ``paths`` (module docstring) and the engine version they name (or None).

    Start-up logs apply to the benchmark results read with them; ``flags`` win over a log.
    """
    logs = [p for p in paths if p.is_file() and p.suffix.lower() not in (".json", ".yaml", ".yml")]
    settings = flags
    for p in logs:
        settings = settings.merged(read_startup_log(p))
    runs: list[MeasuredRun] = []
    engines: set[str] = set()
    for p in paths:
        if p in logs:
            continue
        if not p.exists():
            raise ConfigError(f"calibrate: '{p}' does not exist")
        if p.is_dir():
            raw = {"engine": settings.engine or DEFAULT_ENGINE, "experiments": [inference_perf_run(p, settings)]}
            rs = parse_run_set(raw, p.name)
        else:
            text_is_json = p.suffix.lower() == ".json"
            raw_any: Any
            if text_is_json:
                try:
                    raw_any = json.loads(read_text(p, "calibrate"))
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"calibrate: '{p}' is not JSON ({exc})") from None
            else:
                from tiered_kv.sim.files import read_yaml

                raw_any = read_yaml(p, "calibrate")
            if is_run_set(raw_any):
                rs = load_run_set(p)
            elif is_bench_result(raw_any):
                run = bench_run(raw_any, p.stem, settings)
                rs = parse_run_set({"engine": settings.engine or DEFAULT_ENGINE, "experiments": [run]}, p.stem)
            else:
                keys = sorted(raw_any)[:5] if isinstance(raw_any, dict) else type(raw_any).__name__
                raise ConfigError(
                    f"calibrate: '{p}' is none of the formats calibrate reads (a file of measured runs with "
                    f"'experiments', a `vllm bench serve --save-result` JSON with 'mean_ttft_ms', an inference-perf "
                    f"results directory, a vLLM start-up log); it has {keys}"
                )
        engines.add(rs.engine)
        runs.extend(replace(r, fit=True) for r in rs.runs)
    if len(engines) > 1:
        raise ConfigError(
            f"calibrate: the runs were measured on different engines ({', '.join(sorted(engines))}); a step model "
            "is of one engine era: calibrate each on its own"
        )
    return runs, (engines.pop() if engines else None)
