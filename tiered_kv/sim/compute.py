"""Per-step compute time: a roofline with the terms that matter at moderate batch sizes.

For a batch of ``B`` requests computing ``n`` new tokens each after ``c``
cached ones, of which ``S`` sample a token:

* compute: ``2 * P * sum(n)`` FLOPs of the dense layers, where ``P`` excludes
  the embedding table (looked up, not multiplied) and the LM head; plus
  ``2 * vocab * hidden * S`` for the LM head (vLLM computes logits only where
  it samples); plus attention ``2 * layers * attn_dim * ((c + n)^2 - c^2)``
  per request (QK^T and PV over a causal context: a whole prompt of ``n``
  tokens spends as much on attention as on the dense layers at ``n = P /
  (layers * attn_dim)``, 53k tokens for Llama-3-8B, so long prefills are
  priced by it);
* two compute efficiencies: a prefill chunk (a request computing more than
  one token in the step) is a tall GEMM and a FlashAttention pass over its
  whole context, which reach ``prefill_mfu`` of peak; one-token decode rows
  (and the LM head) run as short GEMMs that reach ``mfu``.  The two are
  fitted separately, ``prefill_mfu`` to prefill-dominated points, because
  decode-heavy points barely constrain it;
* memory: the streamed weights once (every matrix multiplied; not the
  embedding table; of a mixture of experts, the experts the step's tokens are
  routed to) plus every scheduled request's KV, ``(c + n) * kv_bytes``;
* tensor parallelism: two all-reduces of the step's hidden states per layer
  (after attention and after the MLP), each ``sum(n) * hidden * dtype`` bytes,
  priced by the hardware's all-reduce profile;
* engine overheads: a per-step cost (scheduling, sampling set-up), a
  per-layer cost (each decoder layer's kernels have a launch and a tail that
  no bandwidth term sees: a few microseconds each, a dozen kernels a layer,
  so a 80-layer model pays more than a 28-layer one at the same bytes) and a
  per-sequence cost (input preparation, sampling, detokenisation).

``step = per_step + per_layer * layers + per_seq * B + max(decode FLOPs /
(peak * mfu) + prefill FLOPs / (peak * prefill_mfu), memory / (HBM *
hbm_efficiency)) + all-reduce``.

The serving front end (HTTP handling, tokenization, detokenization) is not in
the step: it is a per-request cost the simulator adds before a request reaches
the scheduler (``frontend_s`` of the hardware profile's step model).

The coefficients (``mfu``, ``hbm_efficiency``, ``per_step``, ``per_layer``,
``per_seq``) come from the hardware profile's step model for the engine era
the run simulates (:mod:`~tiered_kv.sim.engine_version`), where they were
fitted to measured serving runs (the fit and its residuals sit beside them in
the YAML, and ``tiered-kv validate`` prints predicted against measured).  A calibrated
engine (``tiered-kv crossover``) replaces the whole model with a fitted
linear step model: ``intercept + per_token * tokens + per_attn_unit *
attention units + per_kv_token * KV tokens + per_seq * requests``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.sim.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True, slots=True)
class StepParts:
    """The terms of one roofline step (:meth:`ComputeModel.parts`)."""

    num_seqs: int
    compute_s: float
    memory_bytes: float
    memory_s: float
    allreduce_s: float


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """The step-time model of one GPU running one model (see the module docstring).

    Attributes:
        hw, model: The profiles.
        mfu: Fraction of peak BF16 FLOPs reached by decode rows (one token per request) and the LM head.
        hbm_efficiency: Fraction of datasheet HBM bandwidth reached by weight and KV reads.
        step_overhead_s: Fixed cost of one step.
        fixed_step_s: Tests: every step takes exactly this long.
        linear: A calibrated linear step model (see module doc); replaces the roofline.
        per_seq_s: Cost of each request in the step.
        prefill_mfu: Fraction of peak reached by prefill chunks (dense and attention FLOPs of
            requests computing more than one token); ``None`` means ``mfu`` (one efficiency).
        frontend_s: The serving front end's cost per request; not part of any step (the
            simulator delays each request's entry into the scheduler by it).
        scheduler_steps: Steps a decode-only batch runs per scheduling decision (vLLM 0.6's
            multi-step scheduling; 1 in vLLM v1); read by the simulator, not by ``step_time``.
        per_layer_s: Cost of each decoder layer in a step (its kernels' launches and tails).
    """

    hw: HardwareProfile
    model: ModelProfile
    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    step_overhead_s: float = 5e-4
    fixed_step_s: float | None = None
    linear: tuple[float, float, float, float, float] | None = None
    per_seq_s: float = 0.0
    prefill_mfu: float | None = None
    frontend_s: float = 0.0
    scheduler_steps: int = 1
    per_layer_s: float = 0.0
    _fixed_s: float = field(init=False, repr=False, compare=False)
    _weight_bytes: float = field(init=False, repr=False, compare=False)
    _moe: bool = field(init=False, repr=False, compare=False)
    _flops_per_token: float = field(init=False, repr=False, compare=False)
    _flops_per_sample: float = field(init=False, repr=False, compare=False)
    _flops_per_attn: float = field(init=False, repr=False, compare=False)
    _compute_rate: float = field(init=False, repr=False, compare=False)
    _prefill_rate: float = field(init=False, repr=False, compare=False)
    _memory_rate: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = self.model
        set_ = object.__setattr__
        set_(self, "_flops_per_token", 2.0 * m.params_per_gpu)
        set_(self, "_flops_per_sample", 2.0 * m.lm_head_params_per_gpu)
        set_(self, "_flops_per_attn", 2.0 * m.num_layers * m.attn_dim_per_gpu)
        set_(self, "_compute_rate", self.hw.peak_bf16_flops * self.mfu)
        pre = self.mfu if self.prefill_mfu is None else self.prefill_mfu
        set_(self, "_prefill_rate", self.hw.peak_bf16_flops * pre)
        set_(self, "_memory_rate", self.hw.hbm_bytes_per_s * self.hbm_efficiency)
        set_(self, "_fixed_s", self.step_overhead_s + self.per_layer_s * m.num_layers)
        set_(self, "_weight_bytes", m.streamed_weight_bytes_per_gpu)
        set_(self, "_moe", m.num_experts > 0)

    def step_time(
        self,
        num_tokens: int,
        attn_units: float,
        kv_tokens: int,
        num_seqs: int = 1,
        num_sampled: int | None = None,
        prefill_tokens: int = 0,
        prefill_attn_units: float = 0.0,
    ) -> float:
        """Seconds for one step.

        Args:
            num_tokens: Tokens computed in the step (all requests).
            attn_units: ``sum((c + n)^2 - c^2)`` over scheduled requests.
            kv_tokens: ``sum(c + n)``: KV tokens read (and, for the new ones, written).
            num_seqs: Requests in the step.
            num_sampled: Requests that sample a token this step (default: all of them).
            prefill_tokens: Of ``num_tokens``, those of requests computing more than one token.
            prefill_attn_units: Of ``attn_units``, those of the same requests.
        """
        if self.fixed_step_s is not None:
            return self.fixed_step_s
        if self.linear is not None:
            a, b, c, d, e = self.linear
            return a + b * num_tokens + c * attn_units + d * kv_tokens + e * num_seqs
        m = self.model
        sampled = num_seqs if num_sampled is None else num_sampled
        fpt, fpa = self._flops_per_token, self._flops_per_attn
        decode_attn = attn_units - prefill_attn_units
        decode = fpt * (num_tokens - prefill_tokens) + self._flops_per_sample * sampled + fpa * decode_attn
        prefill = fpt * prefill_tokens + fpa * prefill_attn_units
        t_compute = decode / self._compute_rate + prefill / self._prefill_rate
        weights = m.streamed_weight_bytes(num_tokens) if self._moe else self._weight_bytes
        t_memory = (weights + kv_tokens * m.kv_bytes_per_token) / self._memory_rate
        t = self._fixed_s + self.per_seq_s * num_seqs + (t_compute if t_compute > t_memory else t_memory)
        if m.tensor_parallel > 1:
            t += self.allreduce_time(num_tokens)
        return t

    def parts(
        self,
        num_tokens: int,
        attn_units: float,
        kv_tokens: int,
        num_seqs: int = 1,
        num_sampled: int | None = None,
        prefill_tokens: int = 0,
        prefill_attn_units: float = 0.0,
    ) -> StepParts:
        """The roofline step's terms (same arguments as :meth:`step_time`), for fits that weigh each one.

        ``step_time`` is ``fixed + per_seq * seqs + max(compute, memory) + allreduce`` of these;
        ``memory_bytes`` is what the memory term reads (streamed weights and the KV of every request).
        """
        m = self.model
        sampled = num_seqs if num_sampled is None else num_sampled
        fpt, fpa = self._flops_per_token, self._flops_per_attn
        decode = (
            fpt * (num_tokens - prefill_tokens)
            + self._flops_per_sample * sampled
            + fpa * (attn_units - prefill_attn_units)
        )
        prefill = fpt * prefill_tokens + fpa * prefill_attn_units
        nbytes = m.streamed_weight_bytes(num_tokens) + kv_tokens * m.kv_bytes_per_token
        return StepParts(
            num_seqs=num_seqs,
            compute_s=decode / self._compute_rate + prefill / self._prefill_rate,
            memory_bytes=nbytes,
            memory_s=nbytes / self._memory_rate,
            allreduce_s=self.allreduce_time(num_tokens),
        )

    def allreduce_time(self, num_tokens: int) -> float:
        """Two all-reduces of the step's hidden states per layer (tensor parallelism only)."""
        m = self.model
        if m.tensor_parallel <= 1:
            return 0.0
        ar = self.hw.allreduce
        assert ar is not None, "profiles.check_pair refuses a tensor-parallel model on a profile without allreduce"
        nbytes = num_tokens * m.allreduce_bytes_per_token
        return 2 * m.num_layers * ar.seconds(nbytes, m.tensor_parallel)

    def prefill_tokens_per_s(self) -> float:
        """Linear prefill throughput at the prefill compute roof (for the manager's cost model)."""
        return self._prefill_rate / self._flops_per_token

    def prefill_quadratic(self) -> float:
        """Seconds per token^2 of attention (the manager's cost model takes ``q * L^2 / 2``)."""
        return 2.0 * self._flops_per_attn / self._prefill_rate
