"""A request batched in this step is no victim: ``preempt`` refuses it, naming the rule, and changes nothing.

A loop of one's own that preempted a request it had already batched used to
succeed, and the step then failed at ``on_tokens_computed`` ("request 0 is
swapping_out, not gpu"), or computed into blocks handed to someone else.  The
rule, as ``TierManager.preempt`` states it: once ``admit`` or ``allocate`` gave a
request blocks for the step's tokens, it is no victim until its step is
computed (its progress reaches those tokens, or ``on_tokens_computed``), the
step ends (``poll``, ``on_schedule_end``), or the loop takes it out of the batch
(``unschedule``, as vLLM's priority scheduling un-schedules a victim).
"""

from __future__ import annotations

import pytest
from mgrutil import make_tm, run, settle, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError, UnknownRequestError
from tiered_kv.manager import PreemptMode, Residency

RULE = r"request 'a' was batched in this step .* a request batched in this step is no victim"


def two_running():
    """a and b computed their prompts in an earlier step; this step's poll has run."""
    tm, eng = make_tm(gpu=9, cpu=9)
    a, b = run(tm, "a", "abcdef"), run(tm, "b", "ghijkl")
    settle(tm, eng)
    for r in (a, b):
        r.append_output_token_ids(letters("z"))
    return tm, eng, a, b


def test_preempting_a_request_allocated_this_step_is_refused_and_changes_nothing():
    tm, eng, a, _ = two_running()
    assert tm.allocate("a", 1) == []  # a is in this step's batch
    before = tm_snapshot(tm)
    with pytest.raises(InvalidTransitionError, match=RULE + r".*unschedule"):
        tm.preempt("a", "swap")
    assert tm_snapshot(tm) == before and eng.pending_ids() == []
    # The loop goes on as if nothing happened: a computes its step, and the step is reported.
    a.num_computed_tokens += 1
    assert tm.on_tokens_computed("a") is None and tm.residency("a") is Residency.GPU
    tm.check_invariants()


def test_the_loop_of_the_report_now_fails_at_preempt_instead_of_at_on_tokens_computed():
    """A loop that batches 0, then picks 0 (not the last of its running queue) as the victim for 1."""
    tm, eng = make_tm(gpu=6, cpu=9)  # 5 usable blocks: two 6-token prompts take 2 each
    reqs = [Request(i, letters(t), max_tokens=8) for i, t in enumerate(("abcdef", "ghijkl"))]
    for r in reqs:
        res = tm.admit(r, r.num_tokens)
        r.num_computed_tokens = res.num_computed_tokens + res.num_new_tokens
        tm.on_tokens_computed(r.request_id)
        r.append_output_token_ids(letters("z"))

    def compute(batch):
        for r in batch:
            r.num_computed_tokens += 1
            tm.on_tokens_computed(r.request_id)
            r.append_output_token_ids(letters("z"))

    for _ in range(2):  # the 7th and 8th tokens land in the second blocks
        tm.poll()
        assert [tm.allocate(r.request_id, 1) for r in reqs] == [[], []]
        compute(reqs)
    tm.poll()
    assert tm.allocate(0, 1) is not None and tm.allocate(1, 1) is None  # the 9th: one block left, for 0
    before = tm_snapshot(tm)
    with pytest.raises(InvalidTransitionError, match="request 0 was batched in this step"):
        tm.preempt(0, "auto")  # the loop's mistake; it used to fail later, at on_tokens_computed(0)
    assert tm_snapshot(tm) == before
    assert tm.preempt(1, "auto") is not None  # 1 preempts itself instead (vLLM's rule): allowed
    compute(reqs[:1])  # 0's step completes as the loop planned it
    assert tm.residency(0) is Residency.GPU and tm.gpu_table_length(0) == 3
    settle(tm, eng)
    tm.check_invariants()


def test_a_request_admitted_this_step_is_no_victim_either():
    tm, _ = make_tm(gpu=9, cpu=9)
    req = Request("a", letters("abcdef"))
    tm.admit(req, req.num_tokens)
    before = tm_snapshot(tm)
    with pytest.raises(InvalidTransitionError, match=RULE):
        tm.preempt("a", "recompute")
    assert tm_snapshot(tm) == before


@pytest.mark.parametrize(
    "end_of_batch",
    [
        pytest.param(lambda tm, a: setattr(a, "num_computed_tokens", a.num_computed_tokens + 1), id="computed"),
        pytest.param(lambda tm, a: tm.on_tokens_computed("a"), id="on_tokens_computed"),
        pytest.param(lambda tm, a: tm.poll(), id="poll"),
        pytest.param(lambda tm, a: tm.on_schedule_end([], []), id="on_schedule_end"),
        pytest.param(lambda tm, a: tm.unschedule("a"), id="unschedule"),
    ],
)
def test_a_request_is_a_victim_again_once_its_step_is_computed_or_over_or_it_left_the_batch(end_of_batch):
    tm, eng, a, _ = two_running()
    tm.allocate("a", 1)
    end_of_batch(tm, a)
    p = tm.preempt("a", "swap")
    assert p is not None and p.mode is PreemptMode.SWAP
    settle(tm, eng)
    assert tm.residency("a") is Residency.CPU
    tm.check_invariants()


def test_a_failed_allocation_batches_nothing():
    tm, _ = make_tm(gpu=4, cpu=9)
    run(tm, "a", "abcdefgh")  # 2 of the 3 usable blocks
    tm.poll()
    assert tm.allocate("a", 8) is None  # does not fit: nothing changed, nothing batched
    assert tm.preempt("a", "recompute") is not None


def test_unschedule_of_a_request_not_held_is_refused():
    tm, _ = make_tm()
    with pytest.raises(UnknownRequestError):
        tm.unschedule("nobody")
