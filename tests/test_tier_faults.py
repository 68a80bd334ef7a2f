"""Faults with a test-controlled copy engine: nothing is lost, nothing reused while copied."""

import random

import pytest
from fakekv import FakeKV
from mgrutil import cq, gq, make_tm, settle, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError, PlanError
from tiered_kv.manager import Residency
from tiered_kv.transfer import PlanKind, TransferHandle, TransferPlan


class World:
    """A manager, a controlled engine moving fake KV, and the requests (the scheduler's part)."""

    def __init__(self, **kw) -> None:
        self.tm, self.eng = make_tm(**kw)
        self.kv = FakeKV()
        self.eng.on_complete = self.kv.copy
        self.reqs: dict[str, Request] = {}

    def run(self, rid: str, text: str) -> Request:
        req = Request(rid, letters(text))
        res = self.tm.admit(req, req.num_tokens)
        assert res.runnable and res.num_computed_tokens + res.num_new_tokens == req.num_tokens
        req.num_computed_tokens = res.num_computed_tokens
        self.kv.compute(self.tm, req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        self.kv.learn(req, self.tm.block_size)
        self.tm.on_tokens_computed(rid)
        self.reqs[rid] = req
        return req

    def check(self) -> None:
        self.kv.check(self.tm, self.reqs)
        self.tm.check_invariants()


def test_failed_swap_out_leaves_request_whole_on_gpu():
    w = World()
    tm, eng = w.tm, w.eng
    w.run("A", "AAAABBBBCC")
    tm.preempt("A", "swap")
    (plan,) = tm.plans_in_flight()
    eng.fail(plan.plan_id)
    (c,) = tm.poll()
    assert not c.ok and c.residency is Residency.GPU and tm.residency("A") is Residency.GPU
    assert tm.gpu_block_ids("A") == [1, 2, 3] and cq(tm) == []  # the reserved slots went back
    assert tm.metrics().counters.plans_failed == 1
    w.check()
    # Still preemptable, by either mode.
    tm.preempt("A", "swap")
    settle(tm, eng)
    assert tm.residency("A") is Residency.CPU
    w.check()


def test_cancelled_swap_out_rolls_back():
    w = World()
    w.run("A", "AAAABBBBCC")
    w.tm.preempt("A", "swap")
    assert w.tm.cancel("A") is True
    assert w.tm.residency("A") is Residency.GPU and w.tm.plans_in_flight() == []
    assert w.tm.metrics().counters.plans_cancelled == 1 and w.eng.pending_ids() == []
    w.check()


def test_delayed_swap_out_keeps_gpu_blocks_from_reuse():
    w = World(gpu=5)
    tm = w.tm
    w.run("A", "AAAABBBBCC")  # 3 of 4 usable blocks
    tm.preempt("A", "swap")
    big = Request("B", letters("x" * 9))
    assert tm.admit(big, 9) is None  # A's blocks are still being read
    assert tm.residency("A") is Residency.SWAPPING_OUT
    with pytest.raises(InvalidTransitionError, match="plan 1 in flight"):
        tm.free("A")
    settle(tm, w.eng)
    assert tm.admit(big, 9) is not None
    w.reqs["B"] = big
    w.check()


def test_reordered_completions_settle_each_plan_correctly():
    w = World(gpu=11, cpu=17)
    tm, eng = w.tm, w.eng
    w.run("A", "AAAABBBBC")
    w.run("B", "XXXXYYYYZ")
    tm.preempt("A", "swap")
    tm.preempt("B", "swap")
    pa, pb = eng.pending_ids()
    eng.complete(pb)
    tm.poll()
    assert tm.residency("B") is Residency.CPU and tm.residency("A") is Residency.SWAPPING_OUT
    eng.complete(pa)
    tm.poll()
    assert tm.residency("A") is Residency.CPU
    w.check()
    run_gpu = Request("F", letters("f" * 40))  # every GPU block: both prefixes leave the GPU
    assert tm.admit(run_gpu, 40) is not None
    tm.free("F")
    ra, rb = tm.resume("A"), tm.resume("B")
    eng.complete_in_order([rb.plan.plan_id, ra.plan.plan_id])
    done = tm.poll()
    assert [c.request_id for c in done] == ["A", "B"]  # settled in plan order, whatever order they landed in
    assert tm.residency("A") is Residency.GPU and tm.residency("B") is Residency.GPU
    w.check()


def test_failed_swap_in_keeps_the_cpu_copy_and_can_be_retried():
    w = World()
    tm, eng = w.tm, w.eng
    a = w.run("A", "AAAABBBBCC")
    tm.preempt("A", "swap")
    settle(tm, eng)
    f = Request("F", letters("f" * 32))
    tm.admit(f, 32)  # evict A's cached blocks
    tm.free("F")
    res = tm.resume("A")
    eng.fail(res.plan.plan_id)
    (c,) = tm.poll()
    assert not c.ok and tm.residency("A") is Residency.CPU and tm.cpu_block_ids("A") == [1, 2, 3]
    assert tm.gpu.block_pool.get_cached_block(a.block_hashes[0]) is None  # the failed copy was never cached
    assert cq(tm) == ["1@1", "2@1", "3@1"]  # still pinned
    w.check()
    res = tm.resume("A")
    eng.complete(res.plan.plan_id)
    (c,) = tm.poll()
    assert c.ok and c.num_tokens == 10 and tm.residency("A") is Residency.GPU
    w.check()


def test_failed_onboard_leaves_the_request_with_nothing_and_it_can_be_admitted_again():
    w = World(offload="write_through")
    tm, eng = w.tm, w.eng
    w.run("P", "AAAABBBBCCCCD")
    settle(tm, eng)
    tm.free("P")
    f = Request("F", letters("f" * 32))
    tm.admit(f, 32)
    tm.free("F")
    q = Request("Q", letters("AAAABBBBCCCCX"))
    res = tm.admit(q, 13)
    eng.fail(res.plan.plan_id)
    (c,) = tm.poll()
    assert not c.ok and c.residency is None and not tm.holds("Q")  # recompute from scratch
    assert tm.num_free_gpu_blocks() == 8 and cq(tm) == ["3", "2", "1"]  # unpinned, still cached
    tm.check_invariants()
    res = tm.admit(q, 13)  # the CPU copy is still there: onboard again
    assert res.num_loading_tokens == 12
    eng.complete(res.plan.plan_id)
    tm.poll()
    assert tm.residency("Q") is Residency.GPU


def test_completing_twice_or_a_forged_plan_is_refused_and_changes_nothing():
    w = World()
    tm, eng = w.tm, w.eng
    w.run("A", "AAAABBBBCC")
    tm.preempt("A", "swap")
    (plan,) = tm.plans_in_flight()
    forged = TransferPlan(plan.plan_id, "GPU", "CPU", (1, 2), (1, 2), plan.kind, "A")
    fake = TransferHandle(forged)
    fake.finish(fake.status.DONE)
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


def test_write_back_offload_never_hands_out_a_block_a_copy_still_reads():
    """The wrong-KV bug: a growing request computed at once must not overwrite a block being saved.

    P's cached blocks reach the front of the GPU free queue and are saved to the
    CPU by a slow copy.  A running request grows and is computed in the same
    step, as any scheduler does after a successful ``allocate``.  The blocks it
    gets are not the ones the copy reads, so the CPU tier ends up holding P's
    KV under P's hashes, and a request that onboards P's prefix later reads
    P's tokens.
    """
    w = World(gpu=7, offload="write_back", evict_window=2)
    tm, eng, kv = w.tm, w.eng, w.kv
    w.run("P", "AAAABBBBC")  # [1 2 3]
    tm.free("P")
    assert gq(tm) == ["3", "4", "5", "6", "2*", "1*"]
    b = w.run("B", "YYYYZ")  # [3 4]
    tm.poll()  # on-evict: the window [5 6] holds no cached block; nothing to save
    assert tm.plans_in_flight() == []
    # B grows by 11 tokens: 2 more blocks, 5 and 6.  Then P's 2* and 1* are at the front.
    b.append_output_token_ids(letters("ZZZZZZZZZZZ"))
    assert tm.allocate("B", 11) is not None and tm.gpu_block_ids("B") == [3, 4, 5, 6]
    kv.compute(tm, b, 16)
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
    kv.compute(tm, c, 4)  # overwrites block 2 on the GPU: its old contents are safe on the CPU
    c.num_computed_tokens = 4
    kv.check_cached(tm)
    # A later request with P's prefix onboards it from the CPU and gets P's tokens.
    q = Request("Q", letters("AAAABBBBQ"))
    tm.free("B")
    res = tm.admit(q, 9)
    assert (res.num_computed_tokens, res.num_loading_tokens) == (4, 4)  # AAAA still on the GPU, BBBB from the CPU
    settle(tm, eng)
    onboarded = [kv.store["GPU"][i] for i in tm.gpu_block_ids("Q")[:2]]
    assert onboarded == [tuple(letters("AAAA")), tuple(letters("BBBB"))]
    tm.check_invariants()


def test_a_request_computed_right_after_allocate_never_corrupts_the_cpu_tier():
    """Randomised on-evict churn, computing every successful allocation at once (the scheduler's way)."""
    rng = random.Random(7)
    w = World(gpu=9, cpu=12, offload="write_back", evict_window=3)
    tm, eng, kv = w.tm, w.eng, w.kv
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
            req.num_computed_tokens = res.num_computed_tokens
            if res.plan is not None:  # onboarding CPU hits: the request runs once they land
                eng.complete(res.plan.plan_id)
                (c,) = [c for c in tm.poll() if c.request_id == rid]
                if not c.ok:
                    continue
                req.num_computed_tokens = c.num_tokens  # its progress now: GPU hits and the loaded prefix
                assert tm.allocate(rid, req.num_tokens - req.num_computed_tokens) is not None
            kv.compute(tm, req, req.num_tokens)  # computed at once, as after any successful allocation
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
                kv.compute(tm, req, req.num_tokens)
                req.num_computed_tokens = req.num_tokens
                kv.learn(req, 4)
        elif action < 0.85:
            tm.free(live.pop(rng.choice(sorted(live))).request_id)
        elif eng.pending_ids():
            eng.complete(rng.choice(eng.pending_ids()))
        kv.check_cached(tm)
    settle(tm, eng)
    kv.check_cached(tm)
    assert tm.metrics().counters.offload_blocks > 0
