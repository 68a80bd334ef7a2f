"""Prefix-cache statistics, counted in tokens as vLLM's ``PrefixCacheStats`` are."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters since the last ``make_prefix_cache_stats()``.

    Attributes:
        requests: Lookups made (one per ``get_computed_blocks`` call).
        queries: Tokens looked up (the request's whole length).
        hits: Tokens found cached.
        preempted_requests / preempted_queries / preempted_hits: the same for
            requests that were preempted before, kept apart so that re-admission
            after preemption does not inflate the hit rate of fresh traffic.
        reset: Whether the cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Token hit rate of fresh requests (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0
