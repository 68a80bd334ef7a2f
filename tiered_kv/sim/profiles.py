"""Hardware and model profiles (datasheet numbers live in ``configs/hardware`` and ``configs/models``).

A config names a profile in one of three ways: the name of a shipped profile
(``h200``), the path of the user's own YAML file (anything ending in
``.yaml``/``.yml`` or containing a ``/``), or an inline mapping.

A hardware profile holds three kinds of numbers, each with its source in the
shipped YAML:

* the datasheet: memory, peak BF16 FLOPs, HBM bandwidth;
* the host link (:class:`LinkProfile`): one-way bandwidth per direction, the
  total when both directions run at once, and the fixed cost of one copy;
* the step-time coefficients (:class:`StepProfile`): fitted to published
  serving measurements (the fit and its residuals sit beside them), and the
  tensor-parallel all-reduce cost (:class:`AllReduceProfile`);
* optionally, the media below the CPU tier (``tiers:``, see
  :mod:`~tiered_kv.sim.tier_profiles`): each one's bandwidth and per-block latency.

Older profiles that give only ``pcie_gbps_per_direction`` x ``pcie_efficiency``
and ``per_copy_overhead_s`` still load: their link is full duplex at that
rate, with no cap on the sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.schema import REQUIRED, Field, fraction, integer, non_negative, num, positive, validate
from tiered_kv.sim.shipped import shipped, shipped_names
from tiered_kv.sim.tier_profiles import TIERS_SCHEMA, TierMedium, tier_media
from tiered_kv.storage.spec import DTYPE_BYTES

HARDWARE_SCHEMA = {
    "name": Field((str,), "custom"),
    "memory_gib": num(80.0, positive),
    "peak_bf16_flops": num(1e15, positive),
    "hbm_bytes_per_s": num(3e12, positive),
    # Legacy link description (used when ``link`` gives no bandwidth).
    "pcie_gbps_per_direction": num(64.0, non_negative, allow_inf=True),
    "pcie_efficiency": num(0.78, lambda v: None if 0 < v <= 1 else f"must be in (0, 1], got {v}"),
    "per_copy_overhead_s": num(10e-6, non_negative),
    "link": {
        "h2d_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "d2h_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "bidir_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "per_copy_us": num(None, non_negative, nullable=True),
    },
    "step_model": {
        "mfu": num(0.5, fraction),
        # Required: each has its own fit and source in the shipped profiles (no default stands in for one).
        "prefill_mfu": num(REQUIRED, fraction),
        "hbm_efficiency": num(0.8, fraction),
        "per_step_s": num(5e-4, non_negative),
        "per_seq_s": num(0.0, non_negative),
        "frontend_s": num(REQUIRED, non_negative),
    },
    "allreduce": {
        "latency_us": num(10.0, non_negative),
        "small_gbps": num(30.0, positive),
        "small_max_bytes": integer(1 << 20, positive),
        "busbw_gbps": num(370.0, positive),
    },
    # Media below the CPU tier (tier_profiles.py); a medium left out gets the manager's measured defaults.
    "tiers": TIERS_SCHEMA,
}
MODEL_SCHEMA = {
    "name": Field((str,), "custom"),
    "num_params": num(8e9, positive),
    "num_layers": integer(32, positive),
    "hidden_size": integer(4096, positive),
    "num_heads": integer(32, positive),
    "num_kv_heads": integer(8, positive),
    "head_dim": integer(128, positive),
    "vocab_size": integer(0, non_negative),
    "tie_word_embeddings": Field((bool,), False),
    "dtype": Field((str,), "bfloat16", tuple(DTYPE_BYTES)),
    "weight_dtype": Field((str,), None, tuple(DTYPE_BYTES), nullable=True),
    "tensor_parallel": integer(1, positive),
}

GB = 1e9


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """The host link of one GPU, in bytes/s and seconds.

    Attributes:
        h2d_bytes_per_s: One-way host-to-device bandwidth of a large copy.
        d2h_bytes_per_s: One-way device-to-host bandwidth of a large copy.
        bidir_bytes_per_s: The most both directions move together (their sum),
            which on a real PCIe link is less than twice one way.
        per_copy_s: The fixed cost of one copy (call, DMA set-up); a copy of
            ``b`` bytes takes ``per_copy_s + b / bandwidth``, so small copies
            reach only ``b / (per_copy_s * bandwidth + b)`` of the bandwidth.
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    bidir_bytes_per_s: float
    per_copy_s: float

    def effective_bytes_per_s(self, bytes_per_copy: float, direction: str = "H2D") -> float:
        """Bandwidth a stream of copies of ``bytes_per_copy`` bytes reaches in one direction."""
        bw = self.h2d_bytes_per_s if direction == "H2D" else self.d2h_bytes_per_s
        if bw <= 0:
            return 0.0
        if math.isinf(bw):
            return math.inf if self.per_copy_s == 0 else bytes_per_copy / self.per_copy_s
        return bytes_per_copy / (self.per_copy_s + bytes_per_copy / bw)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Step-time coefficients of one GPU (see :mod:`tiered_kv.sim.compute`).

    Attributes:
        mfu: Fraction of peak BF16 FLOPs that decode rows and the LM head reach.
        prefill_mfu: Fraction of peak that prefill chunks reach (tall GEMMs, FlashAttention).
        hbm_efficiency: Fraction of datasheet HBM bandwidth that weight and KV reads reach.
        per_step_s: The serving engine's fixed cost of one step.
        per_seq_s: Its cost per request in a step.
        frontend_s: The serving front end's cost per request (HTTP handling,
            tokenization, hand-off to the engine, detokenization and streaming of the
            first token), outside every step: a request reaches the scheduler this long
            after it was sent, so TTFT and E2E include it once and no step pays it.
    """

    mfu: float
    prefill_mfu: float
    hbm_efficiency: float
    per_step_s: float
    per_seq_s: float
    frontend_s: float


@dataclass(frozen=True, slots=True)
class AllReduceProfile:
    """Cost of one tensor-parallel all-reduce of ``b`` bytes.

    Up to ``small_max_bytes`` (the latency-bound range of a one-shot kernel):
    ``latency_s + b / small_bytes_per_s``; above it, the large-message NCCL
    rate: the algorithm bandwidth of a ring, ``busbw * n / (2 (n - 1))``.
    """

    latency_s: float
    small_bytes_per_s: float
    small_max_bytes: int
    busbw_bytes_per_s: float

    def seconds(self, nbytes: float, tp: int) -> float:
        if tp <= 1 or nbytes <= 0:
            return 0.0
        small = self.latency_s + min(nbytes, self.small_max_bytes) / self.small_bytes_per_s
        if nbytes <= self.small_max_bytes:
            return small
        algbw = self.busbw_bytes_per_s * tp / (2.0 * (tp - 1))
        return small + (nbytes - self.small_max_bytes) / algbw


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    memory_gib: float
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    link: LinkProfile
    step: StepProfile
    allreduce: AllReduceProfile
    tiers: Mapping[str, TierMedium] = field(default_factory=dict)  # tier name -> its medium (tier_profiles)

    @property
    def pcie_bytes_per_s(self) -> float:
        """One-way host-to-device bandwidth (kept for callers of the older profile shape)."""
        return self.link.h2d_bytes_per_s

    @property
    def per_copy_overhead_s(self) -> float:
        return self.link.per_copy_s

    @property
    def vllm_default_limits(self) -> tuple[int, int]:
        """vLLM v1's ``(max_num_seqs, max_num_batched_tokens)`` for its OpenAI server on this GPU.

        vLLM's ``EngineArgs.get_batch_defaults``: 1024 sequences and 8192 tokens
        on a GPU with at least 70 GiB that is not an A100 (large budgets cost an
        A100 throughput, vLLM PR #17885); 256 and 2048 otherwise.
        """
        if self.memory_gib >= 70 and "a100" not in self.name.lower():
            return 1024, 8192
        return 256, 2048


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
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    weight_dtype: str | None = None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype or self.dtype]

    @property
    def kv_heads_per_gpu(self) -> int:
        return max(1, math.ceil(self.num_kv_heads / self.tensor_parallel))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers, on one GPU: 2 x layers x KV heads x head dim x dtype."""
        return 2 * self.num_layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_bytes_per_token // self.num_layers

    @property
    def embedding_params(self) -> float:
        """The input embedding table: looked up, not multiplied, so it costs no FLOPs."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def lm_head_params_per_gpu(self) -> float:
        """The output projection: multiplied only for the tokens a step samples."""
        return self.vocab_size * self.hidden_size / self.tensor_parallel

    @property
    def params_per_gpu(self) -> float:
        """Parameters multiplied once per computed token: all but the embedding table and the LM head.

        A tied LM head is the embedding table itself, so it is subtracted once.
        """
        heads = self.embedding_params if self.tie_word_embeddings else 2 * self.embedding_params
        return max(self.num_params - heads, 0.0) / self.tensor_parallel

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Memory the weights take on one GPU (every parameter, the embedding table included)."""
        return self.num_params / self.tensor_parallel * self.weight_dtype_bytes

    @property
    def streamed_weight_bytes_per_gpu(self) -> float:
        """Weight bytes one step reads from HBM: every matrix it multiplies (the table is only gathered)."""
        return (self.params_per_gpu + self.lm_head_params_per_gpu) * self.weight_dtype_bytes

    @property
    def attn_dim_per_gpu(self) -> int:
        return self.num_heads * self.head_dim // self.tensor_parallel

    @property
    def allreduce_bytes_per_token(self) -> int:
        """Bytes one token adds to each tensor-parallel all-reduce (its hidden state)."""
        return self.hidden_size * self.dtype_bytes


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


def _link(d: dict[str, Any]) -> LinkProfile:
    link = d["link"]
    legacy = d["pcie_gbps_per_direction"] * GB * d["pcie_efficiency"]
    h2d = link["h2d_gbps"] * GB if link["h2d_gbps"] is not None else legacy
    d2h = link["d2h_gbps"] * GB if link["d2h_gbps"] is not None else h2d
    bidir = link["bidir_gbps"] * GB if link["bidir_gbps"] is not None else h2d + d2h
    per_copy = link["per_copy_us"] * 1e-6 if link["per_copy_us"] is not None else d["per_copy_overhead_s"]
    return LinkProfile(h2d, d2h, bidir, per_copy)


def load_hardware(ref: Any, key: str = "hardware") -> HardwareProfile:
    d = _load(ref, "hardware", HARDWARE_SCHEMA, key)
    s, a = d["step_model"], d["allreduce"]
    return HardwareProfile(
        name=d["name"],
        memory_gib=d["memory_gib"],
        peak_bf16_flops=d["peak_bf16_flops"],
        hbm_bytes_per_s=d["hbm_bytes_per_s"],
        link=_link(d),
        step=StepProfile(
            s["mfu"], s["prefill_mfu"], s["hbm_efficiency"], s["per_step_s"], s["per_seq_s"], s["frontend_s"]
        ),
        allreduce=AllReduceProfile(
            a["latency_us"] * 1e-6, a["small_gbps"] * GB, a["small_max_bytes"], a["busbw_gbps"] * GB
        ),
        tiers=tier_media(d["tiers"], f"{key}.tiers"),
    )


def load_model(ref: Any, key: str = "model") -> ModelProfile:
    return ModelProfile(**_load(ref, "models", MODEL_SCHEMA, key))
