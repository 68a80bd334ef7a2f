"""What moving KV costs against recomputing it: the :class:`CostModel`, and the quotes priced from it.

* Swap time for ``n`` blocks in ``r`` coalesced runs, one direction:
  ``n * bytes_per_block / bandwidth + r * per_copy_overhead``.
* Recompute time for a context of ``L`` tokens is a prefill of ``L`` tokens:
  ``L / prefill_tokens_per_s`` (linear term) plus the attention term, which
  grows with ``L^2``.  Either give ``prefill_tokens_per_s`` (+ optional
  ``prefill_quadratic_s_per_token2``) or derive both from FLOPs:
  ``(2 * params * L + 2 * layers * L^2 * attn_dim) / (peak_flops * mfu)``
  (the second term is QK^T and PV over a causal context, each ``L^2/2 * d``
  multiply-adds per layer, i.e. ``2 * L^2 * d`` FLOPs in all).
* A tier below the CPU (disk, a remote store) adds its own link into the CPU
  tier, a :class:`~tiered_kv.tiers.link.TierLink`: a block from there costs its
  link time and then the CPU-to-GPU copy.

Parameters come from config and can be refitted from measurements with
:meth:`CostModel.calibrated` (least squares), then saved with ``to_dict``.

This is the one place that prices: :class:`Quote` (preempting a running
request), :class:`LoadQuote` (loading a prefix found below the GPU).  Victim
policies rank by the quote, ``TierManager.preempt`` chooses a mode from it and
the scheduler reads it; admission decides from a load quote how much of a
prefix is worth loading.  Nobody else computes a swap, load or recompute cost.
Sizes come from the KV spec of the storage in use, so a cost model built for
another model's KV shape cannot slip in (the manager refuses it at construction).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace

from tiered_kv import checks
from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.manager.states import PreemptMode
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.link import TierLink
from tiered_kv.transfer.plan import count_runs


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


@dataclass(frozen=True, slots=True)
class Quote:
    """What preempting one running request would cost, and free.

    Attributes:
        request_id: The request.
        num_tokens: Computed tokens whose KV is at stake.
        num_gpu_blocks: Blocks in its GPU table.
        blocks_freed: GPU blocks preemption releases (those it alone holds);
            a swap frees them when its copy completes, a recompute at once.
        blocks_to_move: Blocks a swap-out copies: the KV blocks the CPU tier
            does not have yet (full blocks are found there by hash).
        bytes_to_move: Their bytes, from the KV spec.
        num_runs: Runs of consecutive GPU block ids among them (one copy each).
        swap_out_s: Estimated time to copy the blocks to move out.
        swap_in_s: Estimated time to copy back what the GPU gives up (the
            blocks freed; shared blocks stay cached on the GPU).
        recompute_s: Estimated time to rebuild the KV by prefill.
        cpu_blocks_needed: CPU blocks a swap-out would take.
        cpu_has_room: Whether the CPU tier can take them now (it may evict
            unpinned cached blocks to do so).
        has_cpu_tier: False when there is no tier to swap to at all.
    """

    request_id: Hashable
    num_tokens: int
    num_gpu_blocks: int
    blocks_freed: int
    blocks_to_move: int
    bytes_to_move: int
    num_runs: int
    swap_out_s: float
    swap_in_s: float
    recompute_s: float
    cpu_blocks_needed: int
    cpu_has_room: bool
    has_cpu_tier: bool = True

    @property
    def swap_s(self) -> float:
        """Time lost by swapping: out now, back in later (both on the request's critical path)."""
        return self.swap_out_s + self.swap_in_s

    @property
    def can_swap(self) -> bool:
        return self.has_cpu_tier and self.cpu_has_room

    def choose(self, mode: str) -> tuple[PreemptMode | None, str]:
        """The mode to preempt with under the caller's instruction, and why, in words.

        ``"auto"`` takes the cheaper mode; when swapping would be cheaper but
        is impossible, it recomputes and says so.  ``"swap"`` answers ``None``
        when a swap is impossible: forcing it cannot switch silently.
        """
        swap_ms, rec_ms = self.swap_s * 1e3, self.recompute_s * 1e3
        costs = (
            f"swap {swap_ms:.3g} ms ({self.blocks_to_move} blocks out), "
            f"recompute {rec_ms:.3g} ms ({self.num_tokens} tokens)"
        )
        why_not = (
            "there is no CPU tier"
            if not self.has_cpu_tier
            else f"the CPU tier has no room for {self.cpu_blocks_needed} blocks"
        )
        if mode == "recompute":
            return PreemptMode.RECOMPUTE, f"recompute requested; {costs}"
        if mode == "swap":
            if self.can_swap:
                return PreemptMode.SWAP, f"swap requested; {costs}"
            return None, f"swap requested but {why_not}"
        if not self.can_swap:
            cheaper = " although swapping would be cheaper" if self.swap_s < self.recompute_s else ""
            return PreemptMode.RECOMPUTE, f"recompute: {why_not}{cheaper}; {costs}"
        if self.swap_s < self.recompute_s:
            return PreemptMode.SWAP, f"swap is cheaper: {costs}"
        return PreemptMode.RECOMPUTE, f"recompute is no dearer: {costs}"

    def cost(self, mode: str) -> float:
        """Seconds lost under ``mode`` (inf when that mode is impossible).

        The mode :meth:`choose` picks, without spelling out why: policies ask
        this of every candidate they rank.
        """
        if mode == "recompute":
            return self.recompute_s
        if not (self.has_cpu_tier and self.cpu_has_room):
            return float("inf") if mode == "swap" else self.recompute_s
        swap_s = self.swap_out_s + self.swap_in_s
        return swap_s if mode == "swap" or swap_s < self.recompute_s else self.recompute_s


def price(
    cost_model: CostModel,
    request_id: Hashable,
    num_tokens: int,
    num_gpu_blocks: int,
    freed_block_ids: list[int],
    moved_block_ids: list[int],
    cpu_blocks_needed: int,
    cpu_has_room: bool,
    has_cpu_tier: bool,
) -> Quote:
    """Build a quote from the facts the manager gathered (see ``TierManager.quote``)."""
    n = len(moved_block_ids)
    runs = count_runs(moved_block_ids)
    freed = len(freed_block_ids)
    return Quote(
        request_id=request_id,
        num_tokens=num_tokens,
        num_gpu_blocks=num_gpu_blocks,
        blocks_freed=freed,
        blocks_to_move=n,
        bytes_to_move=n * cost_model.bytes_per_block,
        num_runs=runs,
        swap_out_s=cost_model.swap_out_time(n, runs),
        swap_in_s=cost_model.swap_in_time(freed, count_runs(freed_block_ids)),
        recompute_s=cost_model.recompute_time(num_tokens),
        cpu_blocks_needed=cpu_blocks_needed,
        cpu_has_room=cpu_has_room,
        has_cpu_tier=has_cpu_tier,
    )


def checked_cost_model(spec: KVSpec | None, cost_model: CostModel | None, engine: object, block_size: int) -> CostModel:
    """The cost model, checked against the KV geometry of the storage in use."""
    if spec is None:
        spec = getattr(engine, "spec", None) if isinstance(getattr(engine, "spec", None), KVSpec) else None
    if spec is not None:
        checks.instance("kv_spec", spec, KVSpec)
        if spec.block_size != block_size:
            raise InvalidArgumentError(f"kv_spec block_size {spec.block_size} != manager block_size {block_size}")
    if cost_model is None:
        if spec is None:
            raise InvalidArgumentError("give kv_spec= or a cost_model: the manager will not guess KV sizes")
        return CostModel(kv_bytes_per_token=spec.bytes_per_token, block_size=block_size)
    checks.instance("cost_model", cost_model, CostModel)
    if cost_model.block_size != block_size:
        raise InvalidArgumentError(f"cost model block_size {cost_model.block_size} != manager block_size {block_size}")
    if spec is not None and cost_model.kv_bytes_per_token != spec.bytes_per_token:
        raise InvalidArgumentError(
            f"the cost model was built for {cost_model.kv_bytes_per_token} KV bytes per token, but the storage in "
            f"use holds {spec.bytes_per_token} ({spec.num_layers} layers x {spec.num_kv_heads} KV heads x "
            f"{spec.head_dim} x {spec.dtype}); build the cost model for this KV shape"
        )
    return cost_model


@dataclass(frozen=True, slots=True)
class LoadQuote:
    """How much of a new request's prefix, found below the GPU, is worth loading rather than recomputing.

    A block below the CPU tier is staged into it over its tier's :class:`TierLink`,
    then copied to the GPU; a block on the CPU tier only pays the copy.  The
    quote loads the leading ``num_blocks`` that minimise load time plus the
    prefill of everything after them (a later block is useless without the ones
    before it, so only a prefix can be loaded).

    Attributes:
        request_id: The request.
        media: For each block of the prefix the tiers hold, the medium it would come from.
        num_blocks: Leading blocks to load; the rest are recomputed.
        load_s: Estimated time to load those blocks.
        saved_s: Prefill time they save.
        rest_load_s: Estimated time to load the blocks declined (0 when none is).
        rest_recompute_s: Prefill time of the blocks declined.
        reason: The decision, in words.
    """

    request_id: Hashable
    media: tuple[str, ...]
    num_blocks: int
    load_s: float
    saved_s: float
    rest_load_s: float
    rest_recompute_s: float
    reason: str

    @property
    def num_declined(self) -> int:
        """Blocks found but recomputed."""
        return len(self.media) - self.num_blocks


def _spell(media: Sequence[str]) -> str:
    return ", ".join(f"{n} from {m}" for m, n in Counter(media).items())


def price_load(
    cost_model: CostModel,
    request_id: Hashable,
    media: Sequence[str],
    links: Sequence[TierLink | None],
    context_tokens: int,
    num_tokens: int,
) -> LoadQuote:
    """Price loading a prefix found below the GPU, block by block, against recomputing it.

    Args:
        cost_model: CPU-to-GPU copy and prefill estimates.
        request_id: The request.
        media: Per block of the prefix found, its medium.
        links: Per block, the link that stages it into the CPU tier (``None``: it is on the CPU tier).
        context_tokens: Tokens before the prefix (cached on the GPU).
        num_tokens: The request's tokens; the last one is always computed.
    """
    bs, nbytes = cost_model.block_size, cost_model.bytes_per_block
    n = len(media)
    h2d = cost_model.swap_in_time(1, 0)
    loads = [0.0]  # loads[k]: time to load the first k blocks
    for link in links:
        loads.append(loads[-1] + h2d + (link.load_time(1, nbytes) if link is not None else 0.0))
    for k in range(1, n + 1):
        loads[k] += cost_model.per_copy_overhead_s
    starts = [context_tokens + k * bs for k in range(n + 1)]
    prefill = [cost_model.prefill_time(num_tokens - start, start) for start in starts]
    best = min(range(n + 1), key=lambda k: (loads[k] + prefill[k], -k))  # a tie loads: the data is there already
    load_s, saved = loads[best], prefill[0] - prefill[best]
    rest_load, rest_rec = loads[n] - loads[best], prefill[best] - prefill[n]
    ms = 1e3
    if best == n:
        reason = f"load {n} blocks ({_spell(media)}): {load_s * ms:.3g} ms, against {saved * ms:.3g} ms to recompute"
    else:
        reason = (
            f"recompute {n - best} blocks ({_spell(media[best:])}): loading them would take {rest_load * ms:.3g} ms, "
            f"recomputing {rest_rec * ms:.3g} ms; load {best} blocks"
        )
    return LoadQuote(request_id, tuple(media), best, load_s, saved, rest_load, rest_rec, reason)
