"""Each misuse raises a clear error and leaves pool and manager exactly as they were."""

import pytest
from poolutil import admit, letters, manager_snapshot

from tiered_kv.core import BlockPool, KVCacheManager, Request
from tiered_kv.errors import (
    BlockStateError,
    HashingError,
    InvalidArgumentError,
    NotEnoughFreeBlocksError,
    TieredKVError,
)


def populated() -> tuple[KVCacheManager, Request]:
    """A manager with shared, cached, free-cached and partial blocks in play."""
    mgr = KVCacheManager(12, block_size=2, enable_kv_cache_events=True)
    done = admit(mgr, "done", "aabbccd")
    admit(mgr, "a", "aabbxx")
    r = admit(mgr, "b", "aabbcyz")
    mgr.free(done)
    return mgr, r


def _long(mgr, bad: dict[int, object] | None = None) -> Request:
    """A request whose first five blocks are full and hashed (the first three as b's).

    ``bad`` replaces hashes by index (``Request.block_hashes`` is a plain list a caller can spoil).
    """
    req = Request("long", letters("aabbcyzzqq"))
    mgr.hasher.update(req)
    for i, h in (bad or {}).items():
        req.block_hashes[i] = h
    return req


def _partial_cache(mgr, r):
    # Table of b is [1, 2, 6, 7]; only 3 blocks are full, so caching 4 must refuse.
    mgr.block_pool.cache_full_blocks(r, mgr.get_blocks("b"), 3, 4, 2)


CASES = [
    (
        "more blocks than are free",
        NotEnoughFreeBlocksError,
        "cannot get 7 free blocks from the GPU pool: 6 free of 11",
        lambda m, r: m.block_pool.get_new_blocks(7),
    ),
    (
        "negative count",
        InvalidArgumentError,
        "num_blocks must be an int >= 0, got -1",
        lambda m, r: m.block_pool.get_new_blocks(-1),
    ),
    (
        "freeing a free block",
        BlockStateError,
        r"double free in the GPU pool: block\(s\) \[4\]",
        lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[7], m.block_pool.blocks[4]]),
    ),
    (
        "freeing a block twice in one call",
        BlockStateError,
        r"block\(s\) \[7\]",
        lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[7], m.block_pool.blocks[7]]),
    ),
    ("hashing a partial block", HashingError, "block 3 is partial or not final", _partial_cache),
    (
        "caching a block already cached under another hash",
        BlockStateError,
        "block 5 is already cached under another hash",
        lambda m, r: m.block_pool.cache_full_blocks(r, m.req_to_blocks["a"], 2, 3, 2),
    ),
    (
        "touching a free block twice, then a foreign block",
        BlockStateError,
        "block 9 does not belong to this GPU pool",
        lambda m, r: m.block_pool.touch([m.block_pool.blocks[3], m.block_pool.blocks[3], BlockPool(12).blocks[9]]),
    ),
    (
        "freeing held blocks, then a non-block",
        InvalidArgumentError,
        "ordered_blocks must hold KVCacheBlock objects, got 7",
        lambda m, r: m.block_pool.free_blocks([m.block_pool.blocks[5], m.block_pool.blocks[6], 7]),
    ),
    (
        "caching a range whose last block is foreign",
        BlockStateError,
        "block 7 does not belong to this GPU pool",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8], BlockPool(12).blocks[7]], 3, 5, 2
        ),
    ),
    (
        "caching a range that lists a block twice",
        BlockStateError,
        "listed twice",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8], m.block_pool.blocks[8]], 3, 5, 2
        ),
    ),
    (
        "caching one block under an unhashable hash",
        InvalidArgumentError,
        r"block hash 3 of the request must be bytes or an int, got \[1, 2\]",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {3: [1, 2]}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8]], 3, 4, 2
        ),
    ),
    (
        "caching a range whose last hash is unhashable",
        InvalidArgumentError,
        r"block hash 4 of the request must be bytes or an int, got \{\}",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {4: {}}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8], m.block_pool.blocks[9]], 3, 5, 2
        ),
    ),
    (
        "caching one block under a None hash",
        InvalidArgumentError,
        r"block hash 3 of the request must be bytes or an int, got None",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {3: None}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8]], 3, 4, 2
        ),
    ),
    (
        "caching one block under a str hash",
        InvalidArgumentError,
        r"block hash 3 of the request must be bytes or an int, got 'x'",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {3: "x"}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8]], 3, 4, 2
        ),
    ),
    (
        "caching a range whose last hash is a float",
        InvalidArgumentError,
        r"block hash 4 of the request must be bytes or an int, got 1.5",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {4: 1.5}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8], m.block_pool.blocks[9]], 3, 5, 2
        ),
    ),
    (
        "caching a range whose last hash is a tuple",
        InvalidArgumentError,
        r"block hash 4 of the request must be bytes or an int, got \(1,\)",
        lambda m, r: m.block_pool.cache_full_blocks(
            _long(m, {4: (1,)}), [*m.req_to_blocks["b"][:3], m.block_pool.blocks[8], m.block_pool.blocks[9]], 3, 5, 2
        ),
    ),
    (
        "probing a prefix with a bool among the hashes",
        InvalidArgumentError,
        "an item of block_hashes must be bytes or an int, got True",
        lambda m, r: m.block_pool.get_cached_prefix([r.block_hashes[0], True]),
    ),
    (
        "zero new tokens",
        InvalidArgumentError,
        "num_new_tokens must be an int > 0, got 0",
        lambda m, r: m.allocate_slots(r, 0),
    ),
    (
        "negative new tokens",
        InvalidArgumentError,
        "num_new_tokens must be an int > 0, got -3",
        lambda m, r: m.allocate_slots(r, -3),
    ),
    (
        "negative lookahead",
        InvalidArgumentError,
        "num_lookahead_tokens must be an int >= 0, got -1",
        lambda m, r: m.allocate_slots(r, 1, num_lookahead_tokens=-1),
    ),
    (
        "prefix hits after the first allocation",
        InvalidArgumentError,
        "only be added on first allocation",
        lambda m, r: m.allocate_slots(r, 1, 2, [m.block_pool.blocks[1]]),
    ),
    (
        "computed tokens not matching computed blocks",
        InvalidArgumentError,
        "cover 2 tokens",
        lambda m, r: m.allocate_slots(Request("new", letters("aab")), 1, 1, [m.block_pool.blocks[1]]),
    ),
    (
        "the first hit block given twice",
        InvalidArgumentError,
        r"new_computed_blocks\[1\] \(block 1\) is not cached under the request's block 1 hash",
        lambda m, r: m.allocate_slots(Request("new", letters("aabbq")), 1, 4, [m.block_pool.blocks[1]] * 2),
    ),
    (
        "hits in the wrong order",
        InvalidArgumentError,
        r"new_computed_blocks\[0\] \(block 2\) is not cached under the request's block 0 hash",
        lambda m, r: m.allocate_slots(
            Request("new", letters("aabbq")), 1, 4, [m.block_pool.blocks[2], m.block_pool.blocks[1]]
        ),
    ),
    (
        "a hit of another prefix",
        InvalidArgumentError,
        r"new_computed_blocks\[0\] \(block 1\) is not cached",
        lambda m, r: m.allocate_slots(Request("new", letters("xxq")), 1, 2, [m.block_pool.blocks[1]]),
    ),
    (
        "more hits than the request has full blocks",
        InvalidArgumentError,
        "2 new_computed_blocks but the request has only 1 full blocks",
        lambda m, r: m.allocate_slots(Request("new", letters("aab")), 1, 4, [m.block_pool.blocks[1]] * 2),
    ),
    (
        "a restore from a block cached under another hash",
        InvalidArgumentError,
        r"computed_blocks\[0\] \(block 2\) is not cached under the request's block 0 hash",
        lambda m, r: m.restore(Request("new", letters("aabbq")), [m.block_pool.blocks[2]], 4),
    ),
]


@pytest.mark.parametrize(("name", "exc", "message", "action"), CASES, ids=[c[0] for c in CASES])
def test_misuse_raises_and_changes_nothing(name, exc, message, action):
    mgr, r = populated()
    before = manager_snapshot(mgr)
    with pytest.raises(exc, match=message) as info:
        action(mgr, r)
    assert isinstance(info.value, TieredKVError)
    assert manager_snapshot(mgr) == before, f"{name}: state changed"
    mgr.block_pool.check_invariants()


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    mgr, r = populated()
    before = manager_snapshot(mgr)
    big = Request("big", letters("aabbcc" + "q" * 20))
    hits, n = mgr.get_computed_blocks(big)
    assert [b.block_id for b in hits] == [1, 2, 3]  # block 3 is free-but-cached: touching it costs a free block
    assert mgr.allocate_slots(big, big.num_tokens - n, n, hits) is None
    assert mgr.allocate_slots(r, 1, num_lookahead_tokens=30) is None
    assert manager_snapshot(mgr) == before


@pytest.mark.parametrize("n", [0, 1, -5, 2.0, True])
def test_bad_pool_sizes(n):
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an int >= 2"):
        BlockPool(n)


@pytest.mark.parametrize("bs", [0, -16, 1.5])
def test_bad_block_sizes(bs):
    with pytest.raises(InvalidArgumentError, match="block_size must be a positive int"):
        KVCacheManager(8, block_size=bs)


def test_bad_medium_and_max_tokens():
    with pytest.raises(InvalidArgumentError, match="medium must be one of"):
        BlockPool(4, medium="TPU")
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        Request("r", [1], max_tokens=-1)
    # vLLM's SamplingParams refuses max_tokens=0 too ("max_tokens must be at least 1").
    with pytest.raises(InvalidArgumentError, match=r"max_tokens must be an int >= 1 .*got 0"):
        Request("r", [1], max_tokens=0)
