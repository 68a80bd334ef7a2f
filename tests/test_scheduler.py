"""The scheduler layer: vLLM v1's order of things, exact victim sequences, progress ownership, misuse."""

from __future__ import annotations

import pytest
from engine_configs import engine_config
from fakekv import FakeKV
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, TieredKVError, UnknownRequestError
from tiered_kv.manager import CostModel, ManagerConfig, PreemptMode, Residency, TierManager
from tiered_kv.sched import RequestStatus, Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

R, S = PreemptMode.RECOMPUTE, PreemptMode.SWAP


def make(gpu=13, cpu=0, manager_class=TierManager, **cfg):
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)})
    cm = CostModel(kv_bytes_per_token=8, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    tm = manager_class(ManagerConfig(gpu, cpu, 4), eng, cost_model=cm)
    return Scheduler(tm, SchedulerConfig(**cfg)), eng


def drive(s, eng=None, steps=60):
    """Run to completion, sampling token 1 every time; return one (scheduled, preempted, admitted) per step."""
    log = []
    for _ in range(steps):
        if eng is not None:
            eng.complete_all()
        out = s.schedule()
        log.append(([(r.request_id, n) for r, n in out.scheduled], out.preempted, out.admitted))
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
        s.check_consistency()
        s.tm.check_invariants()
        if not s.num_unfinished:
            return log
    raise AssertionError("did not finish")


def four(s, priorities=(0, 0, 0, 0)):
    for i, rid in enumerate("ABCD"):
        s.add_request(
            Request(rid, [i * 10 + k for k in range(8)], max_tokens=12, arrival_time=float(i), priority=priorities[i])
        )


def test_fcfs_preempts_the_last_of_the_running_queue_as_vllm_does():
    # 12 usable blocks; four 8-token prompts grow one block every 4 tokens and meet at once.
    s, _ = make(mode="recompute")
    four(s)
    log = drive(s)
    assert log[0] == ([("A", 8), ("B", 8), ("C", 8), ("D", 8)], [], ["A", "B", "C", "D"])
    victims = [p for _, pre, _ in log for p in pre]
    assert victims == [("D", R), ("C", R)]  # A needed a block: the last of the queue went, then the next last
    assert log[5] == ([("A", 1), ("B", 1), ("C", 1)], [("D", R)], [])
    assert log[9] == ([("A", 1), ("B", 1)], [("C", R)], [])
    # Both come back when A and B finish, re-hitting their cached prompt blocks.
    assert log[12] == ([("C", 9), ("D", 13)], [], ["C", "D"])


def test_priority_scheduling_preempts_the_largest_priority_then_the_latest_arrival():
    s, _ = make(mode="recompute", policy="priority")
    four(s, priorities=(0, 0, 0, -1))  # D is the most important: it is never the one to go
    victims = [p for _, pre, _ in drive(s) for p in pre]
    assert victims == [("C", R), ("B", R)]


def test_swap_victims_keep_their_progress_and_resume_before_new_admissions():
    s, eng = make(cpu=40, mode="swap")
    four(s)
    e_added = False
    victims, swapped_while_e_waited = [], 0
    for _ in range(80):
        eng.complete_all()
        out = s.schedule()
        victims += out.preempted
        if e_added and "E" in s.requests and s.status["E"] is RequestStatus.WAITING and s.swapped:
            swapped_while_e_waited += 1
            assert "E" not in out.admitted  # nothing is admitted while a request is swapped out
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
        s.check_consistency()
        if victims and not e_added:
            s.add_request(Request("E", letters("eeee"), max_tokens=2, arrival_time=9.0))
            e_added = True
        if not s.num_unfinished:
            break
    assert not s.num_unfinished and swapped_while_e_waited > 0
    assert victims and all(mode is S for _, mode in victims)
    assert s.tm.metrics().counters.swap_out_blocks > 0 and s.tokens_recomputed == 0


def test_the_decode_rule_a_sampled_token_is_computed_in_the_next_step():
    s, _ = make()
    req = Request("A", letters("abcdef"), max_tokens=3)
    s.add_request(req)
    out = s.schedule()
    assert out.scheduled == [(req, 6)] and out.needs_sample(req, 6)
    s.update(out, {"A": 42})
    assert (req.num_computed_tokens, req.num_tokens, req.output_token_ids) == (6, 7, [42])  # 42 is not computed yet
    out = s.schedule()
    assert out.scheduled == [(req, 1)]  # ...this step computes it, and samples the next one
    s.update(out, {"A": 43})
    assert req.num_computed_tokens == 7 and req.output_token_ids == [42, 43]


def test_a_request_preempted_mid_prefill_restarts_from_its_cached_prefix():
    """Chunked prefill, recompute: the victim loses its KV, re-enters waiting first, and re-hits cached blocks.

    Without vLLM 0.33's full-prompt gate: with it (the default) B is not admitted until its whole
    prompt fits, so it is never preempted mid-prefill (the next test).
    """
    s, _ = make(gpu=7, mode="recompute", max_num_batched_tokens=8, scheduler_reserve_full_isl=False)
    a = Request("A", letters("a" * 8), max_tokens=9)
    b = Request("B", letters("bbbbBBBBcccc" + "d" * 8), max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    steps = drive(s)
    assert steps[0] == ([("A", 8)], [], ["A"])
    assert steps[1] == ([("A", 1), ("B", 7)], [], ["B"])  # B's prefill is chunked by the budget
    first_preempt = next(i for i, (_, pre, _) in enumerate(steps) if pre)
    assert steps[first_preempt][1] == [("B", R)]  # B is preempted before its prefill finished
    readmit = next(i for i, (_, _, adm) in enumerate(steps) if i > first_preempt and "B" in adm)
    # Recomputed from its cached full blocks: the prefill it had done is not all lost.
    assert steps[readmit][0][-1][0] == "B" and steps[readmit][0][-1][1] < 20
    assert s.tokens_recomputed < 7


def test_update_refuses_a_wrong_set_of_samples_and_changes_nothing():
    s, _ = make()
    a, b = Request("A", letters("aaaa"), max_tokens=2), Request("B", letters("b" * 12), max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    for bad in ({}, {"A": 1}, {"A": 1, "B": 1, "C": 1}, {"A": 1.0, "B": 2}, {"A": True, "B": 2}):
        with pytest.raises(InvalidArgumentError):
            s.update(out, bad)
        assert (a.num_computed_tokens, b.num_computed_tokens, a.num_tokens) == (0, 0, 4)
    s.update(out, {"A": 1, "B": 2})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (4, 12)


def _view(s, *reqs):
    """What an update changes: each request's progress and tokens, statuses, queues and free GPU blocks."""
    return (
        [(r.request_id, r.num_computed_tokens, list(r.all_token_ids)) for r in reqs],
        dict(s.status),
        [r.request_id for r in s.waiting],
        [r.request_id for r in s.running],
        s.tm.num_free_gpu_blocks(),
    )


def test_update_refuses_an_output_applied_already_or_replaced_and_changes_nothing():
    s, _ = make()
    a, b = Request("A", letters("aaaa"), max_tokens=3), Request("B", letters("b" * 12), max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    s.update(first, {"A": 1, "B": 2})
    applied = _view(s, a, b)
    assert applied[0] == [("A", 4, [*letters("aaaa"), 1]), ("B", 12, [*letters("b" * 12), 2])]
    with pytest.raises(InvalidArgumentError, match=r"latest schedule\(\), once: this one was applied already"):
        s.update(first, {"A": 1, "B": 2})  # the same step twice would advance both requests again
    assert _view(s, a, b) == applied
    second = s.schedule()
    third = s.schedule()  # a driver that scheduled again: the second output is stale
    scheduled = _view(s, a, b)
    with pytest.raises(InvalidArgumentError, match="a later schedule"):
        s.update(second, {"A": 3, "B": 4})
    assert _view(s, a, b) == scheduled
    s.update(third, {"A": 3, "B": 4})
    assert [r.request_id for r in s.requests.values()] == ["A", "B"]
    assert (a.num_computed_tokens, b.num_computed_tokens) == (5, 13)


@pytest.mark.parametrize("bad", [None, [], [("A", 1)], "A"])
def test_update_refuses_samples_that_are_no_mapping_and_changes_nothing(bad):
    s, _ = make()
    a = Request("A", letters("aaaa"), max_tokens=2)
    s.add_request(a)
    out = s.schedule()
    before = _view(s, a)
    with pytest.raises(InvalidArgumentError, match="sampled must map request ids to sampled tokens"):
        s.update(out, bad)
    assert _view(s, a) == before
    s.update(out, {"A": 1})  # the refused call left the output to apply
    assert a.num_computed_tokens == 4


@pytest.mark.parametrize("bad", [None, "out", {}])
def test_update_refuses_what_is_no_scheduler_output(bad):
    s, _ = make()
    s.add_request(Request("A", letters("aaaa"), max_tokens=2))
    s.schedule()
    with pytest.raises(InvalidArgumentError, match=r"latest schedule\(\), once: got"):
        s.update(bad, {"A": 1})


@pytest.mark.parametrize(
    ("action", "exc"),
    [
        (lambda s: s.add_request("A"), InvalidArgumentError),
        (lambda s: s.add_request(None), InvalidArgumentError),
        (lambda s: s.add_request(Request("A", [1])), InvalidArgumentError),  # added twice
        (lambda s: s.abort("ghost"), UnknownRequestError),
        (lambda s: s.abort(["A"]), UnknownRequestError),
    ],
)
def test_scheduler_misuse_raises_a_clear_error(action, exc):
    s, _ = make()
    s.add_request(Request("A", [1, 2, 3]))
    with pytest.raises(exc) as info:
        action(s)
    assert isinstance(info.value, TieredKVError)
    assert list(s.requests) == ["A"] and s.status["A"] is RequestStatus.WAITING


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 2.0}, "max_num_seqs"),
        ({"chunked_prefill": 1}, "chunked_prefill"),
        ({"victim_policy": "random"}, "victim_policy"),
        ({"mode": ""}, "mode"),
        ({"policy": "sjf"}, "policy"),
    ],
)
def test_bad_scheduler_config(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"policy": "lru"},
            r"policy: 'lru' is not a scheduling order \(policy is fcfs or priority, as in vLLM\); "
            r"the victim policy is now victim_policy='last_admitted'",
        ),
        ({"policy": "cost_aware"}, r"'cost_aware' is not a scheduling order .* now victim_policy='cost_aware'"),
        ({"victim_policy": "lru"}, r"victim_policy: unknown victim policy 'lru'; it is now called 'last_admitted'"),
    ],
)
def test_old_policy_names_are_refused_with_the_new_name(kwargs, message):
    """``policy`` meant the victim policy once; its old values are refused, never read as a scheduling order."""
    with pytest.raises(InvalidArgumentError, match=message):
        SchedulerConfig(**kwargs)


def test_the_policy_is_the_scheduling_order_and_the_victim_policy_is_its_own_field():
    c = SchedulerConfig(policy="priority", victim_policy="largest")
    assert (c.policy, c.victim_policy) == ("priority", "largest")
    assert (SchedulerConfig().policy, SchedulerConfig().victim_policy) == ("fcfs", "last_admitted")


def test_abort_in_every_status_releases_everything():
    s, eng = make(cpu=40, mode="swap", max_num_batched_tokens=64)
    four(s)
    s.add_request(Request("W", letters("w" * 8), max_tokens=4))
    for _ in range(6):  # until someone is swapped out
        out = s.schedule()
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
    statuses = {rid: st for rid, st in s.status.items()}
    assert RequestStatus.SWAPPED in statuses.values()
    for rid in list(s.requests):
        s.abort(rid)
    eng.complete_all()
    s.settle()
    assert s.num_unfinished == 0 and s.tm.requests() == []
    s.tm.check_invariants()
    assert s.tm.num_free_gpu_blocks() == 12 and s.tm.store.num_pinned == 0


@pytest.mark.parametrize("with_token", [False, True])
def test_a_request_aborted_mid_step_needs_no_sampled_token_and_one_given_is_ignored(with_token):
    s, _ = make()
    s.add_request(Request("A", letters("aaaab"), max_tokens=3))
    s.add_request(Request("B", letters("bbbbc"), max_tokens=3))
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("A", 5), ("B", 5)]
    s.abort("A")  # between schedule and update: A's step no longer counts
    sampled = {"A": 7, "B": 1} if with_token else {"B": 1}
    assert s.update(out, sampled) == []
    assert "A" not in s.requests and not s.tm.holds("A")
    b = s.requests["B"]
    assert b.num_computed_tokens == 5 and b.all_token_ids[-1] == 1
    with pytest.raises(InvalidArgumentError, match="sampled has 2 entries, but 1"):
        s.update(s.schedule(), {"B": 2, "A": 7})  # a token for a request that is not in the step at all
    s.check_consistency()
    s.tm.check_invariants()


def test_engine_raises_instead_of_spinning_when_nothing_can_ever_run():
    from tiered_kv.engine.engine import Engine, EngineStalledError

    e = Engine(config=engine_config(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4))
    e.add_request("big", list(range(40)), 4)  # 10 blocks of KV: the GPU pool holds 3
    with pytest.raises(EngineStalledError, match="1 requests unfinished"):
        e.run(max_steps=50)
    e.close()


def test_progress_is_the_schedulers_the_manager_only_reports_it():
    """A swap-in's completion carries the progress; the scheduler sets it (the manager never writes it)."""
    s, eng = make(gpu=9, cpu=20, mode="swap")
    kv = FakeKV()
    eng.on_complete = kv.copy
    a = Request("A", letters("aaaabbbbcc"), max_tokens=4)
    s.add_request(a)
    out = s.schedule()
    s.update(out, {"A": 1})
    s.tm.preempt("A", "swap")  # as a scheduler under pressure would
    assert a.num_computed_tokens == 10  # untouched by the manager
    assert s.tm.residency("A") is Residency.SWAPPING_OUT


# A waiting request the manager refused is not asked about again while nothing that could let it in has
# happened (chunked prefill with the full-prompt gate): these check that it is asked, and admitted, in exactly
# the step something does let it in.
def refused_setup(gpu):
    s, eng = make(gpu=gpu, mode="recompute", max_num_batched_tokens=64)
    asked = []
    admit = s.tm.admit

    def spy(request, *args, **kwargs):
        res = admit(request, *args, **kwargs)
        asked.append((request.request_id, res is not None))
        return res

    s.tm.admit = spy  # the scheduler's own manager, observed through its public verb
    return s, eng, asked


def step(s, asked, tokens):
    """One step; sample the next of ``tokens`` for A, token 1 for anyone else; return (admitted, asks)."""
    del asked[:]
    out = s.schedule()
    s.update(out, {r.request_id: tokens(r) for r, n in out.scheduled if out.needs_sample(r, n)})
    s.check_consistency()
    s.tm.check_invariants()
    return out.admitted, list(asked)


def test_a_refused_request_is_asked_again_and_admitted_in_the_step_a_finish_frees_its_blocks():
    # 5 usable blocks of 4 tokens.  A (7 tokens, 4 outputs) holds 2 blocks, then 3; B (3 tokens) 1, then 2,
    # and runs on; W needs 3 for its whole prompt: 2 are free, then none, then A's 3 when A finishes.
    s, _, asked = refused_setup(gpu=6)
    s.add_request(Request("A", list(range(1, 8)), max_tokens=4))
    s.add_request(Request("B", [20, 21, 22], max_tokens=30))
    s.add_request(Request("W", list(range(50, 62)), max_tokens=2))
    assert step(s, asked, lambda r: 1) == (["A", "B"], [("A", True), ("B", True), ("W", False)])
    for _ in range(3):  # nothing returns a block and nothing of W's prompt is cached: W is not asked again
        assert step(s, asked, lambda r: 1) == ([], [])
    assert "A" not in s.requests and s.status["B"] is RequestStatus.RUNNING  # A finished at the last update
    assert step(s, asked, lambda r: 1) == (["W"], [("W", True)])  # the blocks A freed: asked at once, and in


def test_a_refused_request_is_admitted_in_the_step_its_prefix_becomes_cached_without_any_block_freed():
    # A decodes 5, 6, 7, 8 after its prompt 1-4: its second block [5, 6, 7, 8] is cached at step 4, and W's
    # prompt starts with A's 8 tokens.  Under the full-prompt gate W needs its 4 blocks less the hits A holds:
    # 3 while it hits one block (free: 2), 2 once it hits two.  No block is freed on the way.
    s, _, asked = refused_setup(gpu=5)
    s.add_request(Request("A", [1, 2, 3, 4], max_tokens=30))

    def tokens(r):
        return len(r.all_token_ids) + 1  # A samples 5, 6, 7, ...

    assert step(s, asked, tokens) == (["A"], [("A", True)])
    s.add_request(Request("W", [1, 2, 3, 4, 5, 6, 7, 8, 100, 101, 102, 103, 104], max_tokens=2))
    assert step(s, asked, tokens) == ([], [("W", False)])  # A took its second block: 2 free, W needs 3
    assert step(s, asked, tokens) == ([], [])
    assert step(s, asked, tokens) == ([], [])
    assert s.requests["A"].all_token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    admitted, asks = step(s, asked, tokens)  # A's step fills [5, 6, 7, 8], which is cached: W's hits grow
    assert (admitted, asks) == (["W"], [("W", True)])
    assert s.tm.gpu_block_ids("W")[:2] == s.tm.gpu_block_ids("A")[:2]  # both of A's blocks are its hits
