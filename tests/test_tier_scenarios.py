"""Exact tier-manager scenarios on tiny pools: tables, free queues, store contents and plans."""

from mgrutil import cq, gq, make_tm, run, settle
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, PreemptMode, Residency
from tiered_kv.transfer import PlanKind


def shared_prefix_setup():
    tm, eng = make_tm()
    a = run(tm, "A", "AAAABBBBCC")  # [1 2 3]; 1, 2 cached
    b = run(tm, "B", "AAAABBBBDDDDE")  # hits 1 2, new [4 5]; 4 cached
    assert tm.gpu_block_ids("A") == [1, 2, 3] and tm.gpu_block_ids("B") == [1, 2, 4, 5]
    assert gq(tm) == ["6", "7", "8"]
    return tm, eng, a, b


def test_swap_out_and_resume_of_a_request_sharing_a_prefix():
    tm, eng, _a, _b = shared_prefix_setup()
    q = tm.quote("B")
    # Every KV block is stored (the store has none of them), so a resume can never lose one;
    # only B's own blocks 4 and 5 are freed on the GPU.
    assert (q.blocks_to_move, q.blocks_freed, q.cpu_blocks_needed, q.num_runs) == (4, 2, 4, 2)
    assert q.bytes_to_move == 4 * 4 * 1024 and q.can_swap and q.num_tokens == 13

    p = tm.preempt("B", "swap")
    assert (p.mode, p.blocks_freed_now, p.blocks_freed_on_completion) == (PreemptMode.SWAP, 0, 2)
    (plan,) = tm.plans_in_flight()
    assert (plan.kind, plan.src_block_ids, plan.dst_block_ids) == (PlanKind.SWAP_OUT, (1, 2, 4, 5), (1, 2, 3, 4))
    assert tm.residency("B") is Residency.SWAPPING_OUT
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5]  # still owned while the copy reads them
    assert cq(tm) == ["1~", "2~", "3~", "4~"] and tm.blocks_freed_on_completion() == 2
    tm.check_invariants()

    (done,) = settle(tm, eng)
    assert done.ok and done.residency is Residency.CPU and tm.residency("B") is Residency.CPU
    assert tm.cpu_block_ids("B") == [1, 2, 3, 4] and cq(tm) == ["1@1", "2@1", "3@1", "4@1"]  # pinned
    # 5 (partial) to the front, 4 (cached) to the back: still findable by hash on the GPU.
    assert gq(tm) == ["5", "6", "7", "8", "4*"]
    tm.check_invariants()

    res = tm.resume("B")
    # 1, 2 (shared) and 4 (still cached) are re-hit on the GPU: only the partial block is copied.
    assert res.num_tokens == 13 and res.plan.src_block_ids == (4,) and res.plan.dst_block_ids == (5,)
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5] and tm.residency("B") is Residency.SWAPPING_IN
    (done,) = settle(tm, eng)
    assert done.ok and done.num_tokens == 13 and tm.residency("B") is Residency.GPU
    # The full blocks stay cached on the CPU, unpinned; the private tail is gone.
    assert cq(tm) == ["1", "2", "3"] and tm.store.free_block_ids() == [5, 6, 7, 8, 4]
    m = tm.metrics()
    assert (m.counters.swap_out_blocks, m.counters.swap_in_blocks, m.counters.preemptions_swap) == (4, 1, 1)
    tm.check_invariants()


def test_resume_after_its_prefix_was_evicted_from_the_gpu():
    tm, eng = make_tm()
    b = run(tm, "B", "AAAABBBBCCCCD")  # [1 2 3 4]
    tm.preempt("B", "swap")
    settle(tm, eng)
    assert tm.cpu_block_ids("B") == [1, 2, 3, 4]
    assert gq(tm) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]
    run(tm, "D", "z" * 32)  # takes every GPU block: evicts B's cached prefix
    assert tm.gpu_block_ids("D") == [4, 5, 6, 7, 8, 3, 2, 1]
    assert tm.gpu.block_pool.get_cached_block(b.block_hashes[0]) is None
    tm.free("D")
    assert gq(tm) == ["1*", "2*", "3*", "8*", "7*", "6*", "5*", "4*"]

    res = tm.resume("B")
    # Nothing left on the GPU: all four blocks come back from the CPU, into other ids.
    assert res.plan.src_block_ids == (1, 2, 3, 4) and res.plan.dst_block_ids == (1, 2, 3, 8)
    assert tm.gpu_block_ids("B") == [1, 2, 3, 8]
    assert tm.gpu.block_pool.get_cached_block(b.block_hashes[0]) is None  # not findable until the bytes land
    settle(tm, eng)
    assert tm.gpu.block_pool.get_cached_block(b.block_hashes[0]).block_id == 1
    assert tm.residency("B") is Residency.GPU
    assert cq(tm) == ["1", "2", "3"]  # a second-level prefix cache now
    tm.check_invariants()


def test_a_shared_block_is_stored_too_so_a_resume_never_loses_kv():
    tm, eng, _a, _b = shared_prefix_setup()
    tm.preempt("B", "swap")
    settle(tm, eng)
    tm.free("A")
    assert gq(tm) == ["3", "5", "6", "7", "8", "4*", "2*", "1*"]
    run(tm, "C", "z" * 28)  # 7 blocks: evicts 4 and 2 from the GPU
    tm.free("C")
    res = tm.resume("B")
    # Block 1 is still cached on the GPU; 2 and 4 were stored with the swap-out: nothing is lost.
    assert res.num_tokens == 13 and res.plan.src_block_ids == (2, 3, 4)
    assert tm.gpu_block_ids("B")[0] == 1
    settle(tm, eng)
    assert tm.residency("B") is Residency.GPU
    tm.check_invariants()


def test_recompute_preemption_frees_at_once_and_the_request_rehits_its_cached_blocks():
    tm, _eng, _a, b = shared_prefix_setup()
    p = tm.preempt("B", "recompute")
    assert (p.mode, p.blocks_freed_now, p.residency) == (PreemptMode.RECOMPUTE, 2, None)
    assert not tm.holds("B") and tm.plans_in_flight() == []
    assert gq(tm) == ["5", "6", "7", "8", "4*"]  # hashed block 4 stays cached
    b.num_computed_tokens = 0  # the scheduler's part: the KV is gone
    res = tm.admit(b, b.num_tokens)
    # Prompt re-prefilled: 1, 2 and 4 are hits (capped at 3 blocks), one new block for the last token.
    assert res.num_computed_tokens == 12 and [x.block_id for x in res.new_blocks] == [5]
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5]
    tm.check_invariants()


def test_cpu_hit_onboarded_for_a_new_request():
    tm, eng = make_tm(offload="write_through")
    p = run(tm, "P", "AAAABBBBCCCCD")  # write-through: full prompt blocks 1 2 3 stored
    (plan,) = tm.plans_in_flight()
    assert (plan.kind, plan.src_block_ids, plan.dst_block_ids) == (PlanKind.OFFLOAD, (1, 2, 3), (1, 2, 3))
    assert [tm.gpu.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]  # the copy holds its sources
    # P's stores are its own, ranked by position while it runs: its tail is the first to go (vLLM 0.33).
    assert cq(tm) == ["3~", "2~", "1~"]
    settle(tm, eng)
    assert cq(tm) == ["3", "2", "1"]
    tm.free("P")
    f = Request("F", letters("f" * 32))
    assert tm.admit(f, 32) is not None  # evicts P's prefix from the GPU
    tm.free("F")
    assert gq(tm) == ["1*", "2*", "3*", "8*", "7*", "6*", "5*", "4*"]
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = tm.admit(q, q.num_tokens)
    assert (res.num_computed_tokens, res.num_loading_tokens, res.num_new_tokens, res.runnable) == (0, 12, 1, False)
    assert res.plan.kind is PlanKind.ONBOARD and res.plan.src_block_ids == (1, 2, 3)
    assert res.plan.dst_block_ids == (1, 2, 3) and tm.gpu_block_ids("Q") == [1, 2, 3, 8]
    # Pinned while read, and a use by Q: the first block of a prefix is the last to go (vLLM's order).
    assert tm.residency("Q") is Residency.LOADING and cq(tm) == ["3@1", "2@1", "1@1"]
    (done,) = settle(tm, eng)
    assert done.ok and done.num_tokens == 12 and tm.residency("Q") is Residency.GPU
    assert tm.gpu.block_pool.get_cached_block(p.block_hashes[2]).block_id == 3
    assert cq(tm) == ["3", "2", "1"]
    m = tm.metrics()
    assert (m.counters.cpu_hit_tokens, m.counters.onboard_blocks, m.counters.offload_blocks) == (12, 3, 3)
    tm.check_invariants()


def test_write_through_sources_stay_held_until_the_copy_finishes():
    tm, eng = make_tm(offload="write_through")
    run(tm, "F", "f" * 32)
    tm.free("F")
    # The store copy still reads F's eight blocks: none may be handed out yet.
    assert tm.num_free_gpu_blocks() == 0 and tm.blocks_freed_on_completion() == 8
    assert tm.admit(Request("Q", letters("q" * 5)), 5) is None
    settle(tm, eng)
    assert tm.num_free_gpu_blocks() == 8
    tm.check_invariants()


def test_write_back_offload_saves_the_blocks_nearest_eviction_and_keeps_their_place():
    tm, eng = make_tm(gpu=6, offload="write_back", evict_window=3)
    p = run(tm, "P", "AAAABBBBC")  # [1 2 3]
    tm.free("P")
    assert gq(tm) == ["3", "4", "5", "2*", "1*"]
    tm.poll()  # the window [3 4 5] holds nothing cached
    assert tm.plans_in_flight() == []
    run(tm, "N", "n" * 8)  # takes 3 4
    tm.poll()  # window [5 2* 1*]: P's two blocks are saved, in eviction order
    (plan,) = tm.plans_in_flight()
    assert plan.kind is PlanKind.OFFLOAD and plan.src_block_ids == (2, 1) and plan.request_id is None
    # Held while copied: not free, so nothing can be handed them; they still hit on the GPU.
    assert gq(tm) == ["5"] and [tm.gpu.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert tm.gpu.block_pool.get_cached_block(p.block_hashes[0]).block_id == 1
    assert tm.admit(Request("M", letters("m" * 8)), 8) is None  # needs 2 blocks, 1 is free
    assert tm.blocks_freed_on_completion() == 2
    settle(tm, eng)
    # Back exactly where they were, cached on both tiers; nothing new to save.
    assert gq(tm) == ["5", "2*", "1*"] and tm.plans_in_flight() == []
    assert tm.store.lookup_prefix(p.block_hashes[:2]) == 2
    res = tm.admit(Request("M", letters("m" * 8)), 8)  # takes 5 and 2: evicts 2, which the CPU has
    assert res.runnable and tm.gpu_block_ids("M") == [5, 2]
    assert tm.metrics().counters.offload_blocks == 2
    tm.check_invariants()


def test_auto_mode_swaps_when_the_link_is_fast_and_recomputes_when_it_is_slow_and_says_why():
    fast = CostModel(
        kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12, prefill_tokens_per_s=1000.0
    )
    slow = CostModel(
        kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1e3, h2d_bytes_per_s=1e3, prefill_tokens_per_s=1e9
    )
    for cm, expected, why in ((fast, PreemptMode.SWAP, "swap is cheaper"), (slow, PreemptMode.RECOMPUTE, "no dearer")):
        tm, _eng = make_tm(cost_model=cm)
        run(tm, "A", "a" * 12)
        p = tm.preempt("A", "auto")
        assert p.mode is expected and why in p.reason
        (d,) = tm.decision_log
        assert (d.request_id, d.requested, d.mode, d.reason) == ("A", "auto", expected, p.reason)


def test_auto_recomputes_and_says_so_when_the_cpu_tier_is_full():
    fast = CostModel(kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    tm, eng = make_tm(gpu=11, cpu=4, cost_model=fast)  # the store holds 3 blocks
    run(tm, "A", "a" * 12)
    run(tm, "B", "b" * 12)
    tm.preempt("A", "swap")  # takes all three slots, pinned
    settle(tm, eng)
    q = tm.quote("B")
    assert not q.cpu_has_room and q.swap_s < q.recompute_s
    assert tm.preempt("B", "swap") is None  # forced swap is impossible: nothing changes
    assert tm.residency("B") is Residency.GPU and len(tm.decision_log) == 1
    p = tm.preempt("B", "auto")
    assert p.mode is PreemptMode.RECOMPUTE
    assert "the CPU tier has no room for 3 blocks although swapping would be cheaper" in p.reason
    assert tm.decision_log[-1].reason == p.reason


def test_gpu_evictions_are_counted_at_poll_from_the_pool_without_its_events():
    tm, eng = make_tm(gpu=6, cpu=0)
    pool = tm.gpu.block_pool
    assert pool.enable_kv_cache_events is False  # the count needs no events
    run(tm, "A", "AAAABBBBCCCC")  # [1 2 3], all cached
    tm.free("A")
    assert gq(tm) == ["4", "5", "3*", "2*", "1*"]
    run(tm, "B", "XXXXYYYYZZZZ")  # 4 5 3: block 3 is evicted at hand-out
    assert tm.gpu_block_ids("B") == [4, 5, 3] and pool.num_evicted_blocks == 1
    assert tm.counters.gpu_blocks_evicted == 0  # counted when the manager polls, as before
    settle(tm, eng)
    assert tm.counters.gpu_blocks_evicted == 1
    tm.free("B")
    run(tm, "C", "PPPPQQQQRRRR")  # B's 3 5 4 went back cached; C takes 2 1 then 3: evicts 2 1 3
    assert tm.gpu_block_ids("C") == [2, 1, 3]
    settle(tm, eng)
    assert (tm.counters.gpu_blocks_evicted, pool.num_evicted_blocks, pool.take_events()) == (4, 4, [])
    tm.check_invariants()
