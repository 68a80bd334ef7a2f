"""Exact-order unit tests of BlockPool, in the style of vLLM's own tests."""

from poolutil import admit, letters, queue

from tiered_kv.core import BlockPool, BlockRemoved, BlockStored, KVCacheManager, Request, external_hash


def test_null_block_is_block_zero_and_never_handed_out():
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks(reversed(got))
    assert pool.free_queue_ids() == [4, 3, 2, 1]  # unhashed blocks: front, in the order given


def test_usage_metric_excludes_null_block():
    pool = BlockPool(11)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.get_usage() == 1 - 6 / 10
    pool.get_new_blocks(6)
    assert pool.get_usage() == 1.0
    pool.free_blocks(blocks)
    assert pool.get_usage() == 1 - 4 / 10


def test_prefix_hit_on_block_still_in_free_queue_removes_it_from_the_middle():
    mgr = KVCacheManager(9, block_size=4)
    r0 = admit(mgr, "r0", "AAAABBBBCCCCD")  # blocks 1,2,3 full, 4 partial
    mgr.free(r0)
    assert queue(mgr.block_pool) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]
    r1 = Request("r1", letters("AAAABBBBzz"))
    hits, n = mgr.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [1, 2] and n == 8
    assert queue(mgr.block_pool) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]  # lookup does not touch
    new = mgr.allocate_slots(r1, 2, n, hits)
    assert [b.block_id for b in new] == [4]
    assert queue(mgr.block_pool) == ["5", "6", "7", "8", "3*"]
    assert mgr.get_block_ids("r1") == [1, 2, 4]
    mgr.block_pool.check_invariants()


def test_eviction_happens_only_at_hand_out():
    pool_mgr = KVCacheManager(4, block_size=2, enable_kv_cache_events=True)
    pool = pool_mgr.block_pool
    r = admit(pool_mgr, "r", "abcdef")  # 3 full blocks: 1 2 3
    pool_mgr.free(r)
    pool.take_events()
    assert queue(pool) == ["3*", "2*", "1*"]
    h3 = pool.blocks[3].block_hash
    assert pool.get_cached_block(h3) is pool.blocks[3]  # free, and still a hit
    got = pool.get_new_blocks(1)
    assert got[0].block_id == 3 and got[0].block_hash is None
    assert pool.get_cached_block(h3) is None
    assert pool.take_events() == [BlockRemoved([external_hash(h3, True)], "GPU", 0)]
    assert queue(pool) == ["2*", "1*"]


def test_duplicate_hashes_are_not_deduplicated():
    mgr = KVCacheManager(10, block_size=4)
    a = Request("a", letters("SAMEPROMPTxx"))
    b = Request("b", letters("SAMEPROMPTxx"))
    # Both are scheduled before either is cached: neither sees the other's blocks.
    ha, _ = mgr.get_computed_blocks(a)
    hb, _ = mgr.get_computed_blocks(b)
    assert ha == [] and hb == []
    mgr.allocate_slots(a, 12)
    mgr.allocate_slots(b, 12)
    assert mgr.get_block_ids("a") == [1, 2, 3] and mgr.get_block_ids("b") == [4, 5, 6]
    pool = mgr.block_pool
    h = a.block_hashes[0]
    assert pool.blocks[1].block_hash == pool.blocks[4].block_hash == h
    assert list(pool.cached_block_hash_to_block[h]) == [1, 4]
    assert pool.get_cached_block(h) is pool.blocks[1]  # the first cached wins
    mgr.free(a)  # a's blocks go to the back; the lookup still finds block 1 (free)
    assert pool.get_cached_block(h) is pool.blocks[1]
    pool.get_new_blocks(4)  # 7 8 9 then 3 (a's deepest) -- not yet block 1
    assert pool.get_cached_block(h) is pool.blocks[1]
    pool.get_new_blocks(2)  # 2 then 1: block 1 evicted, b's duplicate takes over
    assert pool.get_cached_block(h) is pool.blocks[4]
    assert mgr.get_block_ids("b") == [4, 5, 6]  # b's table never changed
    pool.check_invariants()


def test_free_in_reverse_order_puts_deepest_block_first():
    mgr = KVCacheManager(8, block_size=2)
    r = admit(mgr, "r", "aabbccdde")  # 4 full + 1 partial: 1 2 3 4 5
    mgr.free(r)
    assert queue(mgr.block_pool) == ["5", "6", "7", "4*", "3*", "2*", "1*"]


def test_free_blocks_prepends_unhashed_in_given_order_and_appends_hashed_in_given_order():
    mgr = KVCacheManager(10, block_size=1)
    pool = mgr.block_pool
    admit(mgr, "r", "abc")  # all 3 full (block size 1): 1 2 3 hashed
    extra = pool.get_new_blocks(3)  # 4 5 6 unhashed
    pool.free_blocks([extra[1], pool.blocks[2], extra[0], pool.blocks[1], extra[2], pool.blocks[3]])
    assert queue(pool) == ["5", "4", "6", "7", "8", "9", "2*", "1*", "3*"]


def test_shared_block_returns_to_queue_only_at_last_owner():
    mgr = KVCacheManager(8, block_size=2)
    a = admit(mgr, "a", "xxyyz")
    b = admit(mgr, "b", "xxyyq")
    assert mgr.get_block_ids("a") == [1, 2, 3] and mgr.get_block_ids("b") == [1, 2, 4]
    mgr.free(a)
    assert queue(mgr.block_pool) == ["3", "5", "6", "7"]
    mgr.free(b)
    assert queue(mgr.block_pool) == ["4", "3", "5", "6", "7", "2*", "1*"]


def test_lookahead_slots_get_blocks_but_are_never_cached():
    mgr = KVCacheManager(10, block_size=4)
    r = Request("r", letters("abcdef"))
    new = mgr.allocate_slots(r, 6, num_lookahead_tokens=6)  # 12 slots: 3 blocks
    assert [b.block_id for b in new] == [1, 2, 3]
    assert [b.block_hash is not None for b in new] == [True, False, False]
    r.num_computed_tokens = 6
    r.append_output_token_ids(letters("gh"))  # block 2 is now full of final tokens
    more = mgr.allocate_slots(r, 2, num_lookahead_tokens=6)  # 6 + 2 + 6 = 14 slots: a 4th block
    assert [b.block_id for b in more] == [4]
    assert [b.block_hash is not None for b in new + more] == [True, True, False, False]


def test_caching_disabled_is_a_lifo_allocator():
    mgr = KVCacheManager(6, block_size=2, enable_caching=False)
    r = admit(mgr, "r", "aabbc")
    assert mgr.get_computed_blocks(Request("s", letters("aabbc"))) == ([], 0)
    mgr.free(r)
    assert queue(mgr.block_pool) == ["3", "2", "1", "4", "5"]
    assert mgr.block_pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_refused_while_blocks_are_held():
    mgr = KVCacheManager(6, block_size=2, enable_kv_cache_events=True)
    r = admit(mgr, "r", "aabbc")
    mgr.take_events()
    assert mgr.reset_prefix_cache() is False
    assert mgr.block_pool.blocks[1].block_hash is not None
    mgr.free(r)
    assert mgr.reset_prefix_cache() is True
    assert queue(mgr.block_pool) == ["3", "4", "5", "2", "1"]  # order kept, hashes gone
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert [type(e).__name__ for e in mgr.take_events()] == ["AllBlocksCleared"]
    assert mgr.make_prefix_cache_stats().reset is True


def test_block_stored_events_carry_chain_and_tokens():
    mgr = KVCacheManager(10, block_size=2, enable_kv_cache_events=True, medium="GPU", kv_events_int_hashes=False)
    r = Request("r", letters("abcde"), lora_name="adapter", cache_salt="s")
    mgr.allocate_slots(r, 5)
    (ev,) = mgr.take_events()
    h = r.block_hashes
    keys = [("adapter", "s"), ("adapter",)]  # vLLM's untagged extra keys: LoRA name, salt on block 0
    # The manager names its group's kind, as vLLM's KVCacheManager.take_events does.
    kind = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    assert ev == BlockStored(h[:2], None, letters("abcd"), 2, None, "GPU", "adapter", keys, **kind)
    r.num_computed_tokens = 5
    r.append_output_token_ids(ord("f"))
    mgr.allocate_slots(r, 1)  # the one-block path builds the same shape
    (ev,) = mgr.take_events()
    assert ev == BlockStored([h[2]], h[1], letters("ef"), 2, None, "GPU", "adapter", [("adapter",)], **kind)
    assert mgr.take_events() == []


def test_events_publish_hashes_as_64_bit_ints_by_default():
    mgr = KVCacheManager(4, block_size=2, enable_kv_cache_events=True)
    r = admit(mgr, "r", "aabbc")
    h = r.block_hashes
    as_int = [int.from_bytes(x, "big") & (2**64 - 1) for x in h[:2]]
    (ev,) = mgr.take_events()
    kind = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    assert ev == BlockStored(as_int, None, letters("aabb"), 2, None, "GPU", None, [None, None], **kind)
    mgr.free(r)
    assert queue(mgr.block_pool) == ["3", "2*", "1*"]
    mgr.block_pool.get_new_blocks(3)  # evicts 2 then 1: one event each, in hand-out order
    assert mgr.take_events() == [BlockRemoved([as_int[1]], "GPU", 0), BlockRemoved([as_int[0]], "GPU", 0)]
    assert mgr.block_pool.num_evicted_blocks == 2


def test_prefix_cache_stats_count_tokens():
    mgr = KVCacheManager(20, block_size=4)
    admit(mgr, "a", "abcdefghijkl")
    b = Request("b", letters("abcdefghXXXX"))
    mgr.get_computed_blocks(b)
    b.num_preemptions = 1
    mgr.get_computed_blocks(b)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 24, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 12, 8)
    assert mgr.make_prefix_cache_stats().requests == 0


def test_cache_hit_capped_so_last_prompt_token_is_recomputed():
    mgr = KVCacheManager(10, block_size=4)
    admit(mgr, "a", "abcdefgh")
    b = Request("b", letters("abcdefgh"))  # identical, block-aligned prompt
    hits, n = mgr.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [1] and n == 4


def test_touch_and_free_skip_null_blocks_as_vllm_does():
    """Sliding-window tables carry null blocks; touching or freeing them is a no-op, not an error."""
    pool = BlockPool(6)
    null = pool.null_block
    got = pool.get_new_blocks(2)  # 1 2
    pool.touch([null, got[0], null])
    assert (null.ref_cnt, got[0].ref_cnt) == (0, 2)
    pool.free_blocks([null, got[1], got[0], null])
    assert (null.ref_cnt, got[0].ref_cnt, got[1].ref_cnt) == (0, 1, 0)
    assert pool.free_queue_ids() == [2, 3, 4, 5]
    pool.free_blocks([got[0], null])
    assert pool.free_queue_ids() == [1, 2, 3, 4, 5]
    pool.check_invariants()


def test_cache_full_blocks_skips_null_blocks_and_blocks_already_cached_under_their_hash():
    mgr = KVCacheManager(8, block_size=2, enable_kv_cache_events=True, kv_events_int_hashes=False)
    pool = mgr.block_pool
    r = admit(mgr, "r", "aabbcc")  # blocks 1 2 3, all cached
    pool.take_events()
    table = list(mgr.get_blocks("r"))
    before = [b.block_hash for b in table]
    pool.cache_full_blocks(r, table, 0, 3, 2)  # every block already carries its own hash: nothing to do
    pool.cache_full_blocks(r, table, 1, 2, 2)
    assert [b.block_hash for b in table] == before and pool.take_events() == []
    # A table whose first block is null (out of the window) and whose others are fresh.
    r2 = Request("r2", letters("aabbcc"))
    r2.block_hashes.extend(r.block_hashes)
    fresh = pool.get_new_blocks(2)  # 4 5
    pool.cache_full_blocks(r2, [pool.null_block, *fresh], 0, 3, 2)
    assert pool.null_block.block_hash is None
    assert [b.block_hash for b in fresh] == r.block_hashes[1:]
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored) and ev.block_hashes == r.block_hashes[1:]
    # vLLM's shape: the parent is the hash before the range and the tokens span it, null block included.
    assert ev.parent_block_hash is None and ev.token_ids == letters("aabbcc")
    pool.check_invariants()


def test_external_tokens_get_slots_but_are_cached_only_after_they_land():
    """The first allocation of a request whose middle prefix arrives by copy from another tier."""
    mgr = KVCacheManager(12, block_size=4)
    a = admit(mgr, "a", "AAAABBBBx")
    mgr.free(a)  # AAAA and BBBB cached on the GPU
    req = Request("q", letters("AAAABBBBCCCCDDDDq"))
    hits, n = mgr.get_computed_blocks(req)
    assert n == 8
    # CCCC and DDDD come from another tier (8 external tokens), then 1 new token.
    new = mgr.allocate_slots(req, 8 + 1, n, hits, num_external_computed_tokens=8)
    assert [b.block_id for b in new] == [3, 4, 5] and mgr.get_block_ids("q") == [1, 2, 3, 4, 5]
    assert [b.block_hash is None for b in new] == [True, True, True]  # not written yet: not cached
    mgr.cache_blocks(req, 16)  # the copy landed
    assert [b.block_hash for b in new[:2]] == req.block_hashes[2:4]
    probe = Request("p", letters("AAAABBBBCCCCDDDDz"))
    assert mgr.get_computed_blocks(probe)[1] == 16


def test_restore_installs_hits_then_fresh_blocks_and_changes_nothing_when_it_does_not_fit():
    mgr = KVCacheManager(8, block_size=4)
    r = admit(mgr, "r", "AAAABBBBCCCCD")  # 1 2 3 4
    r_hashes = list(r.block_hashes)
    mgr.free(r)  # as if it had been swapped out: AAAA BBBB CCCC stay cached
    other = admit(mgr, "o", "zzzzzzzzzzzzzzzzz")  # 5 blocks: takes 4 5 6 7 and evicts 3 (CCCC)
    assert mgr.get_block_ids("o") == [4, 5, 6, 7, 3]
    hits = [mgr.block_pool.get_cached_block(h) for h in r_hashes[:2]]
    assert mgr.restore(r, hits, 13) is None  # needs 2 fresh blocks, none is free
    mgr.free(other)
    new = mgr.restore(r, hits, 13)
    assert [b.block_id for b in new] == [3, 7] and mgr.get_block_ids("r") == [1, 2, 3, 7]
    assert new[0].block_hash is None  # CCCC lands by copy, then gets cached
    mgr.cache_blocks(r, 13)
    assert new[0].block_hash == r_hashes[2] and new[1].block_hash is None
    mgr.block_pool.check_invariants()


def test_get_cached_prefix_returns_the_hits_up_to_the_first_miss_as_get_cached_block_does():
    mgr = KVCacheManager(12, block_size=2)
    r0 = admit(mgr, "r0", "aabbccd")  # 1 2 3 full, 4 partial
    r1 = admit(mgr, "r1", "aabbxxy")  # hits 1 2, then 5 6
    pool = mgr.block_pool
    hashes = r0.block_hashes
    assert [b.block_id for b in pool.get_cached_prefix(hashes)] == [1, 2, 3]
    assert pool.get_cached_prefix(hashes) == [pool.get_cached_block(h) for h in hashes]
    assert [b.block_id for b in pool.get_cached_prefix(hashes, 2)] == [1, 2]
    assert pool.get_cached_prefix(hashes, 0) == []
    assert pool.get_cached_prefix((hashes[0], b"\x00" * 32, hashes[2])) == [pool.blocks[1]]  # stops at the miss
    assert pool.get_cached_prefix([b"\x00" * 32, "not a hash"]) == []  # items after the miss are not examined
    mgr.free(r0)
    assert [b.block_id for b in pool.get_cached_prefix(hashes)] == [1, 2, 3]  # free blocks still hit
    assert queue(pool) == ["4", "7", "8", "9", "10", "11", "3*"]  # and stay where they were
    mgr.free(r1)


def test_on_evict_gets_the_evicted_blocks_and_their_hashes_in_hand_out_order():
    mgr = KVCacheManager(5, block_size=2)
    pool = mgr.block_pool
    seen = []
    pool.on_evict = lambda blocks, hashes: seen.append(([b.block_id for b in blocks], list(hashes)))
    r = admit(mgr, "r", "aabbccdd")  # 1 2 3 4, all full
    old = list(r.block_hashes)
    mgr.free(r)
    assert queue(pool) == ["4*", "3*", "2*", "1*"]
    assert seen == []
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [4, 3, 2]
    assert seen == [([4, 3, 2], [old[3], old[2], old[1]])]
    pool.free_blocks(got)
    pool.get_new_blocks(1)  # block 4, no hash any more: nothing evicted, no call
    assert len(seen) == 1
