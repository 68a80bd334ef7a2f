"""What is exported: every metric's name, type, help text, labels and how to read it off a reading.

One table, :data:`SPECS`, that the Prometheus exporter (:mod:`tiered_kv.obs.prometheus`)
and ``docs/metrics.md`` follow.  Names and meanings follow vLLM's v1 engine where
vLLM has the metric (``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py``,
matched against vLLM 0.12: the ``vllm:`` names below), so a dashboard built for
vLLM reads these unchanged; the tiered manager's own numbers use the
``tiered_kv:`` prefix.  Standard library only: the table can be read without
``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiered_kv.manager.metrics import TierCounters
from tiered_kv.obs.recorder import Reading

Values = Callable[[Reading], Iterable[tuple[tuple[str, ...], float]]]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric.

    Attributes:
        name: The family name (a counter's samples get ``_total`` appended).
        type: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        doc: The HELP text.
        labels: Label names of its own (per-source labels such as ``run`` come first).
        values: The samples of one reading: ``(label values, value)`` pairs.
    """

    name: str
    type: str
    doc: str
    labels: tuple[str, ...]
    values: Values


def _scalar(name: str, type: str, doc: str, f: Callable[[Reading], float]) -> MetricSpec:
    """A metric of one sample and no labels of its own."""
    return MetricSpec(name, type, doc, (), lambda r: [((), f(r))])


def _per_tier(gpu: Callable[[Reading], float], cpu: Callable[[Reading], float]) -> Values:
    return lambda r: [(("gpu",), gpu(r)), (("cpu",), cpu(r))]


def _per_kind(field: str) -> Values:
    return lambda r: [((k,), getattr(r.snapshot.counters, f"{k}_{field}")) for k in r.copy_latency]


def _counters(r: Reading) -> TierCounters:
    return r.snapshot.counters


SPECS: tuple[MetricSpec, ...] = (
    # ---- vLLM's names and meanings
    _scalar(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage of the GPU pool: the fraction of usable blocks not free. 1 means 100 percent usage.",
        lambda r: r.snapshot.gpu_usage,
    ),
    _scalar(
        "vllm:prefix_cache_queries",
        "counter",
        "GPU prefix cache queries, in tokens: every admitted request's tokens.",
        lambda r: _counters(r).gpu_query_tokens,
    ),
    _scalar(
        "vllm:prefix_cache_hits",
        "counter",
        "GPU prefix cache hits, in tokens found cached on the GPU at admission.",
        lambda r: _counters(r).gpu_hit_tokens,
    ),
    _scalar(
        "vllm:external_prefix_cache_queries",
        "counter",
        "CPU-tier prefix queries, in tokens: the tokens of each admitted request not found on the GPU.",
        lambda r: _counters(r).cpu_query_tokens,
    ),
    _scalar(
        "vllm:external_prefix_cache_hits",
        "counter",
        "CPU-tier prefix hits, in tokens found on the CPU tier at admission (loaded, not recomputed).",
        lambda r: _counters(r).cpu_hit_tokens,
    ),
    _scalar(
        "vllm:num_preemptions",
        "counter",
        "Preemptions, by swap and by recompute.",
        lambda r: _counters(r).preemptions_swap + _counters(r).preemptions_recompute,
    ),
    _scalar("vllm:num_requests_running", "gauge", "Requests in the running batch.", lambda r: r.requests_running),
    _scalar(
        "vllm:num_requests_waiting",
        "gauge",
        "Requests waiting to be admitted, including those whose prefix is still loading from the CPU tier.",
        lambda r: r.requests_waiting,
    ),
    # ---- the tiered manager's own
    _scalar(
        "tiered_kv:num_requests_swapped",
        "gauge",
        "Requests whose KV is swapping out, on the CPU tier, or swapping back in.",
        lambda r: r.requests_swapped,
    ),
    _scalar(
        "tiered_kv:cpu_cache_usage_perc",
        "gauge",
        "KV-cache usage of the CPU tier: the fraction of its usable blocks not free. 1 means 100 percent usage.",
        lambda r: r.snapshot.cpu_usage,
    ),
    MetricSpec(
        "tiered_kv:tier_blocks",
        "gauge",
        "Usable blocks per tier (the GPU's null block and the CPU store's reserved block excluded).",
        ("tier",),
        _per_tier(lambda r: r.snapshot.gpu_blocks, lambda r: r.snapshot.cpu_blocks),
    ),
    MetricSpec(
        "tiered_kv:tier_free_blocks",
        "gauge",
        "Free blocks per tier.",
        ("tier",),
        _per_tier(lambda r: r.snapshot.gpu_free_blocks, lambda r: r.snapshot.cpu_free_blocks),
    ),
    _scalar(
        "tiered_kv:cpu_cached_blocks",
        "gauge",
        "CPU-tier blocks holding KV (pinned or not).",
        lambda r: r.snapshot.cpu_cached_blocks,
    ),
    _scalar(
        "tiered_kv:cpu_pinned_blocks",
        "gauge",
        "CPU-tier blocks that may not be evicted: pinned by swapped requests and loads, or being written.",
        lambda r: r.snapshot.cpu_pinned_blocks,
    ),
    MetricSpec(
        "tiered_kv:evicted_blocks",
        "counter",
        "Cached blocks whose KV was dropped to reuse the block, per tier.",
        ("tier",),
        _per_tier(lambda r: _counters(r).gpu_blocks_evicted, lambda r: _counters(r).cpu_blocks_evicted),
    ),
    MetricSpec(
        "tiered_kv:copied_blocks",
        "counter",
        "Blocks moved by copies that landed, per kind (swap_out and offload: GPU to CPU; swap_in and onboard: "
        "CPU to GPU).",
        ("kind",),
        _per_kind("blocks"),
    ),
    MetricSpec(
        "tiered_kv:copied_bytes",
        "counter",
        "Bytes moved by copies that landed, per kind (swap_out and offload: GPU to CPU; swap_in and onboard: "
        "CPU to GPU).",
        ("kind",),
        _per_kind("bytes"),
    ),
    MetricSpec(
        "tiered_kv:copy_latency_seconds",
        "histogram",
        "Time from submission to completion of each copy that landed, per kind, as its copy engine measured it.",
        ("kind",),
        lambda r: [],  # histograms are built from Reading.copy_latency
    ),
    _scalar(
        "tiered_kv:copies_submitted",
        "counter",
        "Copies submitted to the copy engine.",
        lambda r: _counters(r).plans_submitted,
    ),
    _scalar(
        "tiered_kv:copies_failed",
        "counter",
        "Copies that failed (their KV stayed where it was).",
        lambda r: _counters(r).plans_failed,
    ),
    _scalar(
        "tiered_kv:copies_cancelled",
        "counter",
        "Copies cancelled before they ran.",
        lambda r: _counters(r).plans_cancelled,
    ),
    _scalar(
        "tiered_kv:copies_in_flight",
        "gauge",
        "Copies submitted and not settled yet.",
        lambda r: r.snapshot.plans_in_flight,
    ),
    MetricSpec(
        "tiered_kv:preemptions",
        "counter",
        "Preemptions by the mode taken and why (see docs/metrics.md for the reasons); they sum to "
        "vllm:num_preemptions.",
        ("mode", "reason"),
        lambda r: list(r.preemptions.items()),
    ),
    _scalar(
        "tiered_kv:swaps_dropped",
        "counter",
        "Swapped requests whose CPU copy was given up (they are recomputed).",
        lambda r: _counters(r).swaps_dropped,
    ),
    _scalar(
        "tiered_kv:recomputed_tokens",
        "counter",
        "Tokens computed again because a recompute preemption dropped their KV (prefix hits excluded).",
        lambda r: r.tokens_recomputed,
    ),
)
