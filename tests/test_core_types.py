"""Every argument of every public core call is checked, types included, before anything changes.

One row per (method, argument, bad value).  Each row runs against the same
populated manager (shared, cached, free-cached and partial blocks in play) and
must raise a :class:`TieredKVError` and leave the pool and the manager exactly
as they were.  ``bool`` is not a count, and neither is a float or a NumPy integer.
"""

from __future__ import annotations

import pytest
from poolutil import admit, letters, manager_snapshot

from tiered_kv.core import BlockPool, KVCacheManager, MultiModalFeature, Request
from tiered_kv.errors import BlockStateError, InvalidArgumentError, TieredKVError

np = pytest.importorskip("numpy")


def populated() -> tuple[KVCacheManager, Request, BlockPool]:
    mgr = KVCacheManager(12, block_size=2, enable_kv_cache_events=True)
    done = admit(mgr, "done", "aabbccd")
    admit(mgr, "a", "aabbxx")
    r = admit(mgr, "b", "aabbcyz")
    mgr.free(done)
    other = BlockPool(12)  # same ids, different objects: its blocks are foreign here
    return mgr, r, other


def fresh() -> Request:
    return Request("fresh", letters("aabbccdd"))


BAD_COUNTS = [2.5, True, None, "3", np.int64(2)]

ROWS: list[tuple[str, object]] = []
for v in BAD_COUNTS:
    ROWS += [
        (f"get_new_blocks({v!r})", lambda m, r, o, v=v: m.block_pool.get_new_blocks(v)),
        (f"allocate_slots num_new_tokens={v!r}", lambda m, r, o, v=v: m.allocate_slots(r, v)),
        (f"allocate_slots first allocation num_new_tokens={v!r}", lambda m, r, o, v=v: m.allocate_slots(fresh(), v)),
        (
            f"allocate_slots num_new_computed_tokens={v!r}",
            lambda m, r, o, v=v: m.allocate_slots(fresh(), 2, v, m.get_computed_blocks(fresh())[0]),
        ),
        (f"allocate_slots num_lookahead_tokens={v!r}", lambda m, r, o, v=v: m.allocate_slots(r, 1, 0, None, v)),
        (f"num_blocks_to_allocate num_new_tokens={v!r}", lambda m, r, o, v=v: m.num_blocks_to_allocate(r, v)),
        (f"cache_blocks num_computed_tokens={v!r}", lambda m, r, o, v=v: m.cache_blocks(r, v)),
        (
            f"cache_full_blocks num_full_blocks={v!r}",
            lambda m, r, o, v=v: m.block_pool.cache_full_blocks(r, m.get_blocks("b"), 3, v, 2),
        ),
        (
            f"cache_full_blocks block_size={v!r}",
            lambda m, r, o, v=v: m.block_pool.cache_full_blocks(r, m.get_blocks("b"), 3, 3, v),
        ),
    ]
ROWS += [
    ("allocate_slots delay_cache_blocks=1", lambda m, r, o: m.allocate_slots(r, 1, delay_cache_blocks=1)),
    ("allocate_slots request=None", lambda m, r, o: m.allocate_slots(None, 1)),
    ("allocate_slots request='b'", lambda m, r, o: m.allocate_slots("b", 1)),
    (
        "allocate_slots new_computed_blocks as a tuple",
        lambda m, r, o: m.allocate_slots(fresh(), 2, 4, tuple(m.get_computed_blocks(fresh())[0])),
    ),
    (
        "allocate_slots with a foreign hit",
        lambda m, r, o: m.allocate_slots(fresh(), 2, 2, [o.blocks[1]]),
    ),
    ("get_computed_blocks(None)", lambda m, r, o: m.get_computed_blocks(None)),
    ("free(request id instead of request)", lambda m, r, o: m.free("b")),
    ("get_blocks(unhashable)", lambda m, r, o: m.get_blocks(["b"])),
    ("get_block_ids(None)", lambda m, r, o: m.get_block_ids(None)),
    ("touch a foreign block", lambda m, r, o: m.block_pool.touch([m.block_pool.blocks[3], o.blocks[5]])),
    ("touch a block id", lambda m, r, o: m.block_pool.touch([3])),
    ("touch None", lambda m, r, o: m.block_pool.touch(None)),
    ("free a foreign block", lambda m, r, o: m.block_pool.free_blocks([m.block_pool.blocks[6], o.blocks[6]])),
    ("free_blocks of a string", lambda m, r, o: m.block_pool.free_blocks("12")),
    ("free_blocks of None items", lambda m, r, o: m.block_pool.free_blocks([None])),
    (
        "cache_full_blocks a foreign block",
        lambda m, r, o: m.block_pool.cache_full_blocks(r, [*m.get_blocks("b")[:3], o.blocks[9]], 3, 4, 2),
    ),
    (
        "cache_full_blocks a request id",
        lambda m, r, o: m.block_pool.cache_full_blocks("b", m.get_blocks("b"), 3, 3, 2),
    ),
    (
        "cache_block_hashes a foreign block",
        lambda m, r, o: m.block_pool.cache_block_hashes([o.blocks[8]], [b"h" * 32]),
    ),
    (
        "cache_block_hashes a bad hash",
        lambda m, r, o: m.block_pool.cache_block_hashes([m.block_pool.blocks[8]], [1.5]),
    ),
    ("get_cached_block(None)", lambda m, r, o: m.block_pool.get_cached_block(None)),
    ("get_cached_block(a list)", lambda m, r, o: m.block_pool.get_cached_block([1])),
    ("get_cached_block(True)", lambda m, r, o: m.block_pool.get_cached_block(True)),
]


@pytest.mark.parametrize(("name", "action"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_argument_raises_and_changes_nothing(name, action):
    mgr, r, other = populated()
    before = manager_snapshot(mgr)
    other_before = [(b.ref_cnt, b.block_hash) for b in other.blocks]
    with pytest.raises(TieredKVError):
        action(mgr, r, other)
    assert manager_snapshot(mgr) == before, f"{name}: state changed"
    assert [(b.ref_cnt, b.block_hash) for b in other.blocks] == other_before, f"{name}: the other pool changed"
    mgr.block_pool.check_invariants()
    other.check_invariants()


def test_a_foreign_block_is_named_as_such():
    mgr, _, other = populated()
    with pytest.raises(BlockStateError, match="block 5 does not belong to this GPU pool"):
        mgr.block_pool.touch([other.blocks[5]])


@pytest.mark.parametrize("bad", [2.5, np.int64(3), True])
def test_first_allocation_with_a_bad_count_touches_no_hit_and_installs_no_table(bad):
    """The hits of a new request are touched and its table installed only after every check."""
    mgr, _, _ = populated()
    req = Request("late", letters("aabbq"))
    hits, n = mgr.get_computed_blocks(req)
    assert [b.block_id for b in hits] == [1, 2]
    before = manager_snapshot(mgr)
    with pytest.raises(InvalidArgumentError, match="num_new_tokens must be an int > 0"):
        mgr.allocate_slots(req, bad, n, hits)
    assert manager_snapshot(mgr) == before
    assert mgr.get_blocks("late") == []
    assert mgr.allocate_slots(req, 1, n, hits) is not None  # a correct retry works


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a sequence of ints"),
        ({"prompt_token_ids": [1, 2.0]}, "token ids must be ints"),
        ({"prompt_token_ids": [1, True]}, "token ids must be ints"),
        ({"prompt_token_ids": None}, "prompt_token_ids must be a sequence"),
        ({"max_tokens": True}, "max_tokens must be an int >= 1"),
        ({"max_tokens": 2.0}, "max_tokens must be an int >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ({"request_id": None}, "request_id must be a hashable id"),
        ({"request_id": ["r"]}, "request_id must be a hashable id"),
        ({"lora_name": 3}, "lora_name must be a str or None"),
        ({"cache_salt": b"s"}, "cache_salt must be a str or None"),
        ({"arrival_time": float("nan")}, "arrival_time must be a finite number"),
        ({"skip_prefix_cache": 1}, "skip_prefix_cache must be True or False"),
        ({"mm_features": [("img", 0, 4)]}, "mm_features must hold MultiModalFeature"),
    ],
)
def test_bad_request_fields(kwargs, message):
    args = {"request_id": "r", "prompt_token_ids": [1, 2, 3]}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        Request(**args)


def test_appending_bad_tokens_changes_nothing():
    req = Request("r", [1, 2, 3], mm_features=[MultiModalFeature("img", 0, 2)])
    for bad in (None, 1.0, [4, "5"], "45", True):
        with pytest.raises(InvalidArgumentError):
            req.append_output_token_ids(bad)
    assert req.all_token_ids == [1, 2, 3]
    req.append_output_token_ids([4, 5])
    req.append_output_token_ids(6)
    assert req.output_token_ids == [4, 5, 6]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_caching": 1}, "enable_caching must be True or False"),
        ({"hash_seed": 1.0}, "hash_seed must be an int >= 0"),
        ({"log_stats": None}, "log_stats must be True or False"),
        ({"max_model_len": 0}, "max_model_len must be an int > 0"),
        ({"block_pool": object()}, "block_pool must be a BlockPool"),
    ],
)
def test_bad_manager_construction(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        KVCacheManager(8, block_size=2, **kwargs)
