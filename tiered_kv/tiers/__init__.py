"""Layer 2, beside the manager: the stores.  The CPU store and its policies, the tiers below it, their kinds, the chain.

The CPU store (:class:`~tiered_kv.tiers.cpu_store.CPUStore`) follows vLLM 0.33.0's
request-scoped ``OffloadingManager`` protocol, with its cache policies in
:mod:`tiered_kv.tiers.policies`.  Each store below it is a
:class:`~tiered_kv.tiers.keyed_store.KeyedStore`, a subclass of the CPU store (its verbs and
semantics, without request scope); each I/O engine moves a block's bytes between the CPU tier's
tensor (the staging area) and the store's medium on a thread pool, completing
through a :class:`~tiered_kv.transfer.plan.TransferHandle`.  A tier below the
CPU, as the manager drives it, is a :class:`LowerTier` (its store, I/O engine,
link and write policy); each kind of tier (:mod:`tiered_kv.tiers.kinds`: disk,
Redis) is a :class:`TierConfig` that builds its own, and a :class:`TierStack`
builds a list of them and closes what it built.  :class:`TierChain` orders the
stores under the CPU store and answers "which tier holds each block of this prefix".

Names are imported on first use, so ``tiered_kv.tiers.chain`` and the stores
load without torch (only the I/O engines need it), and the Redis store needs
the optional ``redis`` package (``pip install 'tiered-kv[redis]'``) only when
one is built.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_WHERE = {
    "BlockHeader": "block_format",
    "FormatError": "block_format",
    "CPUStore": "cpu_store",
    "StoreUsage": "cpu_store",
    "RequestContext": "cpu_store",
    "StoreEvent": "store",
    "ChainLookup": "chain",
    "Move": "chain",
    "TierChain": "chain",
    "TierPolicy": "chain",
    "DiskIO": "disk_io",
    "DiskTierConfig": "kinds.disk",
    "LowerTier": "lower_tier",
    "RedisTierConfig": "kinds.redis",
    "TierConfig": "tier_kind",
    "TierLink": "link",
    "WRITE_POLICIES": "write_policy",
    "known_tier_types": "tier_kind",
    "register_tier_kind": "tier_kind",
    "find_tier_kind": "tier_kind",
    "DiskStore": "disk_store",
    "DiskStoreStats": "disk_store",
    "BlockIOEngine": "io_engine",
    "IOStats": "io_engine",
    "BlockIOHandle": "io_handle",
    "BlockOutcome": "io_handle",
    "KeyedStore": "keyed_store",
    "KVNamespace": "namespace",
    "key_name": "namespace",
    "parse_key_name": "namespace",
    "RedisHealth": "redis_health",
    "RedisIO": "redis_io",
    "RedisStore": "redis_store",
    "RedisStoreStats": "redis_store",
    "TierStack": "stack",
}

# Old names of the tier kinds' configs, kept working with a warning: the vLLM plug-in's secondary
# tiers (tiered_kv.integrations.vllm) are the package's DiskTier and RedisTier.
_RENAMED = {"DiskTier": "DiskTierConfig", "RedisTier": "RedisTierConfig"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"tiered_kv.tiers.{name} is now tiered_kv.tiers.{new} (a tier kind's configuration); "
            f"tiered_kv.integrations.vllm.{name} is vLLM's secondary tier",
            DeprecationWarning,
            stacklevel=2,
        )
        name = new
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tiered_kv.tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tiered_kv.tiers.{module}"), name)
