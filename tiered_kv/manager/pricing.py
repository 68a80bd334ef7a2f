"""The one place that prices moving KV against recomputing it: :class:`Quote` (preemption), :class:`LoadQuote` (load).

Victim policies rank by the quote, ``TierManager.preempt`` chooses a mode from it
and the scheduler reads it; admission decides from a load quote how much of a
prefix found below the GPU is worth loading.  Nobody else computes a swap,
load or recompute cost.  Sizes
come from the KV spec of the storage in use, so a cost model built for another
model's KV shape cannot slip in (the manager refuses it at construction).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.cost_model import CostModel, TierLink
from tiered_kv.manager.states import PreemptMode
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer.coalesce import count_runs


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
