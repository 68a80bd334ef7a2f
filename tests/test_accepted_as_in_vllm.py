"""Inputs vLLM 0.33 accepts as valid are accepted here and treated as vLLM treats them; its misuse stays refused.

Found by running vLLM's own unit tests against the project
(``test_vllm_unit_tests.py``, ``test_store_vllm_unit.py``, which run them when
vLLM's source can be fetched); checked here on tiny cases without it:

* a request with an empty prompt is a valid record (vLLM's
  ``test_allocate_with_lookahead`` allocates for one); what serves requests
  refuses it, as vLLM's input processor does ("The decoder prompt cannot be empty");
* ``cache_full_blocks`` caches blocks built outside any pool (vLLM's
  ``test_cache_blocks``); a block of another pool stays refused;
* a CPU store of no capacity (vLLM's manager of 0 chunks:
  ``test_cpu_manager_reports_cache_usage_gauge``) stores nothing and reads 0.
"""

from __future__ import annotations

import pytest
from mgrutil import make_tm, run, tm_snapshot
from poolutil import letters, pool_snapshot

from tiered_kv.core import BlockHasher, BlockPool, KVCacheBlock, KVCacheManager, Request
from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.sched import Scheduler
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.policies import CACHE_POLICIES


# ----------------------------------------------------------------- an empty prompt
def test_the_kv_manager_allocates_for_an_empty_prompt_with_lookahead_as_vllm_does():
    mgr = KVCacheManager(10, block_size=4)
    req = Request("0", [])
    assert (req.num_tokens, req.block_hashes) == (0, [])
    assert mgr.get_computed_blocks(req) == ([], 0)
    new = mgr.allocate_slots(req, 3, num_lookahead_tokens=2)  # ceil((3 + 2) / 4) = 2 blocks
    assert [b.block_id for b in new] == [1, 2] and mgr.get_block_ids("0") == [1, 2]
    assert mgr.block_pool.get_num_cached_blocks() == 0  # nothing is full with final tokens: nothing cached
    mgr.free(req)
    assert mgr.block_pool.free_queue_ids() == [2, 1, *range(3, 10)]
    mgr.block_pool.check_invariants()


def test_serving_an_empty_prompt_is_refused_where_it_would_be_served_and_changes_nothing():
    tm, _ = make_tm()
    run(tm, "a", "abcdefgh")
    before = tm_snapshot(tm)
    with pytest.raises(InvalidArgumentError, match=r"request 'e': the prompt is empty.*decoder prompt cannot be empty"):
        tm.admit(Request("e", []), 4)
    assert tm_snapshot(tm) == before and not tm.is_open("e")
    s = Scheduler(tm)
    with pytest.raises(InvalidArgumentError, match="request 'e': the prompt is empty"):
        s.add_request(Request("e", []))
    assert s.num_unfinished == 0 and tm_snapshot(tm) == before


# ----------------------------------------------------------------- blocks built by hand
def _hashed(tokens: int, block_size: int = 4) -> Request:
    req = Request("0", list(range(tokens)))
    BlockHasher.create(block_size, "sha256").update(req)
    return req


def test_cache_full_blocks_caches_blocks_built_outside_any_pool_as_vllm_does():
    pool = BlockPool(5)
    before = pool_snapshot(pool)
    req = _hashed(14)  # 3 full blocks and a partial one
    blocks = [KVCacheBlock(i) for i in range(2)]
    pool.cache_full_blocks(req, blocks, 0, 2, 4)
    assert [b.block_hash for b in blocks] == req.block_hashes[:2]
    blocks.append(KVCacheBlock(2))
    pool.cache_full_blocks(req, blocks, 2, 3, 4)  # a range that does not start at the beginning
    assert [b.block_hash for b in blocks] == req.block_hashes[:3]
    assert pool.get_num_cached_blocks() == 3
    assert [pool.get_cached_block(h) for h in req.block_hashes[:3]] == blocks  # lookups find them, as in vLLM
    assert pool.get_cached_prefix(req.block_hashes) == blocks
    # The pool's own blocks are as they were: no hash, same free queue; nothing of the pool's is lost.
    assert pool_snapshot(pool)[:2] == before[:2] and all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants()
    # Held, freed or registered it cannot be: no free queue of this pool holds it.
    with pytest.raises(BlockStateError, match="block 1 was built outside any pool: this GPU pool can cache it"):
        pool.touch([blocks[1]])
    with pytest.raises(BlockStateError, match="built outside any pool"):
        pool.free_blocks([blocks[1]])
    assert blocks[1].ref_cnt == 0
    pool.check_invariants()


def test_a_block_of_another_pool_is_still_refused_and_neither_pool_changes():
    pool, other = BlockPool(5), BlockPool(5)
    req = _hashed(8)
    mine, theirs = pool_snapshot(pool), pool_snapshot(other)
    with pytest.raises(BlockStateError, match="block 2 does not belong to this GPU pool"):
        pool.cache_full_blocks(req, [KVCacheBlock(1), other.blocks[2]], 0, 2, 4)
    assert (pool_snapshot(pool), pool_snapshot(other)) == (mine, theirs)
    assert pool.get_num_cached_blocks() == 0  # the hand-built block before it was taken out again
    pool.check_invariants()
    other.check_invariants()


# ----------------------------------------------------------------- a CPU store of no capacity
@pytest.mark.parametrize("policy", sorted(CACHE_POLICIES))
def test_a_cpu_store_of_no_capacity_stores_nothing_and_reads_zero_as_vllms_does(policy):
    store = CPUStore(1, policy)
    assert (store.capacity, store.num_free, store.usage) == (0, 0, 0.0)
    usage = store.get_stats()
    assert (usage.usage, usage.write_usage, usage.read_usage, usage.allocation_sizes) == (0.0, 0.0, 0.0, ())
    ctx = RequestContext("r")
    store.on_new_request(ctx)
    assert store.prepare_store([b"a", b"b"], ctx) is None  # no room, nothing evictable: refused, nothing changed
    assert store.entries() == [] and store.free_block_ids() == []
    out = store.prepare_store([], ctx)
    assert out is not None and out.keys_to_store == []
    assert store.lookup_prefix([b"a"]) == 0 and store.get_stats().allocation_sizes == (2,)  # vLLM counts the try
    store.on_request_finished(ctx)
    store.check_invariants()


def test_what_vllm_refuses_too_stays_refused():
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an int >= 1"):
        CPUStore(0)
    with pytest.raises(InvalidArgumentError, match=r"max_tokens must be an int >= 1 .*got 0"):
        Request("r", letters("ab"), max_tokens=0)
