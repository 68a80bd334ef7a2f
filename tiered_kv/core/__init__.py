"""Layer 0: KV block bookkeeping.  Standard library only; never imports torch."""

from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.block_pool import BlockPool
from tiered_kv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from tiered_kv.core.free_queue import FreeBlockQueue
from tiered_kv.core.hashing import BlockHasher, fast_block_hash, get_hash_fn, hash_block_tokens, sha256_block_hash
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import MultiModalFeature, Request
from tiered_kv.core.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "MultiModalFeature",
    "PrefixCacheStats",
    "Request",
    "fast_block_hash",
    "get_hash_fn",
    "hash_block_tokens",
    "sha256_block_hash",
]
