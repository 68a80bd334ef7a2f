"""Tier-manager metrics, readable as one snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters kept by the manager."""

    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swap_out_blocks: int = 0
    swap_out_bytes: int = 0
    swap_in_blocks: int = 0
    swap_in_bytes: int = 0
    onboard_blocks: int = 0
    onboard_bytes: int = 0
    offload_blocks: int = 0
    offload_bytes: int = 0
    plans_submitted: int = 0
    plans_failed: int = 0
    plans_cancelled: int = 0
    tokens_recomputed: int = 0
    tokens_lost_on_resume: int = 0
    gpu_query_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_query_tokens: int = 0
    cpu_hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Counters plus the gauges of one instant."""

    counters: TierCounters
    gpu_usage: float
    cpu_usage: float
    gpu_free_blocks: int
    cpu_free_blocks: int
    plans_in_flight: int
    requests_by_state: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_hit_rate(self) -> float:
        c = self.counters
        return c.gpu_hit_tokens / c.gpu_query_tokens if c.gpu_query_tokens else 0.0

    @property
    def cpu_hit_rate(self) -> float:
        c = self.counters
        return c.cpu_hit_tokens / c.cpu_query_tokens if c.cpu_query_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = asdict(self.counters)
        d.update(
            gpu_usage=self.gpu_usage,
            cpu_usage=self.cpu_usage,
            gpu_free_blocks=self.gpu_free_blocks,
            cpu_free_blocks=self.cpu_free_blocks,
            plans_in_flight=self.plans_in_flight,
            gpu_hit_rate=self.gpu_hit_rate,
            cpu_hit_rate=self.cpu_hit_rate,
            requests_by_state=dict(self.requests_by_state),
        )
        return d
