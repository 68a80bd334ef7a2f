"""Hardware and model profiles (datasheet numbers live in ``configs/hardware`` and ``configs/models``).

A config names a profile in one of three ways: the name of a shipped profile
(``h200``), the path of the user's own YAML file (anything ending in
``.yaml``/``.yml`` or containing a ``/``), or an inline mapping.

A hardware profile holds three kinds of numbers, each with its source in the
shipped YAML:

* the datasheet: memory, peak BF16 FLOPs, HBM bandwidth;
* the host link (:class:`LinkProfile`): one-way bandwidth per direction, the
  total when both directions run at once, and the fixed cost of one copy;
* the step-time coefficients (:class:`StepProfile`), one set per serving-engine
  era (``step_model: {vllm-v1: ..., vllm-v0: ...}``,
  :mod:`~tiered_kv.sim.engine_version`): fitted to measured serving runs (the
  fit and its residuals sit beside them); a profile may give none, and then
  runs with the uncalibrated default (:func:`uncalibrated_step`), which the
  run's first line names;
* the interconnect between its GPUs and the tensor-parallel all-reduce cost
  over it (:class:`AllReduceProfile`: NVLink or PCIe, each measured);
* optionally, the media below the CPU tier (``tiers:``, see
  :mod:`~tiered_kv.sim.tier_config`): each one's bandwidth and per-block latency.

No physical number has a default: a profile that leaves one out would
otherwise simulate some other machine or model.  Every such field is required,
or derived from fields that are given by one of these rules, which the profile
records in ``derived`` so that a run prints them:

* ``link.d2h_gbps``: the host-to-device bandwidth (a symmetric link);
* ``link.bidir_gbps``: ``h2d + d2h`` (a full-duplex link with no shared cap);
* ``allreduce:`` is needed only by a model that runs tensor-parallel;
* ``model.head_dim``: ``hidden_size / num_heads`` (the Hugging Face default for
  Llama-style models; refused when it does not divide);
* ``model.weight_dtype``: the KV ``dtype``;
* ``model.tensor_parallel``: 1 (one GPU);
* ``model.tie_word_embeddings`` is needed only with a ``vocab_size`` > 0 (0
  counts the embedding table and LM head inside ``num_params``).

Impossible combinations are refused with the key's path: KV heads that do not
divide the query heads, a tensor-parallel degree that splits neither, fewer
parameters than the attention projections and embeddings alone, a link whose
two directions together move more than each at its own peak.

Every physical number is also checked against a plausible range for its unit
(:data:`HARDWARE_RANGES`, :data:`MODEL_RANGES`): a unit slip (``peak_bf16_flops:
121`` for 121 TFLOP/s, ``h2d_gbps: 25.0e+9`` for 25 GB/s, ``frontend_s: 32.7``
for 32.7 ms) is refused with the unit named and the likely fix, instead of
simulating a machine 10^12 times too slow.  A made-up device (the tests' toy)
says ``skip_range_checks: true``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.engine_version import ERAS
from tiered_kv.sim.files import read_yaml
from tiered_kv.sim.schema import REQUIRED, Field, Retired, fraction, integer, non_negative, num, positive, validate
from tiered_kv.sim.shipped import shipped, shipped_names
from tiered_kv.sim.tier_config import TIERS_SCHEMA, TierMedium, tier_media
from tiered_kv.storage.spec import DTYPE_BYTES


def _older_bandwidth(value: Any) -> str:
    return "renamed: give link.h2d_gbps, the one-way bandwidth a copy reaches (GB/s; was per_direction x efficiency)"


STEP_SCHEMA = {
    "mfu": num(REQUIRED, fraction),
    "prefill_mfu": num(REQUIRED, fraction),
    "hbm_efficiency": num(REQUIRED, fraction),
    "step_overhead_s": num(REQUIRED, non_negative),
    "per_step_s": Retired(lambda v: f"renamed: give step_overhead_s: {v!r}"),
    "per_layer_s": num(REQUIRED, non_negative),
    "per_seq_s": num(REQUIRED, non_negative),
    "frontend_s": num(REQUIRED, non_negative),
}
"""The step-time coefficients of one engine era (:class:`StepProfile`)."""

HARDWARE_SCHEMA = {
    "name": Field((str,)),
    # The memory CUDA reports (cudaMemGetInfo's total, which vLLM's gpu_memory_utilization is a
    # fraction of), in GiB: less than the datasheet's GB and than nvidia-smi's total.
    "memory_gib": num(REQUIRED, positive),
    "peak_bf16_flops": num(REQUIRED, positive),
    "hbm_bytes_per_s": num(REQUIRED, positive),
    # Older names of the link's numbers, refused with the one key that replaced each.
    "pcie_gbps_per_direction": Retired(_older_bandwidth),
    "pcie_efficiency": Retired(_older_bandwidth),
    "per_copy_overhead_s": Retired(lambda v: f"moved: give link.per_copy_overhead_s: {v!r} (seconds)"),
    "link": {
        "h2d_gbps": num(REQUIRED, non_negative, allow_inf=True),
        "d2h_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "bidir_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "per_copy_overhead_s": num(REQUIRED, non_negative),
        "per_copy_us": Retired(lambda v: "renamed: give link.per_copy_overhead_s, in seconds (2.35 us is 2.35e-6)"),
    },
    # Engine era -> STEP_SCHEMA (checked by _steps); none given: the uncalibrated default.
    "step_model": Field((dict,), None, nullable=True),
    # Needed only when a model runs tensor-parallel (checked with the model: check_pair).
    "allreduce": {
        # What carries it: nvlink (NVLink/NVSwitch) or pcie (GPUs that share only PCIe).
        "interconnect": Field((str,), None, ("nvlink", "pcie"), nullable=True),
        "latency_us": num(None, non_negative, nullable=True),
        "small_gbps": num(None, positive, nullable=True),
        "small_max_bytes": Field((int,), None, None, (positive,), nullable=True),
        "busbw_gbps": num(None, positive, nullable=True),
    },
    # Media below the CPU tier (tier_config.py); a medium left out gets the manager's measured defaults.
    "tiers": TIERS_SCHEMA,
    # A made-up device (a test's toy): its numbers are not held to the plausible ranges of their units.
    "skip_range_checks": Field((bool,), False),
}
MODEL_SCHEMA = {
    "name": Field((str,)),
    # The model's Hugging Face id (config.json's repository), how measured runs name it; optional.
    "hf_repo": Field((str,), None, nullable=True),
    "num_params": num(REQUIRED, positive),
    "num_layers": integer(REQUIRED, positive),
    "hidden_size": integer(REQUIRED, positive),
    "intermediate_size": Field((int,), None, None, (positive,), nullable=True),
    "num_heads": integer(REQUIRED, positive),
    "num_kv_heads": integer(REQUIRED, positive),
    "head_dim": Field((int,), None, None, (positive,), nullable=True),
    "vocab_size": integer(REQUIRED, non_negative),
    "tie_word_embeddings": Field((bool,), None, nullable=True),
    "dtype": Field((str,), REQUIRED, tuple(DTYPE_BYTES)),
    "weight_dtype": Field((str,), None, tuple(DTYPE_BYTES), nullable=True),
    "tensor_parallel": Field((int,), None, None, (positive,), nullable=True),
    # Mixture of experts (every layer's MLP): routed experts, how many each token uses, each one's width,
    # and an always-used shared expert's width (0: none).  num_experts 0: a dense model.
    "num_experts": integer(0, non_negative),
    "experts_per_token": integer(0, non_negative),
    "moe_intermediate_size": integer(0, non_negative),
    "shared_expert_intermediate_size": integer(0, non_negative),
    "skip_range_checks": Field((bool,), False),
}

# Plausible ranges of each physical number, by key path: (unit, low, high, typical).  Wide enough for
# any real GPU or model of today (a 1 GiB toy to 4 TiB; a TFLOP/s-class chip to 100 PFLOP/s), narrow
# enough that a factor of 1000 off (a unit prefix forgotten or doubled) falls outside; the typical
# value picks the likely fix among the rescalings that fall inside.
HARDWARE_RANGES: dict[str, tuple[str, float, float, float]] = {
    "memory_gib": ("GiB", 1.0, 4096.0, 80.0),
    "peak_bf16_flops": ("FLOP/s", 1e12, 1e17, 1e15),
    "hbm_bytes_per_s": ("bytes/s", 1e10, 1e14, 3e12),
    "link.h2d_gbps": ("GB/s", 0.1, 2000.0, 25.0),
    "link.d2h_gbps": ("GB/s", 0.1, 2000.0, 25.0),
    "link.bidir_gbps": ("GB/s", 0.1, 4000.0, 50.0),
    "link.per_copy_overhead_s": ("s", 0.0, 1e-3, 2e-6),
    "step_model.*.step_overhead_s": ("s", 0.0, 0.1, 1e-3),
    "step_model.*.per_layer_s": ("s", 0.0, 1e-3, 1e-5),
    "step_model.*.per_seq_s": ("s", 0.0, 1e-2, 1e-5),
    "step_model.*.frontend_s": ("s", 0.0, 2.0, 0.01),
    "allreduce.latency_us": ("us", 0.1, 1000.0, 10.0),
    "allreduce.small_gbps": ("GB/s", 0.1, 5000.0, 30.0),
    "allreduce.busbw_gbps": ("GB/s", 0.1, 5000.0, 200.0),
    "allreduce.small_max_bytes": ("bytes", 1024.0, float(1 << 34), 1e6),
    "tiers.*.bandwidth_gbps": ("GB/s", 0.01, 2000.0, 5.0),
    "tiers.*.write_gbps": ("GB/s", 0.01, 2000.0, 5.0),
    "tiers.*.block_latency_us": ("us", 0.0, 1e6, 50.0),
}
MODEL_RANGES: dict[str, tuple[str, float, float, float]] = {
    "num_params": ("parameters", 1e3, 1e13, 1e10),
    "num_layers": ("layers", 1, 1000, 32),
    "hidden_size": ("elements", 1, 1 << 17, 4096),
    "intermediate_size": ("elements", 1, 1 << 20, 14336),
    "num_heads": ("heads", 1, 1024, 32),
    "num_kv_heads": ("heads", 1, 1024, 8),
    "head_dim": ("elements", 1, 1024, 128),
    "vocab_size": ("tokens", 0, 1e7, 1e5),
    "num_experts": ("experts", 0, 4096, 16),
    "moe_intermediate_size": ("elements", 0, 1 << 20, 4096),
}


def _range_hint(v: float, lo: float, hi: float, typical: float) -> str:
    """The power-of-1000 rescaling of ``v`` inside [lo, hi] nearest ``typical``, as the user would write it."""
    best: tuple[float, int] | None = None
    for k in (3, 6, 9, 12, 15, -3, -6, -9, -12, -15):
        w = v * 10.0**k
        if lo <= w <= hi and w > 0:
            distance = abs(math.log10(w) - math.log10(typical))
            if best is None or distance < best[0]:
                best = (distance, k)
    if best is None:
        return ""
    k = best[1]
    plain = f"{v:g}"
    return f"{plain}e{k}" if "e" not in plain else f"{v * 10.0**k:g}"


def check_ranges(d: Mapping[str, Any], ranges: Mapping[str, tuple[str, float, float, float]], key: str) -> None:
    """Refuse a number outside the plausible range of its unit, naming the unit and the likely fix.

    ``d`` is a validated profile; ``*`` in a range's path matches every key at that level.
    Zero and infinity are not checked where the schema admits them (no link, a free link).
    """

    def walk(node: Any, parts: list[str], path: str, spec: tuple[str, float, float, float]) -> None:
        if not parts:
            if isinstance(node, bool) or not isinstance(node, int | float) or node == 0 or math.isinf(node):
                return
            unit, lo, hi, typical = spec
            if lo <= node <= hi:
                return
            hint = _range_hint(float(node), lo, hi, typical)
            fix = f"; did you mean {hint}?" if hint else ""
            raise ConfigError(
                f"{path}: {node:g} is {node:g} {unit}, outside the plausible {lo:g} to {hi:g} {unit}{fix} "
                "(a made-up device may say skip_range_checks: true)"
            )
        if not isinstance(node, Mapping):
            return
        head, rest = parts[0], parts[1:]
        for k in node if head == "*" else [head]:
            if k in node and node[k] is not None:
                walk(node[k], rest, f"{path}.{k}", spec)

    for dotted, spec in ranges.items():
        walk(d, dotted.split("."), key, spec)


GB = 1e9


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """The host link of one GPU, in bytes/s and seconds.

    Attributes:
        h2d_bytes_per_s: One-way host-to-device bandwidth of a large copy.
        d2h_bytes_per_s: One-way device-to-host bandwidth of a large copy.
        bidir_bytes_per_s: The most both directions move together (their sum),
            which on a real PCIe link is less than twice one way.
        per_copy_overhead_s: The fixed cost of one copy (call, DMA set-up); a
            copy of ``b`` bytes takes ``per_copy_overhead_s + b / bandwidth``, so
            small copies reach only ``b / (per_copy_overhead_s * bandwidth + b)``
            of the bandwidth.
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    bidir_bytes_per_s: float
    per_copy_overhead_s: float

    def effective_bytes_per_s(self, bytes_per_copy: float, direction: str = "H2D") -> float:
        """Bandwidth a stream of copies of ``bytes_per_copy`` bytes reaches in one direction."""
        bw = self.h2d_bytes_per_s if direction == "H2D" else self.d2h_bytes_per_s
        if bw <= 0:
            return 0.0
        if math.isinf(bw):
            return math.inf if self.per_copy_overhead_s == 0 else bytes_per_copy / self.per_copy_overhead_s
        return bytes_per_copy / (self.per_copy_overhead_s + bytes_per_copy / bw)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Step-time coefficients of one GPU under one engine era (see :mod:`tiered_kv.sim.compute`).

    Attributes:
        mfu: Fraction of peak BF16 FLOPs that decode rows and the LM head reach.
        prefill_mfu: Fraction of peak that prefill chunks reach (tall GEMMs, FlashAttention).
        hbm_efficiency: Fraction of datasheet HBM bandwidth that weight and KV reads reach.
        step_overhead_s: The serving engine's fixed cost of one step.
        per_layer_s: The fixed cost of one decoder layer in a step (its kernels' launch and
            tail, which no bandwidth term sees): a 32-layer model pays it 32 times a step.
        per_seq_s: Its cost per request in a step.
        frontend_s: The serving front end's cost per request (HTTP handling,
            tokenization, hand-off to the engine, detokenization and streaming of the
            first token), outside every step: a request reaches the scheduler this long
            after it was sent, so TTFT and E2E include it once and no step pays it.
    """

    mfu: float
    prefill_mfu: float
    hbm_efficiency: float
    step_overhead_s: float
    per_seq_s: float
    frontend_s: float
    per_layer_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AllReduceProfile:
    """Cost of one tensor-parallel all-reduce of ``b`` bytes over the GPUs' interconnect.

    Up to ``small_max_bytes`` (the latency-bound range of a one-shot kernel):
    ``latency_s + b / small_bytes_per_s``; above it, the large-message NCCL
    rate: the algorithm bandwidth of a ring, ``busbw * n / (2 (n - 1))``.
    ``interconnect`` is what carries it (``nvlink`` or ``pcie``): every number
    is measured over that interconnect, so a PCIe-only GPU never gets
    NVLink's all-reduce.
    """

    latency_s: float
    small_bytes_per_s: float
    small_max_bytes: int
    busbw_bytes_per_s: float
    interconnect: str = "nvlink"

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
    step: Mapping[str, StepProfile]  # engine era -> its step model; an era left out runs uncalibrated
    allreduce: AllReduceProfile | None  # None: the profile gives none (a model on one GPU needs none)
    tiers: Mapping[str, TierMedium] = field(default_factory=dict)  # tier name -> its medium (tier_config)
    derived: tuple[str, ...] = ()  # "key = value (rule)" for every number derived rather than given

    @property
    def per_copy_overhead_s(self) -> float:
        return self.link.per_copy_overhead_s

    def step_for(self, era: str) -> StepProfile | None:
        """The profile's step model for engine era ``era``, or None when it gives none."""
        return self.step.get(era)

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
    intermediate_size: int = 0  # the MLP's width (0: not known; derived from num_params when possible)
    hf_repo: str | None = None
    num_experts: int = 0  # routed experts of every layer's MLP (0: dense)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    derived: tuple[str, ...] = ()  # "key = value (rule)" for every field derived rather than given

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
    def embedding_params(self) -> float:
        """The input embedding table: looked up, not multiplied, so it costs no FLOPs."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def lm_head_params_per_gpu(self) -> float:
        """The output projection: multiplied only for the tokens a step samples."""
        return self.vocab_size * self.hidden_size / self.tensor_parallel

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (a gated MLP of ``moe_intermediate_size``); 0 for a dense model."""
        return 3.0 * self.hidden_size * self.moe_intermediate_size if self.num_experts else 0.0

    @property
    def params_per_gpu(self) -> float:
        """Parameters multiplied once per computed token: all but the embedding table and the LM head.

        A tied LM head is the embedding table itself, so it is subtracted once.  Of a mixture of
        experts, a token multiplies only its ``experts_per_token`` routed experts of each layer.
        """
        heads = self.embedding_params if self.tie_word_embeddings else 2 * self.embedding_params
        idle = self.num_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return max(self.num_params - heads - idle, 0.0) / self.tensor_parallel

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Memory the weights take on one GPU (every parameter, the embedding table included)."""
        return self.num_params / self.tensor_parallel * self.weight_dtype_bytes

    @property
    def streamed_weight_bytes_per_gpu(self) -> float:
        """Weight bytes one step reads from HBM: every matrix it multiplies (the table is only gathered).

        Of a mixture of experts, those of a one-token step (see :meth:`streamed_weight_bytes`).
        """
        return self.streamed_weight_bytes(1)

    def streamed_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of ``tokens`` tokens reads: a dense model's every matrix, whatever the tokens.

        A mixture of experts reads every expert some token of the step is routed to: with routing
        spread evenly, ``E x (1 - (1 - k / E) ^ tokens)`` experts of each layer, so a large batch reads
        nearly all of them and one token reads ``k``.
        """
        dense = (self.params_per_gpu + self.lm_head_params_per_gpu) * self.weight_dtype_bytes
        if not self.num_experts:
            return dense
        e, k = self.num_experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 1))
        extra = self.num_layers * (touched - k) * self.expert_params / self.tensor_parallel
        return dense + extra * self.weight_dtype_bytes

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


def _link(d: dict[str, Any], key: str, derived: list[str]) -> LinkProfile:
    """The host link, with the derivation rules of the module docstring."""
    link = d["link"]
    h2d = link["h2d_gbps"] * GB
    per_copy = link["per_copy_overhead_s"]
    if link["d2h_gbps"] is not None:
        d2h = link["d2h_gbps"] * GB
    else:
        d2h = h2d
        derived.append(f"{key}.link.d2h_gbps = {d2h / GB:g} (the H2D bandwidth: a symmetric link)")
    if link["bidir_gbps"] is not None:
        bidir = link["bidir_gbps"] * GB
        if bidir > h2d + d2h:
            raise ConfigError(
                f"{key}.link.bidir_gbps: {bidir / GB:g} GB/s both ways exceeds H2D + D2H ({(h2d + d2h) / GB:g} GB/s); "
                "two directions together cannot move more than each at its own peak"
            )
    else:
        bidir = h2d + d2h
        derived.append(f"{key}.link.bidir_gbps = {bidir / GB:g} (H2D + D2H: full duplex, no shared cap)")
    return LinkProfile(h2d, d2h, bidir, per_copy)


def _allreduce(a: dict[str, Any], key: str) -> AllReduceProfile | None:
    given = [k for k, v in a.items() if v is not None]
    if not given:
        return None
    lack = [k for k, v in a.items() if v is None]
    if lack:
        raise ConfigError(
            f"{key}.allreduce.{lack[0]}: required key is missing (it goes with {key}.allreduce.{given[0]})"
        )
    return AllReduceProfile(
        a["latency_us"] * 1e-6, a["small_gbps"] * GB, a["small_max_bytes"], a["busbw_gbps"] * GB, a["interconnect"]
    )


def _steps(raw: Any, key: str) -> dict[str, StepProfile]:
    """The step models of ``step_model:``, one per engine era given (none: the profile runs uncalibrated)."""
    if raw is None:
        return {}
    flat = sorted(k for k in raw if k in STEP_SCHEMA)
    if flat:
        raise ConfigError(
            f"{key}.step_model.{flat[0]}: the step model is given per engine era: put these numbers under "
            f"{key}.step_model.vllm-v1 (measured on vLLM 0.8 or later) or {key}.step_model.vllm-v0 (on vLLM 0.6's "
            "V0 engine); see docs/hardware.md"
        )
    unknown = sorted(k for k in raw if k not in ERAS)
    if unknown:
        raise ConfigError(f"{key}.step_model.{unknown[0]}: unknown engine era (known: {', '.join(ERAS)})")
    out = {}
    for era in ERAS:
        if era in raw:
            s = validate(raw[era], STEP_SCHEMA, f"{key}.step_model.{era}")
            out[era] = StepProfile(
                s["mfu"],
                s["prefill_mfu"],
                s["hbm_efficiency"],
                s["step_overhead_s"],
                s["per_seq_s"],
                s["frontend_s"],
                s["per_layer_s"],
            )
    return out


def load_hardware(ref: Any, key: str = "hardware") -> HardwareProfile:
    """A hardware profile; every physical number given or derived (module docstring), else ConfigError naming it."""
    d = _load(ref, "hardware", HARDWARE_SCHEMA, key)
    steps = _steps(d["step_model"], key)
    if not d["skip_range_checks"]:
        check_ranges(d, HARDWARE_RANGES, key)
    derived: list[str] = []
    link = _link(d, key, derived)
    return HardwareProfile(
        name=d["name"],
        memory_gib=d["memory_gib"],
        peak_bf16_flops=d["peak_bf16_flops"],
        hbm_bytes_per_s=d["hbm_bytes_per_s"],
        link=link,
        step=steps,
        allreduce=_allreduce(d["allreduce"], key),
        tiers=tier_media(d["tiers"], f"{key}.tiers"),
        derived=tuple(derived),
    )


#: The shipped profile whose step model a profile without one runs with (the GPU measured most).
UNCALIBRATED_FROM = "h100-sxm"


def uncalibrated_step(era: str) -> StepProfile:
    """The documented default step model of engine era ``era`` for a profile that gives none.

    It is the shipped :data:`UNCALIBRATED_FROM` profile's, fitted on another GPU: its
    efficiencies are fractions of the datasheet numbers, so they carry over to a GPU of
    another speed as well as anything without measurements can (docs/hardware.md says
    how far off that was on the GPUs that have measurements, and how to calibrate).
    """
    step = load_hardware(UNCALIBRATED_FROM).step_for(era)
    assert step is not None, f"the shipped {UNCALIBRATED_FROM} profile gives a step model for every era"
    return step


def load_model(ref: Any, key: str = "model") -> ModelProfile:
    """A model profile; every shape given or derived (module docstring), impossible shapes refused with the key."""
    d = _load(ref, "models", MODEL_SCHEMA, key)
    if not d.pop("skip_range_checks"):
        check_ranges(d, MODEL_RANGES, key)
    derived: list[str] = []
    heads, kv, tp = d["num_heads"], d["num_kv_heads"], d["tensor_parallel"]
    if heads % kv:
        raise ConfigError(
            f"{key}.num_kv_heads: {kv} does not divide {key}.num_heads ({heads}); "
            "each KV head serves a whole group of query heads"
        )
    if d["head_dim"] is None:
        if d["hidden_size"] % heads:
            raise ConfigError(
                f"{key}.head_dim: required key is missing (it cannot be derived: {key}.hidden_size "
                f"{d['hidden_size']} is not a multiple of {key}.num_heads {heads})"
            )
        d["head_dim"] = d["hidden_size"] // heads
        derived.append(f"{key}.head_dim = {d['head_dim']} (hidden_size / num_heads)")
    if d["weight_dtype"] is None:
        derived.append(f"{key}.weight_dtype = {d['dtype']} (the KV dtype)")
    if tp is None:
        tp = d["tensor_parallel"] = 1
        derived.append(f"{key}.tensor_parallel = 1 (one GPU)")
    if heads % tp:
        raise ConfigError(f"{key}.tensor_parallel: {tp} does not divide {key}.num_heads ({heads})")
    if kv % tp and tp % kv:
        raise ConfigError(
            f"{key}.tensor_parallel: {tp} GPUs can neither split {key}.num_kv_heads ({kv}) evenly nor replicate them"
        )
    if d["tie_word_embeddings"] is None:
        if d["vocab_size"] > 0:
            raise ConfigError(
                f"{key}.tie_word_embeddings: required key is missing (with vocab_size {d['vocab_size']}: "
                "true if the LM head is the embedding table)"
            )
        d["tie_word_embeddings"] = False
    tables = d["vocab_size"] * d["hidden_size"] * (1 if d["tie_word_embeddings"] else 2)
    attention = d["num_layers"] * d["hidden_size"] * 2 * (heads + kv) * d["head_dim"]
    if d["num_params"] < tables + attention:
        raise ConfigError(
            f"{key}.num_params: {d['num_params']:.4g} is fewer than the embedding tables ({tables:.4g}) and the "
            f"attention projections of {d['num_layers']} layers ({attention:.4g}) alone"
        )
    moe = d["num_experts"] > 0
    if moe and not 0 < d["experts_per_token"] <= d["num_experts"]:
        raise ConfigError(
            f"{key}.experts_per_token: must be 1 to num_experts ({d['num_experts']}), got {d['experts_per_token']}"
        )
    if moe and not d["moe_intermediate_size"]:
        raise ConfigError(f"{key}.moe_intermediate_size: required key is missing (with num_experts {d['num_experts']})")
    if not moe and (d["experts_per_token"] or d["moe_intermediate_size"] or d["shared_expert_intermediate_size"]):
        raise ConfigError(f"{key}.num_experts: required key is missing (the model gives other experts' keys)")
    if d["intermediate_size"] is None and moe:
        # The MLP activations of a token: its routed experts' and the shared expert's widths.
        d["intermediate_size"] = (
            d["experts_per_token"] * d["moe_intermediate_size"] + d["shared_expert_intermediate_size"]
        )
        derived.append(
            f"{key}.intermediate_size = {d['intermediate_size']} (the experts a token uses, and the shared one)"
        )
    if d["intermediate_size"] is None:
        # A gated (SwiGLU) MLP holds 3 x hidden x intermediate per layer: what the parameters leave.
        mlp = (d["num_params"] - tables - attention) / d["num_layers"]
        d["intermediate_size"] = max(1, round(mlp / (3 * d["hidden_size"])))
        derived.append(
            f"{key}.intermediate_size = {d['intermediate_size']} (the parameters left after the tables and the "
            "attention, as a gated MLP)"
        )
    return ModelProfile(**d, derived=tuple(derived))


def model_profile_raw(ref: Any, key: str = "model") -> dict[str, Any]:
    """A model profile's keys as given (validated, unresolved), to build a variant (another TP degree)."""
    d = _load(ref, "models", MODEL_SCHEMA, key)
    return {k: v for k, v in d.items() if v is not None}


def check_pair(hw: HardwareProfile, model: ModelProfile, hw_key: str = "hardware", model_key: str = "model") -> None:
    """Refuse what neither profile is wrong about alone: a tensor-parallel model on hardware with no all-reduce cost."""
    if model.tensor_parallel > 1 and hw.allreduce is None:
        raise ConfigError(
            f"{hw_key}.allreduce: required key is missing ({model_key} {model.name} runs on "
            f"{model.tensor_parallel} GPUs, so each step pays all-reduces; give latency_us, small_gbps, "
            "small_max_bytes and busbw_gbps)"
        )
