"""Faults with a test-controlled copy engine: nothing is lost, nothing reused while copied."""

import pytest
from fakekv import FakeKV
from mgrutil import cq, gq, make_tm, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError, PlanError
from tiered_kv.manager import RequestState
from tiered_kv.transfer import TransferHandle, TransferPlan


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


def test_swap_in_into_an_evicted_block_waits_for_its_offload():
    tm, eng, kv = setup(gpu=5, offload="on_evict")
    p = compute_run(tm, kv, "P", "AAAABBBBC")  # [1 2 3]
    tm.finish("P")
    assert gq(tm) == ["3", "4", "2*", "1*"]
    a = Request("A", letters("XXXXYYYYZ"))
    res = tm.admit(a, 9)  # takes 3 4 2: block 2 (P's AAAABBBB) is offloaded first
    (o1,) = tm.plans_in_flight()
    assert o1.src_block_ids == (2,) and not res.runnable
    eng.complete(o1.plan_id)
    tm.poll()
    assert tm.allocate("A", 9) == []  # the step that computes A: its full blocks get cached now
    kv.compute(tm, "A", 9)
    a.num_computed_tokens = 9
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    assert gq(tm) == ["2", "1*", "4*", "3*"]
    f = Request("F", letters("ffff"))
    tm.admit(f, 4)  # takes 2
    res = tm.resume("A")  # 3 and 4 re-hit; the partial block lands in block 1, evicting P's AAAA
    o2, s2 = sorted(tm.plans_in_flight(), key=lambda x: x.plan_id)
    assert (o2.kind.value, o2.src_block_ids) == ("offload", (1,))
    assert (s2.kind.value, s2.dst_block_ids, s2.wait_for) == ("swap_in", (1,), (o2.plan_id,))
    with pytest.raises(PlanError, match=f"must wait for plan\\(s\\) \\[{o2.plan_id}\\]"):
        eng.complete(s2.plan_id)
    eng.complete(o2.plan_id)
    eng.complete(s2.plan_id)
    tm.poll()
    assert tm.is_runnable("A") and tm.gpu_block_ids("A") == [3, 4, 1]
    kv.check(tm)
    cpu_copy = tm.cpu_pool.get_cached_block(p.block_hashes[0])
    assert kv.store["CPU"][cpu_copy.block_id] == tuple(letters("AAAA"))  # the old contents were saved first
    tm.check_invariants()
