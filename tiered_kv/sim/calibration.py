"""Calibration files: measured cost-model parameters that the simulator and the cost-aware policy load.

Written by ``tiered-kv crossover`` from measurements on the present hardware:

* ``cost_model``: the manager's :class:`CostModel` (bandwidth per direction,
  per-copy overhead, prefill throughput curve), fitted by least squares;
* ``step_model``: the engine's step time as ``intercept + per_token * tokens +
  per_attn_unit * attention units + per_kv_token * KV tokens + per_seq *
  requests``, fitted with non-negative least squares on real engine steps;
* ``model``: the model the measurements were taken on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.pricing import CostModel
from tiered_kv.sim.files import read_json, write_text
from tiered_kv.sim.profiles import ModelProfile
from tiered_kv.storage.spec import DTYPE_BYTES, LAYOUTS

STEP_TERMS = ("intercept_s", "per_token_s", "per_attn_unit_s", "per_kv_token_s", "per_seq_s")


@dataclass(frozen=True)
class Calibration:
    device: str
    block_size: int
    layout: str
    model: dict[str, Any]
    cost_model: CostModel
    step_model: tuple[float, float, float, float, float]

    def model_profile(self) -> ModelProfile:
        m = self.model
        return ModelProfile(
            name=f"calibrated ({m['num_layers']} layers, hidden {m['hidden_size']})",
            num_params=float(m["num_params"]),
            num_layers=m["num_layers"],
            hidden_size=m["hidden_size"],
            num_heads=m["num_heads"],
            num_kv_heads=m["num_kv_heads"],
            head_dim=m["head_dim"],
            dtype=m["dtype"],
            tensor_parallel=1,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "block_size": self.block_size,
            "layout": self.layout,
            "model": self.model,
            "cost_model": self.cost_model.to_dict(),
            "step_model": dict(zip(STEP_TERMS, self.step_model, strict=True)),
        }

    def save(self, path: Path, extra: dict[str, Any] | None = None) -> None:
        write_text(path, json.dumps({**self.to_dict(), **(extra or {})}, indent=1), "--calibration-out")


MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")


def _number(v: Any, key: str, minimum: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < minimum:
        raise ConfigError(f"{key}: must be a finite number >= {minimum:g}, got {v!r}")
    return float(v)


def _count(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{key}: must be an integer >= 1, got {v!r}")
    return v


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration written by ``tiered-kv crossover``; every field is checked and named if wrong."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"calibration: file '{p}' does not exist (write one with `tiered-kv crossover`)")
    d = read_json(p, "calibration")
    if not isinstance(d, dict):
        raise ConfigError(f"calibration: {p} must hold a JSON object, got {type(d).__name__}")
    for key in ("device", "block_size", "layout", "model", "cost_model", "step_model"):
        if key not in d:
            raise ConfigError(f"calibration.{key}: required key is missing in {p}")
    if not isinstance(d["device"], str):
        raise ConfigError(f"calibration.device: must be a string, got {d['device']!r}")
    block_size = _count(d["block_size"], "calibration.block_size")
    if d["layout"] not in LAYOUTS:
        raise ConfigError(f"calibration.layout: must be one of {list(LAYOUTS)}, got {d['layout']!r}")
    model = d["model"]
    if not isinstance(model, dict):
        raise ConfigError(f"calibration.model: must be a mapping, got {type(model).__name__}")
    for key in MODEL_KEYS:
        if key not in model:
            raise ConfigError(f"calibration.model.{key}: required key is missing")
        _count(model[key], f"calibration.model.{key}")
    _number(model.get("num_params"), "calibration.model.num_params")
    if model.get("dtype") not in DTYPE_BYTES:
        raise ConfigError(f"calibration.model.dtype: must be one of {sorted(DTYPE_BYTES)}, got {model.get('dtype')!r}")
    sm = d["step_model"]
    if not isinstance(sm, dict):
        raise ConfigError(f"calibration.step_model: must be a mapping, got {type(sm).__name__}")
    missing = [t for t in STEP_TERMS if t not in sm]
    if missing:
        raise ConfigError(f"calibration.step_model.{missing[0]}: required key is missing")
    for t in STEP_TERMS:
        if isinstance(sm[t], bool) or not isinstance(sm[t], int | float) or not sm[t] >= 0 or math.isinf(sm[t]):
            raise ConfigError(f"calibration.step_model.{t}: must be a number >= 0, got {sm[t]!r}")
    cm = d["cost_model"]
    if not isinstance(cm, dict):
        raise ConfigError(f"calibration.cost_model: must be a mapping, got {type(cm).__name__}")
    try:
        cost_model = CostModel.from_dict(cm)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"calibration.cost_model: {exc}") from None
    return Calibration(
        device=d["device"],
        block_size=block_size,
        layout=d["layout"],
        model=model,
        cost_model=cost_model,
        step_model=tuple(float(sm[t]) for t in STEP_TERMS),  # type: ignore[arg-type]
    )


def model_config_dict(config: object) -> dict[str, Any]:
    """A ModelConfig as a plain dict, plus its parameter count."""
    d = asdict(config)  # type: ignore[call-overload]
    d["num_params"] = config.num_params  # type: ignore[attr-defined]
    return d
