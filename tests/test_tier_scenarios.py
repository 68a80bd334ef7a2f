"""Exact tier-manager scenarios on tiny pools: tables, free queues and CPU contents."""

from mgrutil import cq, gq, make_tm, run
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.manager import PreemptMode, RequestState
from tiered_kv.transfer import PlanKind


def shared_prefix_setup():
    tm, eng = make_tm()
    a = run(tm, "A", "AAAABBBBCC")  # [1 2 3]; 1, 2 cached
    b = run(tm, "B", "AAAABBBBDDDDE")  # hits 1 2, new [4 5]; 4 cached
    assert tm.gpu_block_ids("A") == [1, 2, 3] and tm.gpu_block_ids("B") == [1, 2, 4, 5]
    assert gq(tm) == ["6", "7", "8"]
    return tm, eng, a, b


def test_swap_out_and_resume_of_a_request_sharing_a_prefix():
    tm, eng, _a, b = shared_prefix_setup()
    q = tm.quote("B")
    assert (q.blocks_to_move, q.blocks_freed, q.cpu_blocks_needed, q.num_runs) == (2, 2, 2, 1)
    assert q.bytes_to_move == 2 * 4 * 1024 and q.cpu_has_room

    d = tm.preempt_request("B", "swap")
    assert d.mode is PreemptMode.SWAP and d.blocks_freed == 2
    (plan,) = tm.plans_in_flight()
    # Shared blocks 1 and 2 are not copied; only B's own blocks 4 (full) and 5 (partial).
    assert (plan.kind, plan.src_block_ids, plan.dst_block_ids) == (PlanKind.SWAP_OUT, (4, 5), (1, 2))
    assert tm.state("B") is RequestState.SWAPPING_OUT
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5]  # still owned while the copy reads them
    assert gq(tm) == ["6", "7", "8"] and cq(tm) == ["3", "4", "5", "6", "7", "8"]
    tm.check_invariants()

    eng.complete(plan.plan_id)
    tm.poll()
    assert tm.state("B") is RequestState.SWAPPED
    assert tm.cpu_block_ids("B") == [None, None, 1, 2]
    # 5 (partial) to the front, 4 (cached) to the back: still findable by hash on the GPU.
    assert gq(tm) == ["5", "6", "7", "8", "4*"]
    assert tm.cpu_pool.blocks[1].block_hash == b.block_hashes[2]  # registered by hash on the CPU
    assert [tm.gpu_pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    tm.check_invariants()

    res = tm.resume("B")
    # 1, 2 shared and 4 still cached on the GPU are re-hit: only the partial block is copied.
    assert res.plan.src_block_ids == (2,) and res.plan.dst_block_ids == (5,)
    assert res.num_restored_tokens == 13 and res.num_lost_tokens == 0
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5] and not tm.is_runnable("B")
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.is_runnable("B") and b.num_computed_tokens == 13
    assert cq(tm) == ["2", "3", "4", "5", "6", "7", "8", "1*"]  # the CPU copy of block 4 stays cached
    m = tm.metrics()
    assert (m.counters.swap_out_blocks, m.counters.swap_in_blocks, m.counters.preemptions_swap) == (2, 1, 1)
    tm.check_invariants()


def test_resume_after_its_prefix_was_evicted_from_the_gpu():
    tm, eng = make_tm()
    b = run(tm, "B", "AAAABBBBCCCCD")  # [1 2 3 4]
    tm.preempt_request("B", "swap")
    eng.complete_all()
    tm.poll()
    assert tm.cpu_block_ids("B") == [1, 2, 3, 4]
    assert gq(tm) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]
    run(tm, "D", "z" * 32)  # takes every GPU block: evicts B's cached prefix
    assert tm.gpu_block_ids("D") == [4, 5, 6, 7, 8, 3, 2, 1]
    assert tm.gpu_pool.get_cached_block(b.block_hashes[0]) is None
    tm.finish("D")
    assert gq(tm) == ["1*", "2*", "3*", "8*", "7*", "6*", "5*", "4*"]

    res = tm.resume("B")
    # Nothing left on the GPU: all four blocks come back from the CPU, into different ids.
    assert res.plan.src_block_ids == (1, 2, 3, 4) and res.plan.dst_block_ids == (1, 2, 3, 8)
    assert tm.gpu_block_ids("B") == [1, 2, 3, 8]
    assert tm.gpu_pool.get_cached_block(b.block_hashes[0]) is None  # not findable until the bytes land
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.gpu_pool.get_cached_block(b.block_hashes[0]).block_id == 1
    assert tm.is_runnable("B") and b.num_computed_tokens == 13
    assert cq(tm) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]  # second-level prefix cache
    tm.check_invariants()


def test_resume_with_a_shared_block_lost_from_both_tiers_recomputes_the_rest():
    tm, eng, _a, b = shared_prefix_setup()
    tm.preempt_request("B", "swap")
    eng.complete_all()
    tm.poll()
    tm.finish("A")
    assert gq(tm) == ["3", "5", "6", "7", "8", "4*", "2*", "1*"]
    run(tm, "C", "z" * 28)  # 7 blocks: evicts 4 and 2
    res = tm.resume("B")
    # Block 1 is still cached; block 2 (shared, never copied) is gone: resume up to it.
    assert (res.num_restored_tokens, res.num_lost_tokens, res.plan) == (4, 9, None)
    assert tm.gpu_block_ids("B") == [1] and b.num_computed_tokens == 4
    assert tm.is_runnable("B")
    assert tm.metrics().counters.tokens_recomputed == 9
    tm.check_invariants()


def test_recompute_after_preemption_rehits_its_cached_blocks():
    tm, _eng, _a, b = shared_prefix_setup()
    d = tm.preempt_request("B", "recompute")
    assert d.mode is PreemptMode.RECOMPUTE
    assert tm.state("B") is RequestState.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert gq(tm) == ["5", "6", "7", "8", "4*"]  # hashed block 4 stays cached
    assert tm.plans_in_flight() == []
    res = tm.admit(b, b.num_tokens)
    # Prompt re-prefilled: 1, 2 and 4 are hits (capped at 3 blocks), one new block for the last token.
    assert res.num_gpu_hit_tokens == 12 and [x.block_id for x in res.new_blocks] == [5]
    assert tm.gpu_block_ids("B") == [1, 2, 4, 5] and b.num_computed_tokens == 12
    assert tm.metrics().counters.tokens_recomputed == 1
    tm.check_invariants()


def test_cpu_hit_onboarded_for_a_new_request():
    tm, eng = make_tm(offload="write_through")
    p = run(tm, "P", "AAAABBBBCCCCD")  # write-through: full prompt blocks 1 2 3 copied out
    (plan,) = tm.plans_in_flight()
    assert (plan.kind, plan.src_block_ids, plan.dst_block_ids) == (PlanKind.OFFLOAD, (1, 2, 3), (1, 2, 3))
    assert [tm.gpu_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]  # the plan holds its sources
    eng.complete(plan.plan_id)
    tm.poll()
    assert cq(tm) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]
    tm.finish("P")
    f = Request("F", letters("f" * 32))
    assert tm.admit(f, 32) is not None  # evicts P's prefix from the GPU (F never computed: no offload)
    tm.finish("F")
    assert gq(tm) == ["1*", "2*", "3*", "8*", "7*", "6*", "5*", "4*"]
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = tm.admit(q, q.num_tokens)
    assert (res.num_gpu_hit_tokens, res.num_cpu_hit_tokens, res.runnable) == (0, 12, False)
    assert res.plan.kind is PlanKind.ONBOARD
    assert res.plan.src_block_ids == (1, 2, 3) and res.plan.dst_block_ids == tuple(tm.gpu_block_ids("Q")[:3])
    assert tm.gpu_block_ids("Q") == [1, 2, 3, 8] and q.num_computed_tokens == 0
    assert cq(tm) == ["4", "5", "6", "7", "8"]  # hits held while the plan reads them
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.is_runnable("Q") and q.num_computed_tokens == 12
    assert tm.gpu_pool.get_cached_block(p.block_hashes[2]).block_id == 3
    assert cq(tm) == ["4", "5", "6", "7", "8", "3*", "2*", "1*"]
    m = tm.metrics()
    assert (m.counters.cpu_hit_tokens, m.counters.onboard_blocks, m.counters.offload_blocks) == (12, 3, 3)
    tm.check_invariants()


def test_write_through_sources_stay_held_until_the_copy_finishes():
    tm, eng = make_tm(offload="write_through")
    run(tm, "F", "f" * 32)
    tm.finish("F")
    # The offload plan still reads F's eight blocks: none may be handed out yet.
    assert tm.gpu_pool.get_num_free_blocks() == 0
    assert tm.admit(Request("Q", letters("q" * 5)), 5) is None
    eng.complete_all()
    tm.poll()
    assert tm.gpu_pool.get_num_free_blocks() == 8
    tm.check_invariants()


def test_on_evict_saves_the_blocks_nearest_eviction_and_keeps_their_place():
    tm, eng = make_tm(gpu=6, offload="on_evict", evict_window=3)
    p = run(tm, "P", "AAAABBBBC")  # [1 2 3]
    tm.finish("P")
    assert gq(tm) == ["3", "4", "5", "2*", "1*"]
    tm.poll()  # the window [3 4 5] holds nothing cached
    assert tm.plans_in_flight() == []
    run(tm, "N", "n" * 8)  # takes 3 4
    tm.poll()  # window [5 2* 1*]: P's two blocks are saved, in eviction order
    (plan,) = tm.plans_in_flight()
    assert plan.kind is PlanKind.OFFLOAD and plan.src_block_ids == (2, 1) and plan.request_id is None
    # Held while copied: not free, so nothing can be handed them; they still hit on the GPU.
    assert gq(tm) == ["5"] and [tm.gpu_pool.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert tm.gpu_pool.get_cached_block(p.block_hashes[0]).block_id == 1
    assert tm.admit(Request("M", letters("m" * 8)), 8) is None  # needs 2 blocks, 1 is free
    assert tm.blocks_freed_on_completion() == 2
    eng.complete(plan.plan_id)
    tm.poll()
    # Back exactly where they were, cached on both tiers; nothing new to save.
    assert gq(tm) == ["5", "2*", "1*"] and tm.plans_in_flight() == []
    assert tm.cpu_pool.get_cached_block(p.block_hashes[0]) is not None
    res = tm.admit(Request("M", letters("m" * 8)), 8)  # takes 5 and 2: evicts 2, which the CPU has
    assert res.runnable and tm.gpu_block_ids("M") == [5, 2]
    assert tm.metrics().counters.offload_blocks == 2
    tm.check_invariants()


def test_preempt_selects_enough_victims_and_logs_the_decision():
    tm, _eng = make_tm(gpu=11, cpu=0, policy="lru")
    run(tm, "A", "a" * 12)  # 3 blocks
    run(tm, "B", "b" * 8)  # 2 blocks
    run(tm, "C", "c" * 12)  # 3 blocks
    tm.mark_scheduled("A")  # A is now the most recently scheduled
    assert tm.preempt(6, mode="swap") is None  # no CPU tier: nothing changes
    res = tm.preempt(4)
    assert [v.request_id for v in res.victims] == ["B", "C"]
    assert all(v.mode is PreemptMode.RECOMPUTE for v in res.victims)
    assert res.blocks_freed_now == 5 and res.blocks_freed_on_completion == 0
    (entry,) = tm.decision_log
    assert (entry.blocks_needed, entry.policy, entry.candidates) == (4, "lru", 3)
    assert tm.preempt(4) is None  # A alone frees only 3


def test_auto_mode_swaps_when_the_link_is_fast_and_recomputes_when_it_is_slow():
    from tiered_kv.manager import CostModel

    fast = CostModel(
        kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12, prefill_tokens_per_s=1000.0
    )
    slow = CostModel(
        kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1e3, h2d_bytes_per_s=1e3, prefill_tokens_per_s=1e9
    )
    for cm, expected in ((fast, PreemptMode.SWAP), (slow, PreemptMode.RECOMPUTE)):
        tm, _eng = make_tm(cost_model=cm, policy="cost_aware")
        run(tm, "A", "a" * 12)
        res = tm.preempt(1, mode="auto")
        assert res.victims[0].mode is expected
