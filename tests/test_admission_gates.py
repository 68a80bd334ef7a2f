"""vLLM 0.33's admission gates in the pool and the tier manager: the full-sequence gate, the watermark, no-chunk.

``KVCacheManager.allocate_slots(full_sequence_must_fit=...)`` and the ``watermark`` follow
vLLM 0.33's ``kv_cache_manager.py``: the whole sequence, its prefix hits counted as held, must
fit the free blocks (plus the watermark) before the first chunk is allocated; the watermark,
``int(watermark * num_blocks)`` blocks, applies to a request that holds no blocks (a waiting or
preempted one) while others run, never to a running request's growth.
"""

from __future__ import annotations

import math

import pytest
from mgrutil import make_tm
from poolutil import admit, letters, manager_snapshot

from tiered_kv.core import KVCacheManager, Request
from tiered_kv.errors import InvalidArgumentError


def test_the_full_sequence_gate_counts_every_token_with_the_hits_as_held():
    # 5 usable blocks of 4.  A computes 8 tokens (2 blocks) and finishes: they stay cached, free.
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    a = admit(mgr, "A", "aaaabbbb")
    mgr.free(a)
    admit(mgr, "C", "cccc")  # holds 1 block: 4 free, 2 of them A's cached blocks
    assert mgr.block_pool.get_num_free_blocks() == 4
    # B: A's 8 tokens, then 9 more (5 blocks whole).  Its first chunk of 4 tokens takes the 2 hits
    # and 1 new block (3 <= 4); its whole sequence the 2 hits and 3 new blocks (5 > 4).
    b = Request("B", letters("aaaabbbb" + "ddddeeeef"))
    hits, n = mgr.get_computed_blocks(b)
    assert ([h.block_id for h in hits], n) == ([1, 2], 8)
    assert mgr.num_free_blocks_required(b, 4, n, hits) == 3
    assert mgr.num_free_blocks_required(b, 4, n, hits, full_sequence_must_fit=True) == 5
    before = manager_snapshot(mgr)
    assert mgr.allocate_slots(b, 4, n, hits, full_sequence_must_fit=True) is None
    assert manager_snapshot(mgr) == before
    new = mgr.allocate_slots(b, 4, n, hits)
    assert [blk.block_id for blk in new] == [4]
    assert mgr.get_block_ids("B") == [1, 2, 4] and mgr.get_block_ids("C") == [3]


def test_the_full_sequence_gate_admits_what_fits_whole():
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    b = Request("B", letters("abcdefghijklmnopq"))  # 17 tokens: 5 blocks, all 5 free
    assert [blk.block_id for blk in mgr.allocate_slots(b, 8, full_sequence_must_fit=True)] == [1, 2]


def test_the_watermark_applies_to_admissions_while_others_run_and_never_to_growth():
    mgr = KVCacheManager(num_blocks=10, block_size=4, watermark=0.25)  # int(0.25 * 10) = 2 blocks
    assert mgr.watermark_blocks == 2
    a = Request("A", letters("a" * 20))
    assert len(mgr.allocate_slots(a, 20, has_scheduled_reqs=False)) == 5  # nothing runs: no watermark
    a.num_computed_tokens = 20
    b = Request("B", letters("b" * 12))  # 3 blocks; 4 are free, and the watermark keeps 2 of them
    assert mgr.num_free_blocks_required(b, 12) == 5
    before = manager_snapshot(mgr)
    assert mgr.allocate_slots(b, 12) is None
    assert manager_snapshot(mgr) == before
    assert mgr.num_free_blocks_required(b, 12, has_scheduled_reqs=False) == 3
    # A running request grows into the watermark: it holds blocks, so it is not an admission.
    assert [blk.block_id for blk in mgr.allocate_slots(a, 13)] == [6, 7, 8, 9]
    assert mgr.block_pool.get_num_free_blocks() == 0


@pytest.mark.parametrize(("watermark", "blocks"), [(0.0, 0), (0.09, 0), (0.1, 1), (0.25, 2), (0.999, 9)])
def test_the_watermark_in_blocks_is_vllms_int_of_the_fraction_of_the_whole_pool(watermark, blocks):
    assert KVCacheManager(num_blocks=10, block_size=4, watermark=watermark).watermark_blocks == blocks


@pytest.mark.parametrize("watermark", [-0.1, 1.0, 1, math.nan, math.inf, True, "0.1", None])
def test_a_bad_watermark_is_refused(watermark):
    with pytest.raises(InvalidArgumentError, match=r"watermark must be a fraction of the pool in \[0, 1\)"):
        KVCacheManager(num_blocks=10, block_size=4, watermark=watermark)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"full_sequence_must_fit": 1}, "full_sequence_must_fit"), ({"has_scheduled_reqs": "yes"}, "has_scheduled_reqs")],
)
def test_bad_gate_flags_are_refused_and_change_nothing(kwargs, name):
    mgr = KVCacheManager(num_blocks=10, block_size=4, watermark=0.25)
    a = admit(mgr, "A", "aaaabbbb")
    b = Request("B", letters("aaaabbbbcc"))
    hits, n = mgr.get_computed_blocks(b)
    before = manager_snapshot(mgr)
    for call in (
        lambda: mgr.allocate_slots(b, 2, n, hits, **kwargs),
        lambda: mgr.allocate_slots(a, 1, **kwargs),  # a running request's step takes the same checks
        lambda: mgr.num_free_blocks_required(b, 2, n, hits, **kwargs),
    ):
        with pytest.raises(InvalidArgumentError, match=name):
            call()
        assert manager_snapshot(mgr) == before


# ------------------------------------------------------------------------------- the tier manager
def test_admit_without_chunking_refuses_what_is_left_after_the_hits_if_it_exceeds_the_step():
    tm, _ = make_tm(gpu=9, cpu=0)
    a = Request("A", letters("aaaabbbbcccc"))
    assert tm.admit(a, 12) is not None
    a.num_computed_tokens = 12
    tm.free("A")  # its 3 blocks stay cached
    fresh = Request("C", letters("xxxxyyyyzzzzww"))
    free = tm.num_free_gpu_blocks()
    assert tm.admit(fresh, 2, chunked=False) is None  # 14 tokens, no hit: more than a step of 2
    assert (tm.num_free_gpu_blocks(), tm.requests()) == (free, [])
    b = Request("B", letters("aaaabbbbccccdd"))  # 12 of its 14 tokens hit: 2 are left, a step of 2
    res = tm.admit(b, 2, chunked=False)
    assert res is not None and (res.num_computed_tokens, res.num_new_tokens) == (12, 2)


def test_admit_gates_on_the_whole_sequence_and_keeps_the_managers_watermark():
    tm, _ = make_tm(gpu=10, cpu=0, watermark=0.2)  # 9 usable blocks; int(0.2 * 10) = 2 kept free
    assert tm.watermark_blocks == 2
    assert tm.admit(Request("A", letters("a" * 20)), 20, has_scheduled_reqs=False) is not None  # 5 blocks
    b = Request("B", letters("b" * 20))  # 5 blocks whole; its first chunk of 4 tokens takes 1
    assert tm.admit(b, 4, full_sequence_must_fit=True, has_scheduled_reqs=False) is None  # 5 > 4 free
    assert (tm.requests(), tm.num_free_gpu_blocks()) == (["A"], 4)
    assert tm.admit(b, 4) is not None  # the first chunk and the watermark: 1 + 2 <= 4
    assert tm.gpu_block_ids("B") == [6]
    c = Request("C", letters("c" * 12))  # 3 blocks, 3 free: only with nobody running
    assert tm.admit(c, 12) is None
    assert (tm.requests(), tm.num_free_gpu_blocks()) == (["A", "B"], 3)
    assert tm.admit(c, 12, has_scheduled_reqs=False) is not None
    assert tm.gpu_block_ids("C") == [7, 8, 9]


@pytest.mark.parametrize("flag", ["chunked", "full_sequence_must_fit", "has_scheduled_reqs"])
def test_admit_refuses_a_bad_gate_flag_and_changes_nothing(flag):
    tm, _ = make_tm(gpu=10, cpu=0)
    with pytest.raises(InvalidArgumentError, match=flag):
        tm.admit(Request("A", letters("aaaa")), 4, **{flag: 1})
    assert tm.requests() == [] and tm.num_free_gpu_blocks() == 9
