"""KV cache events, for external indexes that mirror what each tier caches.

Events are queued by the pool and taken in batches with ``take_events()``,
mirroring vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.core.block import BlockHash


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Consecutive blocks of one request were cached (their hashes chain from ``parent_block_hash``)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    medium: str


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Blocks lost their cached contents (evicted at hand-out)."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache of one tier was reset."""

    medium: str


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
