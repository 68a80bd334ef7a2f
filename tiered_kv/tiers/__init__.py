"""Layer 2: the tiers below the CPU.  A disk store, a shared remote store on Redis, their I/O engines, and the chain.

Each store is a :class:`~tiered_kv.tiers.store.BlockStore` (the CPU tier's verbs
and semantics); each I/O engine moves a block's bytes between the CPU tier's
tensor (the staging area) and the store's medium on a thread pool, completing
through a :class:`~tiered_kv.transfer.plan.TransferHandle`.  :class:`TierChain`
orders the stores and answers "which tier holds each block of this prefix".

Names are imported on first use, so ``tiered_kv.tiers.chain`` and the stores
load without torch (only the I/O engines need it), and the Redis store needs
the optional ``redis`` package (``pip install 'tiered-kv[redis]'``) only when
one is built.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BlockHeader": "block_format",
    "FormatError": "block_format",
    "ChainLookup": "chain",
    "Move": "chain",
    "TierChain": "chain",
    "TierPolicy": "chain",
    "DiskIO": "disk_io",
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

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tiered_kv.tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tiered_kv.tiers.{module}"), name)
