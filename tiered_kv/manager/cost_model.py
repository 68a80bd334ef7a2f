"""Swap-versus-recompute cost model.

* Swap time for ``n`` blocks in ``r`` coalesced runs, one direction:
  ``n * bytes_per_block / bandwidth + r * per_copy_overhead``.
* Recompute time for a context of ``L`` tokens is a prefill of ``L`` tokens:
  ``L / prefill_tokens_per_s`` (linear term) plus the attention term, which
  grows with ``L^2``.  Either give ``prefill_tokens_per_s`` (+ optional
  ``prefill_quadratic_s_per_token2``) or derive both from FLOPs:
  ``(2 * params * L + 2 * layers * L^2 * attn_dim) / (peak_flops * mfu)``
  (the second term is QK^T and PV over a causal context, each ``L^2/2 * d``
  multiply-adds per layer, i.e. ``2 * L^2 * d`` FLOPs in all).

Parameters come from config and can be refitted from measurements with
:meth:`CostModel.calibrated` (least squares), then saved with ``to_dict``.

A tier below the CPU (disk, a remote store) adds its own link into the CPU
tier, a :class:`~tiered_kv.tiers.link.TierLink`: a block from there costs its link time and then the
CPU-to-GPU copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace

from tiered_kv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class CostModel:
    """Estimates in seconds.  Bandwidths are bytes/s; ``math.inf`` means free.

    Attributes:
        kv_bytes_per_token: KV bytes of one token over all layers (K and V).
        block_size: Tokens per block.
        d2h_bytes_per_s: GPU-to-CPU bandwidth (swap-out, offload).
        h2d_bytes_per_s: CPU-to-GPU bandwidth (swap-in, onboard).
        per_copy_overhead_s: Fixed cost of each coalesced copy (launch, DMA set-up).
        prefill_tokens_per_s: Linear prefill throughput.
        prefill_quadratic_s_per_token2: Seconds per token^2 (attention).
        prefill_overhead_s: Fixed cost per prefill.
    """

    kv_bytes_per_token: int
    block_size: int = 16
    d2h_bytes_per_s: float = 50e9
    h2d_bytes_per_s: float = 50e9
    per_copy_overhead_s: float = 10e-6
    prefill_tokens_per_s: float = 10_000.0
    prefill_quadratic_s_per_token2: float = 0.0
    prefill_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or isinstance(v, bool) or math.isnan(v) or v < 0:
                raise ConfigError(f"cost model: {f.name} must be a number >= 0, got {v!r}")
        if self.kv_bytes_per_token <= 0 or self.block_size <= 0:
            raise ConfigError("cost model: kv_bytes_per_token and block_size must be > 0")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError("cost model: prefill_tokens_per_s must be > 0")

    @classmethod
    def from_flops(
        cls,
        kv_bytes_per_token: int,
        num_params: float,
        num_layers: int,
        attn_dim: int,
        peak_flops: float,
        mfu: float,
        **kw: float,
    ) -> CostModel:
        """Prefill terms from FLOPs at a model-FLOPs utilisation ``mfu``."""
        if not 0 < mfu <= 1:
            raise ConfigError(f"cost model: mfu must be in (0, 1], got {mfu}")
        rate = peak_flops * mfu
        return cls(
            kv_bytes_per_token=kv_bytes_per_token,
            prefill_tokens_per_s=rate / (2.0 * num_params),
            # prefill_time charges q * L^2 / 2 for attention; 2 * layers * L^2 * d FLOPs need q = 4 * layers * d / rate.
            prefill_quadratic_s_per_token2=4.0 * num_layers * attn_dim / rate,
            **kw,  # type: ignore[arg-type]
        )

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def transfer_time(self, num_blocks: int, num_runs: int, direction: str) -> float:
        """Seconds to move ``num_blocks`` in ``num_runs`` copies; direction ``"D2H"`` or ``"H2D"``."""
        if num_blocks <= 0:
            return 0.0
        bw = self.d2h_bytes_per_s if direction == "D2H" else self.h2d_bytes_per_s
        if bw == 0:
            return math.inf
        return num_blocks * self.bytes_per_block / bw + num_runs * self.per_copy_overhead_s

    def swap_out_time(self, num_blocks: int, num_runs: int) -> float:
        return self.transfer_time(num_blocks, num_runs, "D2H")

    def swap_in_time(self, num_blocks: int, num_runs: int) -> float:
        return self.transfer_time(num_blocks, num_runs, "H2D")

    def prefill_time(self, num_tokens: int, context_before: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` after ``context_before`` cached tokens."""
        if num_tokens <= 0:
            return 0.0
        end = context_before + num_tokens
        quad = self.prefill_quadratic_s_per_token2 * (end * end - context_before * context_before) / 2.0
        return self.prefill_overhead_s + num_tokens / self.prefill_tokens_per_s + quad

    def recompute_time(self, context_len: int) -> float:
        """Seconds to rebuild the KV of ``context_len`` tokens from scratch."""
        return self.prefill_time(context_len)

    # --------------------------------------------------------------- calibration
    def calibrated(
        self,
        transfers: Iterable[tuple[str, int, int, float]] = (),
        prefills: Iterable[tuple[int, float]] = (),
    ) -> CostModel:
        """Refit parameters from measurements.

        Args:
            transfers: ``(direction, num_bytes, num_runs, seconds)`` samples;
                fits ``seconds = bytes / bw + runs * overhead`` per direction.
            prefills: ``(context_len, seconds)`` samples; fits
                ``seconds = c0 + L / tps + q * L^2 / 2`` (coefficients clamped >= 0).
        """
        upd: dict[str, float] = {}
        samples = list(transfers)
        overheads: list[float] = []
        for direction, key in (("D2H", "d2h_bytes_per_s"), ("H2D", "h2d_bytes_per_s")):
            rows = [(b, r, t) for d, b, r, t in samples if d == direction]
            if len(rows) >= 2:
                inv_bw, ovh = nnls([[float(b), float(r)] for b, r, _ in rows], [t for *_, t in rows])
                if inv_bw > 0:
                    upd[key] = 1.0 / inv_bw
                overheads.append(ovh)
        if overheads:
            upd["per_copy_overhead_s"] = sum(overheads) / len(overheads)
        pf = list(prefills)
        if len(pf) >= 3:
            c0, lin, quad = nnls([[1.0, float(n), n * n / 2.0] for n, _ in pf], [t for _, t in pf])
            # A zero linear term means attention dominates at every measured length.
            upd["prefill_tokens_per_s"] = 1.0 / lin if lin > 0 else math.inf
            upd["prefill_quadratic_s_per_token2"] = quad
            upd["prefill_overhead_s"] = c0
        return replace(self, **upd)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"cost model: unknown key(s) {unknown}")
        return cls(**data)  # type: ignore[arg-type]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small dense system."""
    n = len(b)
    m = [[*row[:], b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return [0.0] * n
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (active set by clamping; for a handful of columns).

    Columns are scaled before solving, because bytes (~1e9) and copy counts (~1)
    differ by many orders of magnitude.
    """
    k = len(xs[0])
    active = list(range(k))
    coef = [0.0] * k
    while active:
        cols = [[row[j] for j in active] for row in xs]
        scale = [max(abs(c[i]) for c in cols) or 1.0 for i in range(len(active))]
        z = [[c[i] / scale[i] for i in range(len(active))] for c in cols]
        n = len(active)
        ata = [[sum(r[i] * r[j] for r in z) for j in range(n)] for i in range(n)]
        aty = [sum(r[i] * y for r, y in zip(z, ys, strict=True)) for i in range(n)]
        sol = [v / scale[i] for i, v in enumerate(_solve(ata, aty))]
        coef = [0.0] * k
        for i, j in enumerate(active):
            coef[j] = max(sol[i], 0.0)
        negative = {active[i] for i, v in enumerate(sol) if v < 0}
        if not negative:
            break
        active = [j for j in active if j not in negative]
    return coef
