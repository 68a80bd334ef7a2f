"""What preemption costs inside vLLM, counted, and exported as Prometheus metrics beside vLLM's own.

vLLM 0.33 already exports ``vllm:num_preemptions`` (every preemption) and
nothing about what a preemption costs afterwards.  These counters add that,
including the *recompute tax* as vLLM RFC 54644 defines it: tokens computed
again (their KV had been computed before a preemption dropped it) over all
tokens computed.

How they reach Prometheus: vLLM's offloading connector sends a stats payload
from the scheduler process with every step's output
(``OffloadingConnectorStats``), and its frontend turns each metric the spec
declares (``OffloadingSpec.build_metric_definitions``) into a Prometheus
metric with vLLM's own labels (``model_name``, ``engine``), in vLLM's registry,
served at vLLM's ``/metrics``.  :class:`~.spec.TieredKVOffloadingSpec` declares
:data:`METRICS`; the connector's scheduler side adds each step's increments
(:meth:`PreemptionCounters.report`).  The names use tiered_kv's prefix because
vLLM has no metric of the same meaning (its ``vllm:num_preemptions`` is the sum
of ``tiered_kv:preemptions`` over modes); ``tiered_kv:preemptions`` and
``tiered_kv:recomputed_tokens`` mean what they mean in tiered_kv's own exporter
(:mod:`tiered_kv.obs.metric_specs`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

PREEMPTIONS = "tiered_kv:preemptions"
STORED_BLOCKS = "tiered_kv:preemption_stored_blocks"
LOADED_BLOCKS = "tiered_kv:resume_loaded_blocks"
COMPUTED_TOKENS = "tiered_kv:computed_tokens"
RECOMPUTED_TOKENS = "tiered_kv:recomputed_tokens"
RECOMPUTE_TAX = "tiered_kv:recompute_tax"
FAILED_COPIES = "tiered_kv:preemption_copies_failed"

METRICS: dict[str, OffloadingMetricMetadata] = {
    PREEMPTIONS: OffloadingCounterMetadata(
        documentation="Preemptions by the mode taken (swap or recompute); they sum to vllm:num_preemptions.",
        labelnames=("mode",),
    ),
    STORED_BLOCKS: OffloadingCounterMetadata(
        documentation="GPU blocks stored to the CPU tier when their request was preempted (stores that landed).",
    ),
    LOADED_BLOCKS: OffloadingCounterMetadata(
        documentation="GPU blocks loaded from the CPU tier when a preempted request resumed (loads that landed).",
    ),
    COMPUTED_TOKENS: OffloadingCounterMetadata(
        documentation="Tokens the model computed (every scheduled token, recomputed ones included).",
    ),
    RECOMPUTED_TOKENS: OffloadingCounterMetadata(
        documentation="Tokens computed again because a preemption dropped their KV (prefix hits excluded).",
    ),
    RECOMPUTE_TAX: OffloadingGaugeMetadata(
        documentation="Recompute tax (vLLM RFC 54644): tiered_kv:recomputed_tokens over tiered_kv:computed_tokens "
        "since the engine started.",
    ),
    FAILED_COPIES: OffloadingCounterMetadata(
        documentation="Stores at preemption and loads at resume that a worker reported failed, by direction; "
        "their tokens are recomputed.",
        labelnames=("direction",),
    ),
}
"""The metrics declared by tiered_kv's spec (name -> vLLM's metric metadata)."""


@dataclass(slots=True)
class PreemptionCounters:
    """Counts since the engine started (the scheduler and its connector add to one instance).

    Attributes:
        preemptions_swap: Victims whose computed KV went to the CPU tier.
        preemptions_recompute: Victims preempted by recomputation (vLLM's mode).
        blocks_stored: GPU blocks stored at preemption, by stores that landed.
        blocks_loaded: GPU blocks loaded at resume, by loads that landed.
        tokens_computed: Tokens scheduled for computation.
        tokens_recomputed: Of those, tokens a request had computed before a preemption dropped their KV.
        stores_failed: Stores at preemption a worker reported failed or cancelled.
        loads_failed: Loads at resume a worker reported failed.
    """

    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    tokens_computed: int = 0
    tokens_recomputed: int = 0
    stores_failed: int = 0
    loads_failed: int = 0

    @property
    def preemptions(self) -> int:
        return self.preemptions_swap + self.preemptions_recompute

    @property
    def recompute_tax(self) -> float:
        """Recomputed tokens over computed tokens (0 before anything is computed)."""
        return self.tokens_recomputed / self.tokens_computed if self.tokens_computed else 0.0

    def copy(self) -> PreemptionCounters:
        return PreemptionCounters(**asdict(self))

    def report(self, stats: OffloadingConnectorStats, since: PreemptionCounters) -> None:
        """Add what changed since ``since`` to a stats payload (counters as increments, the tax as a gauge)."""
        delta = {f.name: getattr(self, f.name) - getattr(since, f.name) for f in fields(self)}
        for mode in ("swap", "recompute"):
            if delta[f"preemptions_{mode}"]:
                stats.increase_counter(PREEMPTIONS, delta[f"preemptions_{mode}"], (mode,))
        for name, key in (
            (STORED_BLOCKS, "blocks_stored"),
            (LOADED_BLOCKS, "blocks_loaded"),
            (COMPUTED_TOKENS, "tokens_computed"),
            (RECOMPUTED_TOKENS, "tokens_recomputed"),
        ):
            if delta[key]:
                stats.increase_counter(name, delta[key])
        for direction, key in (("store", "stores_failed"), ("load", "loads_failed")):
            if delta[key]:
                stats.increase_counter(FAILED_COPIES, delta[key], (direction,))
        if delta["tokens_computed"] or delta["tokens_recomputed"]:
            stats.set_gauge(RECOMPUTE_TAX, self.recompute_tax)
