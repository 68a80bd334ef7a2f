"""Tier-manager metrics: monotonic counters plus the gauges of one instant."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace

from tiered_kv.core.block_pool import BlockPool
from tiered_kv.manager.states import Residency
from tiered_kv.tiers.cpu_store import CPUStore


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters kept by the manager (tokens for lookups, blocks and bytes for copies).

    Lookups are counted at each admission, as vLLM 0.33 counts its ``PrefixCacheStats``
    (and its connector's): ``gpu_*`` and ``cpu_*`` for requests never preempted, whose
    hits are prefix reuse between requests; ``preempted_*`` for the re-admission of a
    request preempted before (``Request.num_preemptions > 0``: a recompute victim), whose
    hits are mostly its own KV found again.  Kept apart so that re-admissions do not
    inflate the hit rate of fresh traffic: a workload that shares nothing has a GPU hit
    rate of 0 however often it is preempted.  ``cpu_query_tokens`` counts the tokens not
    found on the GPU, when there is a CPU tier; a CPU hit is a block found in the CPU
    tier, whatever wrote it there (write-through, a swap-out, a block staged from below).
    """

    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swaps_dropped: int = 0
    swap_out_blocks: int = 0
    swap_out_bytes: int = 0
    swap_in_blocks: int = 0
    swap_in_bytes: int = 0
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    plans_submitted: int = 0  # read from the copies in flight by TierManager.counters and snapshots
    plans_failed: int = 0
    plans_cancelled: int = 0
    gpu_blocks_evicted: int = 0  # cached GPU blocks whose data was dropped when the block was handed out
    cpu_blocks_evicted: int = 0  # read from the store's statistics by TierManager.counters and snapshots
    gpu_query_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_query_tokens: int = 0
    cpu_hit_tokens: int = 0
    preempted_gpu_query_tokens: int = 0
    preempted_gpu_hit_tokens: int = 0
    preempted_cpu_query_tokens: int = 0
    preempted_cpu_hit_tokens: int = 0

    def count_lookup(self, num_tokens: int, gpu_hits: int, cpu_hits: int, has_cpu_tier: bool, preempted: bool) -> None:
        if preempted:
            self.preempted_gpu_query_tokens += num_tokens
            self.preempted_gpu_hit_tokens += gpu_hits
            if has_cpu_tier:
                self.preempted_cpu_query_tokens += num_tokens - gpu_hits
                self.preempted_cpu_hit_tokens += cpu_hits
            return
        self.gpu_query_tokens += num_tokens
        self.gpu_hit_tokens += gpu_hits
        if has_cpu_tier:
            self.cpu_query_tokens += num_tokens - gpu_hits
            self.cpu_hit_tokens += cpu_hits

    def copy(self) -> TierCounters:
        return replace(self)


@dataclass(slots=True)
class LowerTierCounters:
    """Monotonic block counters of one tier below the CPU (disk, remote), kept by the manager.

    Attributes:
        hit_blocks: Prefix blocks of admitted requests that this was the highest tier to hold.
        declined_blocks: Of those, blocks not loaded: dearer than recomputing (the load
            decision log says why), no room to stage them in the CPU tier, or after a
            block of the prefix that could not be loaded.
        loaded_blocks: Blocks staged from here into the CPU tier (for a request, or on the
            way to a lower tier).
        load_failed_blocks: Blocks a load did not bring (missing, corrupt, an I/O error).
        stored_blocks: Blocks written here from the CPU tier.
        store_failed_blocks: Blocks a write did not store (full, an I/O error, the server down).
    """

    hit_blocks: int = 0
    declined_blocks: int = 0
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    stored_blocks: int = 0
    store_failed_blocks: int = 0

    def copy(self) -> LowerTierCounters:
        return replace(self)


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Counters plus the gauges of one instant."""

    counters: TierCounters
    gpu_blocks: int  # usable blocks (the null block and the store's reserved slot excluded)
    cpu_blocks: int
    gpu_usage: float
    cpu_usage: float
    gpu_free_blocks: int
    cpu_free_blocks: int
    cpu_cached_blocks: int
    cpu_pinned_blocks: int  # pinned by swapped requests and loads, or being written
    plans_in_flight: int
    requests_by_residency: dict[str, int] = field(default_factory=dict)
    lower_tiers: dict[str, LowerTierCounters] = field(default_factory=dict)  # per medium below the CPU
    chain_lost_blocks: int = 0  # blocks evicted from the CPU tier while no tier below held them

    @property
    def gpu_hit_rate(self) -> float:
        """GPU prefix hits over tokens looked up, at the admission of requests never preempted (vLLM's)."""
        c = self.counters
        return c.gpu_hit_tokens / c.gpu_query_tokens if c.gpu_query_tokens else 0.0

    @property
    def cpu_hit_rate(self) -> float:
        """CPU-tier hits over the tokens not found on the GPU, at the admission of requests never preempted."""
        c = self.counters
        return c.cpu_hit_tokens / c.cpu_query_tokens if c.cpu_query_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = asdict(self.counters)
        d.update(
            gpu_blocks=self.gpu_blocks,
            cpu_blocks=self.cpu_blocks,
            gpu_usage=self.gpu_usage,
            cpu_usage=self.cpu_usage,
            gpu_free_blocks=self.gpu_free_blocks,
            cpu_free_blocks=self.cpu_free_blocks,
            cpu_cached_blocks=self.cpu_cached_blocks,
            cpu_pinned_blocks=self.cpu_pinned_blocks,
            plans_in_flight=self.plans_in_flight,
            gpu_hit_rate=self.gpu_hit_rate,
            cpu_hit_rate=self.cpu_hit_rate,
            requests_by_residency=dict(self.requests_by_residency),
        )
        if self.lower_tiers:
            d["lower_tiers"] = {m: asdict(c) for m, c in self.lower_tiers.items()}
            d["chain_lost_blocks"] = self.chain_lost_blocks
        return d


def snapshot(
    counters: TierCounters,
    in_flight: int,
    pool: BlockPool,
    store: CPUStore,
    residencies: Iterable[Residency],
    lower_tiers: Mapping[str, LowerTierCounters] | None = None,
    chain_lost_blocks: int = 0,
) -> MetricsSnapshot:
    """A snapshot of the manager's live counters (copied) and of the tiers' gauges now."""
    by_residency: dict[str, int] = {}
    for r in residencies:
        by_residency[r.value] = by_residency.get(r.value, 0) + 1
    return MetricsSnapshot(
        counters=counters.copy(),
        gpu_blocks=pool.num_blocks - 1,
        cpu_blocks=store.num_blocks - 1,
        gpu_usage=pool.get_usage(),
        cpu_usage=store.usage,
        gpu_free_blocks=pool.get_num_free_blocks(),
        cpu_free_blocks=store.num_free,
        cpu_cached_blocks=store.num_used,
        cpu_pinned_blocks=store.num_pinned + store.num_pending,
        plans_in_flight=in_flight,
        requests_by_residency=by_residency,
        lower_tiers={m: c.copy() for m, c in (lower_tiers or {}).items()},
        chain_lost_blocks=chain_lost_blocks,
    )
