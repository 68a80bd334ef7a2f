"""vLLM 0.33's rules in the scheduler: priority preemption, the full-prompt gate, no-chunk admission, the watermark.

The expected steps of the priority cases are vLLM 0.33.0's own, from the same streams in
``tests/test_integration_vllm_sched_diff.py`` (which replays them through vLLM's real scheduler);
here they run in the default environment, without vLLM.
"""

from __future__ import annotations

import pytest
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager import CostModel, ManagerConfig, PreemptMode, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

R, S = PreemptMode.RECOMPUTE, PreemptMode.SWAP


def make(gpu: int, cpu: int = 0, watermark: float = 0.0, **cfg) -> tuple[Scheduler, ControlledCopyEngine]:
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)})
    cm = CostModel(kv_bytes_per_token=8, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    tm = TierManager(ManagerConfig(gpu, cpu, 4, watermark=watermark), eng, cost_model=cm)
    return Scheduler(tm, SchedulerConfig(**cfg)), eng


def drive(s: Scheduler, eng: ControlledCopyEngine, arrivals: dict[int, list[Request]], steps: int = 100) -> list:
    """Add each step's arrivals, schedule, sample token 1; one (batch, preempted, admitted, resumed) per step."""
    log = []
    for step in range(steps):
        for req in arrivals.get(step, []):
            s.add_request(req)
        eng.complete_all()
        out = s.schedule()
        batch = [(r.request_id, n) for r, n in out.scheduled]
        assert out.num_tokens == sum(n for _, n in batch)
        log.append((batch, out.preempted, out.admitted, out.resumed))
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
        s.check_consistency()
        s.tm.check_invariants()
        if not s.num_unfinished and step >= max(arrivals):
            return log
    raise AssertionError("did not finish")


def req(rid: str, n: int, max_tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, letters((rid.lower() * n)[:n]), max_tokens=max_tokens, priority=priority, arrival_time=arrival)


def test_priority_preempts_the_least_important_even_when_it_was_scheduled_this_step():
    # 6 usable blocks.  In step 2, r0 (priority 3) is scheduled first (its token fits a block it
    # holds); then r1 (priority 0) needs a 4th block.  r0 is taken out of the batch and preempted.
    s, eng = make(7, mode="recompute", policy="priority")
    log = drive(s, eng, {0: [req("a", 9, 12, priority=3)], 1: [req("b", 12, 8, priority=0, arrival=1.0)]})
    assert log[1][0] == [("a", 1), ("b", 12)]
    assert log[2][:2] == ([("b", 1)], [("a", R)])  # a's token went back to the budget
    assert [p for step in log for p in step[1]] == [("a", R)]


def test_priority_the_requester_is_a_candidate_and_the_more_important_after_it_still_run():
    # 9 usable blocks.  Step 5: c (priority 0) needs a block and b (priority 5), scheduled
    # already, goes.  Step 12: a (priority 1) needs a block and is itself the least important: it
    # preempts itself, and c, after it in the queue, still runs.
    s, eng = make(10, mode="recompute", policy="priority")
    arrivals = {
        0: [req("a", 9, 14, priority=1)],
        1: [req("b", 8, 14, priority=5, arrival=1.0)],
        2: [req("c", 6, 14, priority=0, arrival=2.0)],
    }
    log = drive(s, eng, arrivals)
    assert log[5][:2] == ([("a", 1), ("c", 1)], [("b", R)])
    assert log[12][:2] == ([("c", 1)], [("a", R)])
    assert [p for step in log for p in step[1]] == [("b", R), ("a", R), ("b", R)]


def test_priority_ties_go_by_place_in_the_running_queue_and_are_served_by_request_id():
    s, eng = make(13, mode="recompute", policy="priority", max_num_batched_tokens=16)
    log = drive(s, eng, {0: [req(rid, n, 12) for rid, n in (("r3", 9), ("r1", 7), ("r2", 8), ("r4", 10))]})
    assert [rid for rid, _ in log[0][0]] == ["r1", "r2", "r3"]  # served by id, not in the order added
    assert log[5][1] == [("r1", R)] and log[9][1] == [("r2", R)]  # the first of the equals in the queue


def test_the_full_prompt_gate_waits_for_room_for_the_whole_prompt():
    # 6 usable blocks, 8 tokens a step.  A (8 tokens, grows to 17: 5 blocks) runs; B's 20-token
    # prompt needs 5 blocks whole.  Gated (vLLM 0.33's default), B waits until A finishes instead
    # of starting its first chunk and being preempted for A mid-prefill.
    a, b = req("A", 8, 9), req("B", 20, 1)
    s, eng = make(7, mode="recompute", max_num_batched_tokens=8)
    log = drive(s, eng, {0: [a, b]})
    assert log[0][:3] == ([("A", 8)], [], ["A"])
    assert all(step[0] == [("A", 1)] for step in log[1:9])
    assert log[9][:3] == ([("B", 8)], [], ["B"])  # A finished in step 8: B's whole prompt fits now
    assert [step[0] for step in log[10:]] == [[("B", 8)], [("B", 4)]]
    assert not any(step[1] for step in log)


def test_without_chunking_a_prompt_is_admitted_when_what_its_hits_leave_fits_the_step():
    # 16 tokens a step.  In step 1, C takes 14 and leaves 2; B's 14-token prompt shares A's first
    # 12 (3 cached blocks), so only 2 are left to compute: they fit, and B is admitted in the same
    # step (vLLM compares the budget with the tokens left after the hits, not the whole prompt).
    s, eng = make(20, mode="recompute", max_num_batched_tokens=16, chunked_prefill=False)
    a = Request("A", letters("aaaabbbbcccc"), max_tokens=1)
    b = Request("B", letters("aaaabbbbccccdd"), max_tokens=1)
    c = Request("C", letters("xxxxyyyyzzzzww"), max_tokens=1)
    log = drive(s, eng, {0: [a], 1: [c, b]})
    assert log[0][0] == [("A", 12)]
    assert log[1][0] == [("C", 14), ("B", 2)]


def test_the_watermark_holds_back_a_swapped_request_while_others_run():
    # 12 usable blocks, four 8-token prompts; D and C are swapped out; at step 14 A has finished
    # and B runs.  D needs 4 blocks (its KV and its next token) and 7 are free: it resumes at once
    # with no watermark, and with int(0.35 * 13) = 4 blocks of watermark (4 + 4 > 7) only when B
    # has finished too.
    def run(watermark):
        s, eng = make(13, cpu=40, watermark=watermark, mode="swap")
        lengths = zip("ABCD", (12, 20, 12, 12), strict=True)
        reqs = [req(rid, 8, m, arrival=float(i)) for i, (rid, m) in enumerate(lengths)]
        return drive(s, eng, {0: reqs, 6: [req("E", 4, 3, arrival=6.0)]})

    plain, kept = run(0.0), run(0.35)
    assert [p for step in plain for p in step[1]] == [("D", S), ("C", S)]
    assert plain[14][3] == ["D"] and plain[14][0] == [("B", 1)]
    assert [i for i, step in enumerate(kept) if step[3]] == [22]
    assert kept[21][0] == [("B", 1)] and kept[22][3] == ["D", "C"]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_bad_gate_setting_is_refused(value):
    with pytest.raises(InvalidArgumentError, match="scheduler_reserve_full_isl must be True or False"):
        SchedulerConfig(scheduler_reserve_full_isl=value)
    assert SchedulerConfig().scheduler_reserve_full_isl is True  # vLLM 0.33's default
