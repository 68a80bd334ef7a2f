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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.sim.profiles import ModelProfile

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
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**self.to_dict(), **(extra or {})}, indent=1))


def load_calibration(path: str | Path) -> Calibration:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"calibration: file {str(p)!r} does not exist")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration: {p} is not JSON: {exc}") from None
    for key in ("device", "block_size", "layout", "model", "cost_model", "step_model"):
        if key not in d:
            raise ConfigError(f"calibration.{key}: required key is missing in {p}")
    sm = d["step_model"]
    missing = [t for t in STEP_TERMS if t not in sm]
    if missing:
        raise ConfigError(f"calibration.step_model.{missing[0]}: required key is missing")
    for t in STEP_TERMS:
        if not isinstance(sm[t], int | float) or sm[t] < 0:
            raise ConfigError(f"calibration.step_model.{t}: must be a number >= 0, got {sm[t]!r}")
    return Calibration(
        device=d["device"],
        block_size=int(d["block_size"]),
        layout=d["layout"],
        model=d["model"],
        cost_model=CostModel.from_dict(d["cost_model"]),
        step_model=tuple(float(sm[t]) for t in STEP_TERMS),  # type: ignore[arg-type]
    )


def model_config_dict(config: object) -> dict[str, Any]:
    """A ModelConfig as a plain dict, plus its parameter count."""
    d = asdict(config)  # type: ignore[call-overload]
    d["num_params"] = config.num_params  # type: ignore[attr-defined]
    return d
