"""Hardware and model profiles (datasheet numbers live in ``configs/hardware`` and ``configs/models``).

A config names a profile in one of three ways: the name of a shipped profile
(``h200``), the path of the user's own YAML file (anything ending in
``.yaml``/``.yml`` or containing a ``/``), or an inline mapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.schema import Field, integer, non_negative, num, positive, validate
from tiered_kv.sim.shipped import shipped, shipped_names
from tiered_kv.storage.spec import DTYPE_BYTES

HARDWARE_SCHEMA = {
    "name": Field((str,), "custom"),
    "memory_gib": num(80.0, positive),
    "peak_bf16_flops": num(1e15, positive),
    "hbm_bytes_per_s": num(3e12, positive),
    "pcie_gbps_per_direction": num(64.0, non_negative, allow_inf=True),
    "pcie_efficiency": num(0.78, lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}"),
    "per_copy_overhead_s": num(10e-6, non_negative),
}
MODEL_SCHEMA = {
    "name": Field((str,), "custom"),
    "num_params": num(8e9, positive),
    "num_layers": integer(32, positive),
    "hidden_size": integer(4096, positive),
    "num_heads": integer(32, positive),
    "num_kv_heads": integer(8, positive),
    "head_dim": integer(128, positive),
    "dtype": Field((str,), "bfloat16", tuple(DTYPE_BYTES)),
    "tensor_parallel": integer(1, positive),
}


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    memory_gib: float
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    pcie_gbps_per_direction: float
    pcie_efficiency: float
    per_copy_overhead_s: float

    @property
    def pcie_bytes_per_s(self) -> float:
        """Achievable bandwidth per direction (datasheet x efficiency); PCIe is full duplex."""
        return self.pcie_gbps_per_direction * 1e9 * self.pcie_efficiency


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tensor_parallel: int

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_heads_per_gpu(self) -> int:
        return max(1, math.ceil(self.num_kv_heads / self.tensor_parallel))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers, on one GPU: 2 x layers x KV heads x head dim x dtype."""
        return 2 * self.num_layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    @property
    def params_per_gpu(self) -> float:
        return self.num_params / self.tensor_parallel

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.params_per_gpu * self.dtype_bytes

    @property
    def attn_dim_per_gpu(self) -> int:
        return self.num_heads * self.head_dim // self.tensor_parallel


def is_path_ref(ref: str) -> bool:
    """A profile reference that is a file path rather than the name of a shipped profile."""
    return ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref


def _load(ref: Any, kind: str, schema: dict, key: str) -> dict[str, Any]:
    if isinstance(ref, dict):
        return validate(ref, schema, key)
    if not isinstance(ref, str):
        raise ConfigError(f"{key}: expected a profile name or a mapping, got {type(ref).__name__} {ref!r}")
    if is_path_ref(ref):
        return validate(read_yaml(Path(ref), key), schema, key)
    found = shipped(kind, ref)
    if found is None:
        raise ConfigError(f"{key}: no {kind} profile {ref!r} (known: {', '.join(shipped_names(kind))})")
    return validate(read_yaml(found, key), schema, key)


def load_hardware(ref: Any, key: str = "hardware") -> HardwareProfile:
    return HardwareProfile(**_load(ref, "hardware", HARDWARE_SCHEMA, key))


def load_model(ref: Any, key: str = "model") -> ModelProfile:
    return ModelProfile(**_load(ref, "models", MODEL_SCHEMA, key))
