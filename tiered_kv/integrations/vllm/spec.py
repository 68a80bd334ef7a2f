"""A whole vLLM 0.33 offloading spec whose manager is tiered_kv's CPU store.

Configured with ``"spec_name": "TieredKVOffloadingSpec", "spec_module_path":
"tiered_kv.integrations.vllm"`` in ``kv_connector_extra_config``; vLLM's
``OffloadingSpecFactory`` imports it from there.  It is vLLM's
``CPUOffloadingSpec`` in every respect but the scheduler-side manager: the
CPU region, its size (``cpu_bytes_to_use``), the worker and its GPU<->CPU
copies are vLLM's; the bookkeeping (what is stored, what is evicted, in which
order) is tiered_kv's :class:`~tiered_kv.tiers.cpu_store.CPUStore` with its
policies, and, with ``load_pricing``, a lookup may end a hit run where
recomputing the rest is cheaper than loading it.

Extra keys (besides vLLM's ``cpu_bytes_to_use``, ``eviction_policy``,
``cache_policy_module_path``):

* ``load_pricing``: ``null`` (default: vLLM's plain answers) or an object with
  ``prefill_tokens_per_s`` (required), and optionally ``h2d_bytes_per_s``,
  ``per_copy_overhead_s``, ``prefill_quadratic_s_per_token2``,
  ``prefill_overhead_s``, ``kv_bytes_per_token`` (default: from vLLM's config),
  ``block_size`` (tokens per chunk; default: vLLM's), and ``link``
  (``{"bytes_per_s": ..., "block_latency_s": ...}``: a medium the chunk crosses
  before its GPU copy, as tiered_kv's own tiers price theirs).
* ``preemption``: how tiered_kv's scheduler class preempts
  (:func:`~tiered_kv.integrations.vllm.extra_config.preemption_config`); checked
  here too, so a bad one fails when vLLM builds the spec.

Any other top-level key is refused, with the known ones (vLLM's included):
vLLM itself ignores a key it does not read, so a misspelling would otherwise
give plain vLLM behaviour without a word.  The spec also declares the
preemption metrics (:mod:`~tiered_kv.integrations.vllm.preemption_stats`),
which vLLM's frontend then exports beside its own.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingManager, OffloadingMetricMetadata
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.extra_config import TIERED_KV_KEYS, VLLM_OFFLOADING_KEYS, check_keys, preemption_config
from tiered_kv.integrations.vllm.manager import LoadPricing, TieredKVOffloadingManager
from tiered_kv.integrations.vllm.preemption_stats import METRICS
from tiered_kv.manager.pricing import CostModel
from tiered_kv.tiers.link import TierLink

_COST_KEYS = (
    "h2d_bytes_per_s",
    "per_copy_overhead_s",
    "prefill_tokens_per_s",
    "prefill_quadratic_s_per_token2",
    "prefill_overhead_s",
)


class TieredKVOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading with tiered_kv's CPU store as the scheduler-side manager.

    Raises:
        ConfigError: an unknown top-level key, or a ``load_pricing`` or ``preemption``
            object with unknown or bad keys (at construction, before vLLM builds anything).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {**super().build_metric_definitions(extra_config), **METRICS}

    def __init__(self, config: Any) -> None:
        check_keys("kv_connector_extra_config", config.extra_config, VLLM_OFFLOADING_KEYS | TIERED_KV_KEYS)
        super().__init__(config)
        self.pricing = self._pricing(self.extra_config.get("load_pricing"))
        tokens_per_block = max(1, int(self.tokens_per_block[0]))
        preemption_config(
            self.extra_config.get("preemption"),
            max(1, int(config.worker_kv_bytes_per_block) // tokens_per_block),
            tokens_per_block,
        )

    def _chunk_tokens(self) -> int:
        return int(self.tokens_per_block[0]) * int(self.blocks_per_chunk)

    def _pricing(self, raw: Any) -> LoadPricing | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ConfigError(f"load_pricing must be an object or null, got {raw!r}")
        known = {*_COST_KEYS, "kv_bytes_per_token", "block_size", "link"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"load_pricing: unknown keys {unknown} (known: {sorted(known)})")
        if "prefill_tokens_per_s" not in raw:
            raise ConfigError("load_pricing needs prefill_tokens_per_s (what recomputing costs)")
        block_size = raw.get("block_size", self._chunk_tokens())
        per_token = raw.get("kv_bytes_per_token")
        if per_token is None:
            per_token = max(1, self.config.worker_kv_bytes_per_block * self.config.parallel.world_size)
            per_token = max(1, per_token // max(1, int(self.tokens_per_block[0])))
        costs = {k: raw[k] for k in _COST_KEYS if k in raw}
        model = CostModel(kv_bytes_per_token=per_token, block_size=block_size, **costs)
        link = raw.get("link")
        if link is not None:
            if not isinstance(link, dict) or set(link) - {"bytes_per_s", "block_latency_s"}:
                raise ConfigError(f"load_pricing.link must be {{bytes_per_s, block_latency_s}}, got {link!r}")
            link = TierLink(float(link["bytes_per_s"]), float(link.get("block_latency_s", 0.0)))
        return LoadPricing(model, link)

    def get_manager(self) -> OffloadingManager:
        if not self._manager:
            self._manager = TieredKVOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                pricing=self.pricing,
                info=self.cpu_info,
            )
        return self._manager
