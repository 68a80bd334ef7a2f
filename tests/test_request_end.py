"""Every way a request ends closes its request in the CPU store, exactly once.

The tier manager opens a request in the CPU store when it admits it (vLLM 0.33's
request scope) and keeps it open across preemptions (a re-admitted request is
the same request).  Whatever became of its KV when it ends (finished on the GPU,
aborted on the CPU, mid-copy, or gone already: a recompute victim waiting to be
admitted again, a failed or cancelled onboarding, a dropped swap), the store must
learn that it finished, once: otherwise the store holds its record forever and
its policy never commits the request's uses.

Each case drives a scheduler (or the manager alone) into one state, ends the
request there and checks, through the public API: no request is left open in
the store, ``on_request_finished`` ran once per request, and the policy ranks
the ended request's stored blocks as finished (LRU: position 0).
"""

from __future__ import annotations

import pytest
from mgrutil import make_tm, run, settle
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, UnknownRequestError
from tiered_kv.manager import CostModel, ManagerConfig, PreemptMode, Residency, TierManager
from tiered_kv.sched import RequestStatus, Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

St = RequestStatus
CM = CostModel(kv_bytes_per_token=8, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)


class Run:
    """A scheduler over a 5-block GPU pool and a write-through CPU store; A and B, 6-token prompts.

    Both grow a third block at their 9th token and do not fit together: B, the
    last admitted, is preempted at step 3 (by swap: SWAPPING_OUT at step 3,
    SWAPPED from step 4, SWAPPING_IN when A has finished; by recompute: WAITING).
    """

    def __init__(self, mode: str, gpu: int = 6) -> None:
        self.eng = ControlledCopyEngine({"GPU": gpu, "CPU": 16})
        self.tm = TierManager(ManagerConfig(gpu, 16, 4, offload="write_through"), self.eng, cost_model=CM)
        self.s = Scheduler(self.tm, SchedulerConfig(mode=mode))
        self.finished: list = []  # every on_request_finished the store received, in order
        close = self.tm.store.on_request_finished

        def spy(ctx):
            self.finished.append(ctx.req_id)
            close(ctx)

        self.tm.store.on_request_finished = spy
        self.reqs = {rid: Request(rid, list(range(b, b + 6)), max_tokens=10) for rid, b in (("A", 1), ("B", 11))}
        for r in self.reqs.values():
            self.s.add_request(r)

    def step(self, complete: bool = True) -> None:
        if complete:
            self.eng.complete_all()
        out = self.s.schedule()
        self.s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
        self.s.check_consistency()
        self.tm.check_invariants()

    def until(self, rid: str, status: RequestStatus, residency: Residency | None) -> None:
        for _ in range(40):
            self.step()
            if self.s.status.get(rid) is status and self.tm.state(rid).residency is residency:
                return
        raise AssertionError(f"{rid} never became {status.value} with its KV {residency}")

    def to_the_end(self) -> None:
        for _ in range(60):
            if not self.s.num_unfinished:
                break
            self.step()
        self.eng.complete_all()
        self.s.drain()
        assert not self.s.num_unfinished and not self.tm.requests()

    def assert_closed_once(self, *rids: str) -> None:
        store = self.tm.store
        assert store.open_requests() == []
        assert sorted(self.finished) == sorted(rids), self.finished  # each ended request once, and only they
        for rid in rids:
            assert not self.tm.is_open(rid)
            stored = [k for k in self.reqs[rid].block_hashes if store.contains(k)]
            assert stored, f"{rid} stored no block: the policy's view of it cannot be checked"
            assert [store.policy.rank(k)[1] for k in stored] == [0] * len(stored), "not committed as finished"


def test_a_request_that_finishes_closes_its_store_request_once():
    r = Run("swap")
    r.to_the_end()
    r.assert_closed_once("A", "B")


@pytest.mark.parametrize(
    ("mode", "status", "residency"),
    [
        ("swap", St.RUNNING, Residency.GPU),
        ("swap", St.SWAPPED, Residency.SWAPPING_OUT),
        ("swap", St.SWAPPED, Residency.CPU),
        ("swap", St.ARRIVING, Residency.SWAPPING_IN),
        ("recompute", St.WAITING, None),  # a recompute victim: the manager holds nothing, the store request is open
    ],
)
def test_aborting_a_request_in_any_state_closes_its_store_request_once(mode, status, residency):
    r = Run(mode)
    r.until("B", status, residency)
    assert r.tm.is_open("B") and (r.tm.residency("B") if r.tm.holds("B") else None) is residency
    running = [rid for rid in ("A", "B") if rid in r.s.requests]  # A has finished before B swaps in
    assert r.tm.store.open_requests() == running
    r.s.abort("B")
    assert r.tm.store.open_requests() == running[:-1] and not r.tm.is_open("B")
    r.to_the_end()
    r.assert_closed_once("A", "B")


def test_the_reported_leak_an_aborted_recompute_victim_leaves_nothing_open():
    """The reproducer: b is preempted by recompute on the second step, aborted, and a finishes."""
    tm = TierManager(
        ManagerConfig(5, 8, 2), ControlledCopyEngine(), cost_model=CostModel(kv_bytes_per_token=8, block_size=2)
    )
    s = Scheduler(tm, SchedulerConfig(mode="recompute"))
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=3))
    s.add_request(Request("b", [5, 6, 7, 8], max_tokens=3))
    out = s.schedule()
    s.update(out, {"a": 9, "b": 9})
    out = s.schedule()
    assert out.preempted == [("b", PreemptMode.RECOMPUTE)] and s.status["b"] is St.WAITING
    s.abort("b")
    s.update(out, {"a": 9})
    while s.num_unfinished:
        out = s.schedule()
        s.update(out, {r.request_id: 9 for r, n in out.scheduled if out.needs_sample(r, n)})
    assert (tm.store.open_requests(), tm.requests(), s.num_unfinished) == ([], [], 0)


def _loading(mode: str = "swap") -> tuple[Run, Request]:
    """A finishes and its prompt stays on the CPU only; C, with A's prompt, is admitted and loads it."""
    r = Run(mode, gpu=9)
    r.s.abort("B")
    r.to_the_end()
    assert r.tm.gpu.reset_prefix_cache()  # the GPU forgets: C's prefix comes from the CPU store
    r.finished.clear()
    c = r.reqs["C"] = Request("C", [*range(1, 7), 99], max_tokens=4)
    r.s.add_request(c)
    r.step()
    assert r.s.status["C"] is St.ARRIVING and r.tm.state("C").residency is Residency.LOADING
    assert r.tm.store.open_requests() == ["C"]
    return r, c


def test_a_cancelled_onboarding_closes_its_store_request_once():
    r, _ = _loading()
    r.s.abort("C")  # the copy is cancelled: the manager holds nothing of C any more
    assert not r.tm.holds("C") and r.tm.store.open_requests() == []
    r.to_the_end()
    r.assert_closed_once("C")


def test_a_failed_onboarding_then_an_abort_closes_its_store_request_once():
    r, _ = _loading()
    (plan_id,) = r.eng.pending_ids()
    r.eng.fail(plan_id)
    r.step(complete=False)  # the failed load settles, C goes back to waiting and is admitted again: a new load
    assert r.s.status["C"] is St.ARRIVING and r.tm.state("C").residency is Residency.LOADING
    assert r.eng.pending_ids() != [plan_id]
    assert r.tm.store.open_requests() == ["C"]  # the same store request throughout
    r.s.abort("C")
    r.to_the_end()
    r.assert_closed_once("C")


def test_the_manager_alone_ends_a_failed_onboarding_with_free():
    tm, eng = make_tm(gpu=13, cpu=21, offload="write_through")
    run(tm, "a", "AAAABBBBC")
    settle(tm, eng)
    tm.free("a")
    assert tm.gpu.reset_prefix_cache()
    req = Request("c", letters("AAAABBBBq"))
    assert tm.admit(req, req.num_tokens).plan is not None  # its prefix loads from the CPU store
    (plan_id,) = eng.pending_ids()
    eng.fail(plan_id)
    (c,) = tm.poll()
    assert (c.ok, c.residency, tm.holds("c"), tm.is_open("c")) == (False, None, False, True)
    tm.free("c")
    assert tm.store.open_requests() == [] and not tm.is_open("c")


def test_a_failed_onboarding_readmitted_and_finished_closes_its_store_request_once():
    r, _ = _loading()
    (plan_id,) = r.eng.pending_ids()
    r.eng.fail(plan_id)
    r.to_the_end()  # re-admitted as the same store request, computed, finished
    r.assert_closed_once("C")


def test_the_manager_alone_ends_a_recompute_victim_and_a_dropped_swap_with_free():
    tm, eng = make_tm(gpu=13, cpu=21, offload="write_through")
    finished = []
    close = tm.store.on_request_finished
    tm.store.on_request_finished = lambda ctx: (finished.append(ctx.req_id), close(ctx))
    run(tm, "rec", "AAAABBBBC")
    run(tm, "swp", "XXXXYYYYZ")
    settle(tm, eng)
    assert tm.preempt("rec", "recompute").residency is None
    assert tm.preempt("swp", "swap") is not None
    settle(tm, eng)
    tm.drop_swapped("swp")
    # Neither has KV here any more, and neither request has ended: both stay open in the store.
    assert (tm.requests(), tm.store.open_requests()) == ([], ["rec", "swp"])
    assert [(tm.holds(r), tm.is_open(r)) for r in ("rec", "swp")] == [(False, True), (False, True)]
    tm.free("rec")
    tm.free("swp")
    assert (tm.store.open_requests(), finished) == ([], ["rec", "swp"])
    assert not tm.is_open("rec")
    with pytest.raises(UnknownRequestError, match=r"'rec' is not held .* freed already"):
        tm.free("rec")  # ended once: a second end is refused, and the store is not told again
    assert finished == ["rec", "swp"]
    tm.check_invariants()


def test_readmission_after_a_recompute_preemption_is_the_same_store_request():
    tm, eng = make_tm(gpu=13, cpu=21, offload="write_through")
    req = run(tm, "a", "AAAABBBBC")
    settle(tm, eng)
    tm.preempt("a", "recompute")
    req.num_computed_tokens = 0  # the scheduler's part: a recompute victim starts over
    assert tm.admit(req, req.num_tokens) is not None
    assert tm.store.open_requests() == ["a"]  # still the one request, not a second one
    tm.free("a")
    assert tm.store.open_requests() == [] and not tm.is_open("a")


def test_without_a_cpu_tier_a_request_is_open_until_freed_all_the_same():
    """One rule with or without a CPU tier: an admitted request stays open, its KV gone or not, until freed."""
    tm, _ = make_tm(gpu=13, cpu=0)
    run(tm, "a", "AAAABBBBC")
    tm.preempt("a", "recompute")
    assert (tm.holds("a"), tm.is_open("a")) == (False, True)
    tm.free("a")
    assert tm.is_open("a") is False
    with pytest.raises(UnknownRequestError):
        tm.free("a")


def test_is_open_refuses_an_unhashable_id():
    tm, _ = make_tm()
    with pytest.raises(InvalidArgumentError, match="request_id must be a hashable id"):
        tm.is_open(["a"])
