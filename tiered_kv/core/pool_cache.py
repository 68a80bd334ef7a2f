"""Entering blocks in the pool's prefix-cache map, and taking them out again.

The map (``BlockPool.cached_block_hash_to_block``) sends a hash to its one
block, or to ``{block_id: block}`` in caching order when several blocks carry
the same hash: blocks are never de-duplicated, because block tables only grow
(vLLM's ``BlockHashToBlockMap`` keeps the same shape, which spares a dict per
hash in the common case).  A lookup returns the first block of an entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiered_kv.core import pool_checks as pc
from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.events import BlockStored, external_hash
from tiered_kv.core.request import Request
from tiered_kv.errors import BlockStateError, TieredKVError

CacheMap = dict[BlockHash, "KVCacheBlock | dict[int, KVCacheBlock]"]


def cache_range(
    own: list[KVCacheBlock],
    cmap: CacheMap,
    blocks: Sequence[KVCacheBlock],
    hashes: Sequence[BlockHash],
    first: int,
    last: int,
    medium: str,
) -> list[int] | None:
    """Cache ``blocks[i]`` under ``hashes[i]`` for ``first <= i < last``, in one pass; all-or-nothing.

    Each block is checked in the loop that caches it; on a bad one the blocks
    already entered are taken out again before the error is raised.  Null
    blocks are skipped, and so is a block already carrying the very hash it
    would get (vLLM skips both).  A block of no pool (built by hand) is
    cached; a block of another pool is refused.

    Returns:
        The indices skipped because their block already carried its hash
        (``None`` for none: the common case allocates no list).

    Raises:
        BlockStateError / InvalidArgumentError: a block is foreign or not a
            block, already carries another hash, or is listed twice.
    """
    skipped: list[int] | None = None
    i = first
    n_own = len(own)
    try:
        for i in range(first, last):
            block = blocks[i]
            bid = block.block_id
            # This pool's block, or one built outside any pool (vLLM caches those; see cache_full_blocks).
            if not (0 <= bid < n_own and own[bid] is block) and block.in_pool:
                raise LookupError
            h = hashes[i]
            bh = block.block_hash
            if bh is None:
                if block.is_null:
                    continue
                if h.__class__ is not bytes and h.__class__ is not int:  # per block: see checks.py on __class__
                    raise TypeError  # _range_error names the hash
                entry = cmap.setdefault(h, block)  # one probe where the hash is new, as it mostly is
                if entry is not block:  # h already cached: the entry grows
                    if isinstance(entry, KVCacheBlock):
                        cmap[h] = {entry.block_id: entry, bid: block}
                    else:
                        entry[bid] = block
                block.block_hash = h  # after the map took h: an unhashable h raises first, with nothing to undo
            elif bh == h and not _listed_in(blocks, first, i, block):
                if skipped is None:  # restored by copy, then cached again by its request
                    skipped = []
                skipped.append(i)
            else:
                raise LookupError
    except (AttributeError, TypeError, LookupError):
        for j in range(first, i):
            block = blocks[j]
            if block.block_hash is not None and (skipped is None or j not in skipped):
                uncache(cmap, block)
        err = _range_error(blocks, hashes, first, i, own, medium)
        if err is None:
            raise
        raise err from None
    return skipped


def _listed_in(blocks: Sequence[KVCacheBlock], first: int, end: int, block: KVCacheBlock) -> bool:
    for j in range(first, end):
        if blocks[j] is block:
            return True
    return False


def _range_error(
    blocks: Sequence[KVCacheBlock],
    hashes: Sequence[object],
    first: int,
    i: int,
    own: list[KVCacheBlock],
    medium: str,
) -> TieredKVError | None:
    """Why ``blocks[i]`` could not be cached (``None``: nothing wrong with it).

    ``hashes`` is read as objects: compiled, reading a wrong one as a ``BlockHash`` would raise.
    """
    block: object = blocks[i]
    if not pc.is_own(block, own) and not pc.is_standalone(block):
        return pc.block_error("blocks", block, own, medium)
    assert isinstance(block, KVCacheBlock)
    if _listed_in(blocks, first, i, block):
        return BlockStateError("a block is listed twice in the range to cache")
    if block.block_hash is not None and block.block_hash != hashes[i]:
        return BlockStateError(f"block {block.block_id} is already cached under another hash; cannot cache it again")
    h = hashes[i]
    if type(h) is not bytes and type(h) is not int:  # an unhashable one stopped the loop
        return pc.bad_hash(f"block hash {i} of the request", h)
    return None


def uncache(cmap: CacheMap, block: KVCacheBlock) -> BlockHash:
    """Take ``block`` out of the map and clear its hash; return the hash it had."""
    h = block.block_hash
    assert h is not None, f"block {block.block_id} is not cached"
    entry = cmap[h]
    if entry is block:
        del cmap[h]
    else:
        assert isinstance(entry, dict), f"block {block.block_id} is not under its hash"
        del entry[block.block_id]
        if not entry:
            del cmap[h]
    block.block_hash = None
    return h


def stored_event(
    request: Request,
    blocks: Sequence[KVCacheBlock],
    first: int,
    last: int,
    block_size: int,
    skipped: list[int] | None,
    medium: str,
    as_int: bool,
) -> BlockStored | None:
    """The ``BlockStored`` event of a ``cache_range`` call, as vLLM 0.33's ``cache_full_blocks`` builds it.

    The parent is the hash before ``first`` and the tokens span the whole range,
    whether or not its first blocks are null (vLLM's shape).  ``None`` only when
    every non-null block of the range was skipped because it already carried its
    hash (a case vLLM does not have: it never re-caches a cached block).
    """
    new_idx = [i for i in range(first, last) if not blocks[i].is_null and (skipped is None or i not in skipped)]
    if not new_idx and skipped is not None:
        return None
    hashes = request.block_hashes
    return BlockStored(
        block_hashes=[external_hash(hashes[i], as_int) for i in new_idx],
        parent_block_hash=external_hash(hashes[first - 1], as_int) if first else None,
        token_ids=request.all_token_ids[first * block_size : last * block_size],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=request.lora_name,
        extra_keys=event_extra_keys(request, new_idx, block_size),
        group_idx=0,
    )


def event_extra_keys(request: Request, idx: list[int], block_size: int) -> list[tuple[object, ...] | None] | None:
    """One entry per block index in ``idx``: the keys its hash covers, in vLLM's untagged event form.

    LoRA name, then ``(identifier, offset - block start)`` of each multimodal
    input overlapping the block, then the cache salt on block 0; ``None`` for a block with none, and
    ``None`` for no blocks at all (vLLM's ``to_event_extra_keys``).
    """
    if not idx:
        return None
    lora, mm, salt = request.lora_name, request.mm_features, request.cache_salt
    if lora is None and not mm and (salt is None or idx[0] != 0):
        return [None] * len(idx)
    out: list[tuple[object, ...] | None] = []
    for i in idx:
        start, end = i * block_size, (i + 1) * block_size
        keys: list[object] = [] if lora is None else [lora]
        for f in mm:
            if f.offset < end and f.offset + f.length > start:
                keys.append((f.identifier, f.offset - start))  # vLLM: the offset relative to the block
        if i == 0 and salt is not None:
            keys.append(salt)
        out.append(tuple(keys) if keys else None)
    return out


def num_cached_blocks(cmap: CacheMap) -> int:
    """Blocks in the map (a hash may count several)."""
    return sum(1 if isinstance(v, KVCacheBlock) else len(v) for v in cmap.values())


def check_state(blocks: list[KVCacheBlock], free: list[KVCacheBlock], num_free: int, cmap: CacheMap) -> None:
    """Assert a pool's invariants: free queue, ref counts and map agree (O(blocks); for tests)."""
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free) == num_free, "a block is in the free queue twice"
    assert 0 not in free_ids, "the null block is in the free queue"
    for block in blocks[1:]:
        assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
        assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but free={block.block_id in free_ids}"
        )
    for block in blocks:
        if block.block_hash is not None:
            entry = cmap.get(block.block_hash)
            assert entry is block or (isinstance(entry, dict) and entry.get(block.block_id) is block), (
                f"block {block.block_id} has a hash but is not in the cache map"
            )
    mapped = [b for v in cmap.values() for b in ((v,) if isinstance(v, KVCacheBlock) else v.values())]
    own = [b for b in mapped if pc.is_own(b, blocks)]
    assert all(pc.is_standalone(b) for b in mapped if not pc.is_own(b, blocks)), "another pool's block is mapped"
    n_hashed = sum(b.block_hash is not None for b in blocks)
    assert len(own) == n_hashed, f"{len(own)} of its blocks in the cache map but {n_hashed} carry a hash"
