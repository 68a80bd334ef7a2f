"""Helpers shared by the core tests: exact snapshots of pools and managers."""

from __future__ import annotations

from tiered_kv.core import BlockPool, KVCacheManager, Request


def queue(pool: BlockPool) -> list[str]:
    """Free queue front first; ``"3*"`` marks a free block that still carries a hash."""
    return [
        f"{b.block_id}*" if b.block_hash is not None else str(b.block_id)
        for b in pool.free_block_queue.get_all_free_blocks()
    ]


def pool_snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool, for "nothing changed" assertions."""
    cmap = {
        h: (v.block_id,) if not isinstance(v, dict) else tuple(v) for h, v in pool.cached_block_hash_to_block.items()
    }
    return (
        pool.free_queue_ids(),
        pool.get_num_free_blocks(),
        tuple((b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks),
        cmap,
        len(pool.kv_event_queue),
    )


def manager_snapshot(mgr: KVCacheManager) -> tuple:
    return (
        pool_snapshot(mgr.block_pool),
        {rid: [b.block_id for b in blocks] for rid, blocks in mgr.req_to_blocks.items()},
        dict(mgr.num_cached_block),
    )


def letters(text: str) -> list[int]:
    return [ord(c) for c in text]


def admit(mgr: KVCacheManager, rid: str, text: str) -> Request:
    """Admit a whole prompt in one step, as the seed's program does."""
    req = Request(rid, letters(text))
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return req
