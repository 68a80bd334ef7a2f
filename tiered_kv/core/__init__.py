"""Layer 0: KV block bookkeeping.  Standard library only; never imports torch."""

from tiered_kv.core import block_pool as _block_pool_module
from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.block_hasher import BlockHasher
from tiered_kv.core.block_pool import BlockPool
from tiered_kv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    external_hash,
)
from tiered_kv.core.free_queue import FreeBlockQueue
from tiered_kv.core.hashing import fast_block_hash, get_hash_fn, hash_block_tokens, sha256_block_hash
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import MultiModalFeature, Request
from tiered_kv.core.stats import PrefixCacheStats

COMPILED: bool = not _block_pool_module.__file__.endswith(".py")
"""Whether the core runs compiled by mypyc (see ``setup.py``) rather than as pure Python."""

__all__ = [
    "COMPILED",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "external_hash",
    "fast_block_hash",
    "get_hash_fn",
    "hash_block_tokens",
    "sha256_block_hash",
]
