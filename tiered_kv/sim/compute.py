"""Per-step compute time from a roofline.

For a batch whose scheduled requests compute ``n`` new tokens after ``c``
cached ones:

* FLOPs = ``2 * params * sum(n)`` (the dense layers) plus attention
  ``2 * layers * attn_dim * ((c + n)^2 - c^2)`` per request (QK^T and PV over a
  causal context; for a decode token, ``4 * layers * attn_dim * c``);
* bytes = the weights once, plus every scheduled request's KV read
  (``(c + n) * kv_bytes_per_token``) and its new KV written;
* step time = ``overhead + max(FLOPs / (peak * MFU), bytes / (HBM bandwidth * efficiency))``.

Prefill-heavy steps land on the compute roof, decode-heavy steps on the memory roof.

A calibrated engine (``tiered-kv crossover``) replaces the roofline with a
fitted linear step model: ``intercept + per_token * tokens + per_attn_unit *
attention units + per_kv_token * KV tokens + per_seq * requests``, whose
per-request term carries the scheduler's and manager's own overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.sim.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True, slots=True)
class ComputeModel:
    hw: HardwareProfile
    model: ModelProfile
    mfu: float = 0.5
    hbm_efficiency: float = 0.8
    step_overhead_s: float = 5e-4
    fixed_step_s: float | None = None  # tests: every step takes exactly this long
    linear: tuple[float, float, float, float, float] | None = None  # calibrated step model, see module doc

    def step_time(self, num_tokens: int, attn_units: float, kv_tokens: int, num_seqs: int = 1) -> float:
        """Seconds for one step.

        Args:
            num_tokens: Tokens computed in the step (all requests).
            attn_units: ``sum((c + n)^2 - c^2)`` over scheduled requests.
            kv_tokens: ``sum(c + n)``: KV tokens read (and, for the new ones, written).
            num_seqs: Requests in the step (only the calibrated model uses it).
        """
        if self.fixed_step_s is not None:
            return self.fixed_step_s
        if self.linear is not None:
            a, b, c, d, e = self.linear
            return a + b * num_tokens + c * attn_units + d * kv_tokens + e * num_seqs
        m = self.model
        flops = 2.0 * m.params_per_gpu * num_tokens + 2.0 * m.num_layers * m.attn_dim_per_gpu * attn_units
        t_compute = flops / (self.hw.peak_bf16_flops * self.mfu)
        nbytes = m.weight_bytes_per_gpu + kv_tokens * m.kv_bytes_per_token
        t_memory = nbytes / (self.hw.hbm_bytes_per_s * self.hbm_efficiency)
        return self.step_overhead_s + max(t_compute, t_memory)

    def prefill_tokens_per_s(self) -> float:
        """Linear prefill throughput at the compute roof (for the manager's cost model)."""
        return self.hw.peak_bf16_flops * self.mfu / (2.0 * self.model.params_per_gpu)

    def prefill_quadratic(self) -> float:
        """Seconds per token^2 of attention (the manager's cost model takes ``q * L^2 / 2``)."""
        m = self.model
        return 4.0 * m.num_layers * m.attn_dim_per_gpu / (self.hw.peak_bf16_flops * self.mfu)
