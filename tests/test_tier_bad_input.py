"""Impossible transitions and bad arguments raise clear errors and change nothing."""

import pytest
from mgrutil import make_tm, run, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import (
    InvalidArgumentError,
    InvalidTransitionError,
    PlanError,
    TieredKVError,
    UnknownRequestError,
)
from tiered_kv.manager import TierManager
from tiered_kv.transfer import ControlledCopyEngine


def populated():
    tm, eng = make_tm(gpu=11, cpu=9)
    run(tm, "run", "AAAABBBBCC")
    run(tm, "out", "XXXXYYYYZ")
    run(tm, "sw", "QQQQRRRRS")
    tm.preempt_request("sw", "swap")
    eng.complete_all()
    tm.poll()
    tm.preempt_request("out", "swap")  # left in flight
    run(tm, "pre", "PPPP")
    tm.preempt_request("pre", "recompute")
    return tm, eng


CASES = [
    (
        "swapping in a request that is not swapped",
        InvalidTransitionError,
        "'run' is running, not swapped",
        lambda tm, eng: tm.resume("run"),
    ),
    (
        "resuming a request mid swap-out",
        InvalidTransitionError,
        "'out' is swapping_out, not swapped",
        lambda tm, eng: tm.resume("out"),
    ),
    (
        "freeing a request that is mid-transfer",
        InvalidTransitionError,
        "'out' is swapping_out",
        lambda tm, eng: tm.finish("out"),
    ),
    ("finishing an unknown request", UnknownRequestError, "'ghost' is not managed", lambda tm, eng: tm.finish("ghost")),
    (
        "admitting a running request",
        InvalidTransitionError,
        "'run' is already running",
        lambda tm, eng: tm.admit(tm._entries["run"].request, 1),
    ),
    (
        "admitting with zero tokens",
        InvalidArgumentError,
        "num_new_tokens must be an int > 0, got 0",
        lambda tm, eng: tm.admit(Request("new", letters("abc")), 0),
    ),
    (
        "admitting more tokens than the request has",
        InvalidArgumentError,
        "exceeds its 3 tokens",
        lambda tm, eng: tm.admit(Request("new", letters("abc")), 4),
    ),
    (
        "growing a swapped request",
        InvalidTransitionError,
        "'sw' is swapped; only running requests grow",
        lambda tm, eng: tm.allocate("sw", 1),
    ),
    (
        "preempting zero blocks",
        InvalidArgumentError,
        "num_blocks_needed must be an int > 0, got 0",
        lambda tm, eng: tm.preempt(0),
    ),
    ("preempting a negative count", InvalidArgumentError, "got -2", lambda tm, eng: tm.preempt(-2)),
    (
        "an unknown policy",
        InvalidArgumentError,
        "unknown victim policy 'random'",
        lambda tm, eng: tm.preempt(1, policy="random"),
    ),
    ("an unknown mode", InvalidArgumentError, "mode must be one of", lambda tm, eng: tm.preempt(1, mode="drop")),
    (
        "quoting a swapped request",
        InvalidTransitionError,
        "only running requests are quoted",
        lambda tm, eng: tm.quote("sw"),
    ),
    (
        "preempting a preempted request",
        InvalidTransitionError,
        "'pre' is preempted",
        lambda tm, eng: tm.preempt_request("pre", "swap"),
    ),
    (
        "dropping a running request's swap copy",
        InvalidTransitionError,
        "not swapped",
        lambda tm, eng: tm.drop_swapped("run"),
    ),
    ("completing a plan twice", PlanError, "not in flight", lambda tm, eng: _complete_twice(tm, eng)),
]


def _complete_twice(tm, eng):
    # Settle a copy of the in-flight plan's handle out of band, then present it again.
    from tiered_kv.transfer import TransferHandle

    plan = tm.plans_in_flight()[0]
    h = TransferHandle(plan)
    h._finish(h.status.DONE)
    record = tm._plans.pop(plan.plan_id)  # as if it had been settled already
    try:
        tm.process_completion(h)
    finally:
        tm._plans[plan.plan_id] = record


@pytest.mark.parametrize(("name", "exc", "message", "action"), CASES, ids=[c[0] for c in CASES])
def test_bad_transition_raises_and_changes_nothing(name, exc, message, action):
    tm, eng = populated()
    before = tm_snapshot(tm)
    with pytest.raises(exc, match=message) as info:
        action(tm, eng)
    assert isinstance(info.value, TieredKVError)
    assert tm_snapshot(tm) == before, f"{name}: state changed"
    tm.check_invariants()


def test_resume_that_does_not_fit_returns_none_and_changes_nothing():
    tm, eng = make_tm(gpu=5, cpu=9)
    run(tm, "A", "AAAABBBBC")
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    tm.admit(Request("F", letters("f" * 16)), 16)  # every GPU block, evicting A's cache
    before = tm_snapshot(tm)
    assert tm.resume("A") is None
    assert tm_snapshot(tm) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_cpu_blocks": 1}, "num_cpu_blocks must be 0 or an int >= 2"),
        ({"num_cpu_blocks": -4}, "num_cpu_blocks must be 0 or an int >= 2"),
        ({"offload": "always"}, "offload must be one of"),
        ({"mode": "maybe"}, "mode must be one of"),
        ({"num_gpu_blocks": 0}, "num_blocks must be an int >= 2"),
        ({"block_size": -16}, "block_size must be a positive int"),
    ],
)
def test_bad_construction(kwargs, message):
    args = {"num_gpu_blocks": 8, "num_cpu_blocks": 8, "block_size": 16, "copy_engine": ControlledCopyEngine()}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        TierManager(**args)


def test_preempt_that_cannot_free_enough_returns_none_and_changes_nothing():
    tm, _eng = make_tm(gpu=11, cpu=9)
    run(tm, "a", "aaaabbbbcc")
    run(tm, "b", "aaaabbbbdd")  # shares a's two full blocks: they are freed by neither alone
    for mode in ("auto", "swap", "recompute"):
        before = tm_snapshot(tm)
        assert tm.preempt(6, mode=mode) is None  # at most 1 + 1 + 1 exclusive blocks exist
        assert tm_snapshot(tm) == before
    # swap mode with a full CPU tier: no victim can be swapped, nothing changes
    tm2, _ = make_tm(gpu=11, cpu=3)
    run(tm2, "big", "x" * 24)
    before = tm_snapshot(tm2)
    assert tm2.preempt(1, mode="swap") is None
    assert tm_snapshot(tm2) == before
    tm.check_invariants()
    tm2.check_invariants()
