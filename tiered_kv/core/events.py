"""KV cache events, for external indexes that mirror what each tier caches.

Events are queued by the pool and taken in batches with ``take_events()``.  Their
names, fields, field order and defaults are those of vLLM 0.33.0's
``vllm/distributed/kv_events.py``, and the pool emits them where and as vLLM
0.33's ``BlockPool`` does (checked against vLLM's own class by
``tests/test_vllm_pool_diff.py``):

* one ``BlockStored`` per ``cache_full_blocks`` call with a non-empty range;
* one ``BlockRemoved`` per evicted block, in hand-out order, when
  ``get_new_blocks`` takes a block that still carries a hash;
* one ``AllBlocksCleared`` per successful ``reset_prefix_cache``.

Hashes are published as the pool's option says (see :func:`external_hash`):
64-bit unsigned ints by default, as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``
does, or the hash as the pool holds it.  tiered_kv has one KV cache group, so
``group_idx`` is always 0, and no LoRA adapter ids (``lora_id`` is ``None``; the
LoRA name is in ``lora_name``).  The one field vLLM does not have is
``AllBlocksCleared.medium``: several tiers publish into one stream here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.core.block import BlockHash

ExternalBlockHash = bytes | int
"""A hash as published in an event: vLLM's ``ExternalBlockHash``."""

MASK_64 = (1 << 64) - 1


def external_hash(h: BlockHash, as_int: bool) -> ExternalBlockHash:
    """``h`` as an event publishes it.

    With ``as_int``, vLLM's conversion: a ``bytes`` hash read big-endian and cut to
    its low 64 bits; an ``int`` hash (the fast hash) cut the same way, so that
    every published hash is an unsigned 64-bit int.  Without, ``h`` itself.
    """
    if not as_int:
        return h
    if type(h) is bytes:
        return int.from_bytes(h, "big") & MASK_64
    assert type(h) is int, f"a block hash is bytes or an int, got {type(h).__name__}"
    return h & MASK_64


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Consecutive blocks of one request were cached.

    Fields as vLLM 0.33's ``BlockStored``: ``block_hashes`` are the blocks newly
    entered in the cache (null blocks in the range are left out);
    ``parent_block_hash`` is the hash before the range (``None`` when the range
    starts at block 0) and ``token_ids`` the tokens of the whole range, null
    blocks included, as vLLM publishes them; ``extra_keys`` has one entry per
    item of ``block_hashes``, in vLLM's untagged form (the LoRA name, then
    ``(identifier, offset within the block)`` of each multimodal input, then the cache salt on
    block 0), ``None`` for a block without any.  The LoRA and salt entries are
    compared with vLLM's; the multimodal ones follow vLLM's shape but are not
    (tiered_kv's multimodal inputs are not vLLM's records).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """One block lost its cached contents (evicted at hand-out); vLLM 0.33's ``BlockRemoved``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache of one tier was reset.

    vLLM's event has no fields; ``medium`` says which tier, since several tiers
    publish into one stream here.
    """

    medium: str | None = None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
