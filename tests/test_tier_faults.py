"""Faults with a test-controlled copy engine: nothing is lost, nothing reused while copied."""

import pytest
from fakekv import FakeKV
from mgrutil import cq, gq, make_tm, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError, PlanError
from tiered_kv.manager import RequestState
from tiered_kv.transfer import PlanKind, TransferHandle, TransferPlan


def setup(**kw):
    tm, eng = make_tm(**kw)
    kv = FakeKV()
    eng.on_complete = kv.copy
    return tm, eng, kv


def compute_run(tm, kv, rid, text):
    req = Request(rid, letters(text))
    res = tm.admit(req, req.num_tokens)
    assert res.runnable and res.num_gpu_hit_tokens + res.num_new_tokens == req.num_tokens
    kv.compute(tm, rid, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    tm.on_tokens_computed(rid)
    return req


def test_failed_swap_out_leaves_request_whole_on_gpu():
    tm, eng, kv = setup()
    compute_run(tm, kv, "A", "AAAABBBBCC")
    before_cpu = cq(tm)
    tm.preempt_request("A", "swap")
    (plan,) = tm.plans_in_flight()
    eng.fail(plan.plan_id)
    (c,) = tm.poll()
    assert not c.ok and tm.state("A") is RequestState.RUNNING
    assert tm.gpu_block_ids("A") == [1, 2, 3] and cq(tm) == before_cpu
    assert tm.metrics().counters.plans_failed == 1
    kv.check(tm)
    tm.check_invariants()
    # Still preemptable, by either mode.
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    assert tm.state("A") is RequestState.SWAPPED
    kv.check(tm)


def test_cancelled_swap_out_rolls_back():
    tm, eng, kv = setup()
    compute_run(tm, kv, "A", "AAAABBBBCC")
    tm.preempt_request("A", "swap")
    assert tm.cancel("A") is True
    assert tm.state("A") is RequestState.RUNNING and tm.plans_in_flight() == []
    assert tm.metrics().counters.plans_cancelled == 1 and eng.pending_ids() == []
    kv.check(tm)
    tm.check_invariants()


def test_delayed_swap_out_keeps_gpu_blocks_from_reuse():
    tm, eng, kv = setup(gpu=5)
    compute_run(tm, kv, "A", "AAAABBBBCC")  # 3 of 4 usable blocks
    tm.preempt_request("A", "swap")
    big = Request("B", letters("x" * 9))
    assert tm.admit(big, 9) is None  # A's blocks are still being read
    assert tm.state("A") is RequestState.SWAPPING_OUT
    with pytest.raises(InvalidTransitionError, match="plan 1 in flight"):
        tm.finish("A")
    eng.complete_all()
    tm.poll()
    assert tm.admit(big, 9) is not None
    kv.check(tm)
    tm.check_invariants()


def test_reordered_completions_settle_each_plan_correctly():
    tm, eng, kv = setup(gpu=11)
    compute_run(tm, kv, "A", "AAAABBBBC")
    compute_run(tm, kv, "B", "XXXXYYYYZ")
    tm.preempt_request("A", "swap")
    tm.preempt_request("B", "swap")
    pa, pb = eng.pending_ids()
    eng.complete(pb)
    tm.poll()
    assert tm.state("B") is RequestState.SWAPPED and tm.state("A") is RequestState.SWAPPING_OUT
    eng.complete(pa)
    tm.poll()
    assert tm.state("A") is RequestState.SWAPPED
    ra, rb = tm.resume("A"), tm.resume("B")
    eng.complete_in_order([rb.plan.plan_id, ra.plan.plan_id])
    tm.poll()
    assert tm.is_runnable("A") and tm.is_runnable("B")
    kv.check(tm)
    tm.check_invariants()


def test_failed_swap_in_keeps_the_cpu_copy_and_can_be_retried():
    tm, eng, kv = setup()
    a = compute_run(tm, kv, "A", "AAAABBBBCC")
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    run_gpu = Request("F", letters("f" * 32))
    tm.admit(run_gpu, 32)  # evict A's cached blocks
    tm.finish("F")
    res = tm.resume("A")
    eng.fail(res.plan.plan_id)
    tm.poll()
    assert tm.state("A") is RequestState.SWAPPED and tm.cpu_block_ids("A") == [1, 2, 3]
    assert tm.gpu_pool.get_cached_block(a.block_hashes[0]) is None  # the failed copy was never cached
    kv.check(tm)
    tm.check_invariants()
    res = tm.resume("A")
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.is_runnable("A") and a.num_computed_tokens == 10
    kv.check(tm)


def test_failed_onboard_leaves_the_request_recomputable():
    tm, eng, kv = setup(offload="write_through")
    compute_run(tm, kv, "P", "AAAABBBBCCCCD")
    eng.complete_all()
    tm.poll()
    tm.finish("P")
    f = Request("F", letters("f" * 32))
    tm.admit(f, 32)
    tm.finish("F")
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = tm.admit(q, 13)
    eng.fail(res.plan.plan_id)
    tm.poll()
    assert tm.state("Q") is RequestState.PREEMPTED and q.num_computed_tokens == 0
    assert gq(tm)[:4] == ["1", "2", "3", "8"] or tm.gpu_pool.get_num_free_blocks() == 8
    tm.check_invariants()
    res = tm.admit(q, 13)  # the CPU copy is still there: onboard again
    assert res.num_cpu_hit_tokens == 12
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.is_runnable("Q")


def test_completing_twice_or_a_forged_plan_is_refused_and_changes_nothing():
    tm, eng, kv = setup()
    compute_run(tm, kv, "A", "AAAABBBBCC")
    tm.preempt_request("A", "swap")
    (plan,) = tm.plans_in_flight()
    forged = TransferPlan(plan.plan_id, "GPU", "CPU", (1, 2), (1, 2), plan.kind, "A")
    fake = TransferHandle(forged)
    fake._finish(fake.status.DONE)
    before = tm_snapshot(tm)
    with pytest.raises(PlanError, match="does not match the plan emitted for request 'A'"):
        tm.process_completion(fake)
    assert tm_snapshot(tm) == before
    handle = tm.handle(plan.plan_id)
    with pytest.raises(PlanError, match="not finished yet"):
        tm.process_completion(handle)
    eng.complete(plan.plan_id)
    tm.poll()
    before = tm_snapshot(tm)
    with pytest.raises(PlanError, match="not in flight"):
        tm.process_completion(handle)
    assert tm_snapshot(tm) == before


def test_on_evict_never_hands_out_a_block_a_copy_still_reads():
    """The wrong-KV bug: a growing request computed at once must not overwrite a block being saved.

    P's cached blocks reach the front of the GPU free queue and are saved to the
    CPU by a slow copy.  A running request then grows and is computed in the
    same step, as any scheduler does after a successful ``allocate``.  The
    blocks it gets must not be the ones the copy is reading, so the CPU tier
    ends up holding P's KV under P's hashes, and a request that onboards P's
    prefix later reads P's tokens.
    """
    tm, eng, kv = setup(gpu=7, offload="on_evict", evict_window=2)
    p = compute_run(tm, kv, "P", "AAAABBBBC")  # [1 2 3]
    kv.learn(p, 4)
    tm.finish("P")
    assert gq(tm) == ["3", "4", "5", "6", "2*", "1*"]
    b = compute_run(tm, kv, "B", "YYYYZ")  # [3 4]
    tm.poll()  # on-evict: the window [5 6] holds no cached block; nothing to save
    assert tm.plans_in_flight() == []
    # B grows by 11 tokens: 2 more blocks, 5 and 6.  Then P's 2* and 1* are at the front.
    b.append_output_token_ids(letters("ZZZZZZZZZZZ"))
    assert tm.allocate("B", 11) is not None and tm.gpu_block_ids("B") == [3, 4, 5, 6]
    kv.compute(tm, "B", 16)
    b.num_computed_tokens = 16
    tm.poll()
    (save,) = tm.plans_in_flight()
    assert save.kind is PlanKind.OFFLOAD and save.src_block_ids == (2, 1)  # in eviction order
    assert tm.blocks_freed_on_completion() == 2
    # C arrives while the save is still copying.  It gets no block the copy reads: there is none free.
    c = Request("C", letters("WWWW"))
    assert tm.admit(c, 4) is None
    # The copy lands; the saved blocks are free again where they were, and C takes one of them now.
    eng.complete(save.plan_id)
    tm.poll()
    assert gq(tm)[:2] == ["2*", "1*"]
    res = tm.admit(c, 4)
    assert res is not None and res.runnable and tm.gpu_block_ids("C") == [2]
    kv.compute(tm, "C", 4)  # overwrites block 2 on the GPU: its old contents are safe on the CPU
    c.num_computed_tokens = 4
    kv.check_cached(tm)
    # A later request with P's prefix onboards it from the CPU and gets P's tokens.
    q = Request("Q", letters("AAAABBBBQ"))
    tm.finish("B")
    res = tm.admit(q, 9)
    assert (res.num_gpu_hit_tokens, res.num_cpu_hit_tokens) == (4, 4)  # AAAA still on the GPU, BBBB from the CPU
    eng.complete_all()
    tm.poll()
    onboarded = [kv.store["GPU"][i] for i in tm.gpu_block_ids("Q")[:2]]
    assert onboarded == [tuple(letters("AAAA")), tuple(letters("BBBB"))]
    tm.check_invariants()


def test_a_request_computed_right_after_allocate_never_corrupts_the_cpu_tier():
    """Randomised on-evict churn, computing every successful allocation at once (the scheduler's way)."""
    import random

    rng = random.Random(7)
    tm, eng, kv = setup(gpu=9, cpu=12, offload="on_evict", evict_window=3)
    live: dict[str, Request] = {}
    for step in range(400):
        tm.poll()
        action = rng.random()
        if action < 0.3 or not live:
            rid = f"r{step}"
            text = rng.choice(["AAAABBBB", "CCCCDDDD", "AAAACCCC", ""]) + "".join(rng.choice("xyz") for _ in range(3))
            req = Request(rid, letters(text))
            res = tm.admit(req, req.num_tokens)
            if res is None:
                continue
            if res.plan is not None:  # onboarding CPU hits: the request runs once they land
                eng.complete(res.plan.plan_id)
                tm.poll()
                if not tm.is_runnable(rid):
                    tm.finish(rid)
                    continue
                assert tm.allocate(rid, req.num_tokens - req.num_computed_tokens) is not None
            kv.compute(tm, rid, req.num_tokens)  # computed at once, as after any successful allocation
            req.num_computed_tokens = req.num_tokens
            kv.learn(req, 4)
            live[rid] = req
        elif action < 0.7:
            rid = rng.choice(sorted(live))
            req = live[rid]
            req.append_output_token_ids(letters(rng.choice("xyz") * rng.randint(1, 5)))
            n = req.num_tokens - req.num_computed_tokens
            if tm.allocate(rid, n) is None:
                del req.all_token_ids[req.num_computed_tokens :]
            else:
                kv.compute(tm, rid, req.num_tokens)
                req.num_computed_tokens = req.num_tokens
                kv.learn(req, 4)
        elif action < 0.85:
            tm.finish(live.pop(rng.choice(sorted(live))).request_id)
        elif eng.pending_ids():
            eng.complete(rng.choice(eng.pending_ids()))
        kv.check_cached(tm)
    eng.complete_all()
    tm.poll()
    kv.check_cached(tm)
    assert tm.metrics().counters.offload_blocks > 0
