"""tiered_kv inside vLLM 0.33 as out-of-tree offloading plug-ins (the ``[vllm]`` extra).

vLLM 0.33 loads offloading code named in ``--kv-transfer-config``, with no fork:

* :class:`~tiered_kv.integrations.vllm.disk_tier.DiskTier` and
  :class:`~tiered_kv.integrations.vllm.redis_tier.RedisTier`: secondary tiers
  under vLLM's own CPU tier (``TieringOffloadingSpec``'s ``"secondary_tiers"``);
* :class:`~tiered_kv.integrations.vllm.spec.TieredKVOffloadingSpec`: a whole
  offloading spec (``spec_name`` + ``spec_module_path``) whose scheduler-side
  manager is tiered_kv's CPU store, optionally with load pricing;
* :class:`~tiered_kv.integrations.vllm.scheduler.TieredKVScheduler`
  (``--scheduler-cls``) and :class:`~tiered_kv.integrations.vllm.connector.TieredKVConnector`
  (``kv_connector`` + ``kv_connector_module_path``): tiered_kv's victim policies
  and swap-or-recompute per victim inside vLLM's scheduler.

Names resolve lazily, so ``module_path: "tiered_kv.integrations.vllm"`` works
for each of them, and importing this package does not import vLLM until a
name is asked for.  ``docs/integrations.md`` has the configuration lines.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "DiskTier": "tiered_kv.integrations.vllm.disk_tier",
    "RedisTier": "tiered_kv.integrations.vllm.redis_tier",
    "StoreTier": "tiered_kv.integrations.vllm.store_tier",
    "TieredKVOffloadingSpec": "tiered_kv.integrations.vllm.spec",
    "TieredKVOffloadingManager": "tiered_kv.integrations.vllm.manager",
    "TieredKVScheduler": "tiered_kv.integrations.vllm.scheduler",
    "TieredKVAsyncScheduler": "tiered_kv.integrations.vllm.scheduler",
    "TieredKVConnector": "tiered_kv.integrations.vllm.connector",
    "PreemptionCounters": "tiered_kv.integrations.vllm.preemption_stats",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
