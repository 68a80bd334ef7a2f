"""The port's queries and verbs on tiny cases: state, room, victim, step_computed; the state machine's table."""

from __future__ import annotations

import pytest
from mgrutil import make_tm, run, settle, tm_snapshot

from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError
from tiered_kv.manager.outcomes import Room
from tiered_kv.manager.states import TRANSITIONS, KVState, Residency
from tiered_kv.manager.tier_manager import move


def test_state_follows_a_request_through_admit_swap_resume_and_free():
    tm, eng = make_tm(gpu=9, cpu=9)
    assert tm.state("A") == KVState(False, None)  # never admitted: a plain answer, not an error
    run(tm, "A", "aaaabbbbcc")
    assert tm.state("A") == KVState(True, Residency.GPU)
    p = tm.preempt("A", "swap")
    assert p is not None and tm.state("A") == KVState(True, Residency.SWAPPING_OUT) and tm.state("A").in_flight
    (c,) = settle(tm, eng)
    assert c.residency is Residency.CPU and tm.state("A") == KVState(True, Residency.CPU)
    r = tm.resume("A")
    assert r is not None and tm.state("A").residency is (Residency.SWAPPING_IN if r.plan else Residency.GPU)
    settle(tm, eng)
    assert tm.state("A") == KVState(True, Residency.GPU)
    assert tm.free("A") is True and tm.state("A") == KVState(False, None)


def test_state_of_a_recompute_victim_is_open_with_no_kv():
    tm, _ = make_tm(gpu=9, cpu=9)
    run(tm, "A", "aaaabbbbcc")
    assert tm.preempt("A", "recompute") is not None
    assert tm.state("A") == KVState(True, None)  # its request stays open in the store until free


def test_state_refuses_an_unhashable_id():
    tm, _ = make_tm()
    with pytest.raises(InvalidArgumentError, match="request_id"):
        tm.state(["A"])


def test_room_counts_blocks_short_and_what_copies_in_flight_free():
    tm, eng = make_tm(gpu=9, cpu=9)  # 8 usable GPU blocks of 4 tokens
    run(tm, "A", "aaaabbbbcccc")  # 3 blocks
    run(tm, "B", "ddddeeeeffffgggg")  # 4 blocks: 1 free
    assert tm.room("A", 4) == Room(0, 0, 0)
    assert tm.room("A", 8) == Room(1, 0, 0)  # 2 new blocks, 1 free
    assert tm.room() == Room(0, 0, 0)
    assert tm.preempt("B", "swap") is not None
    assert tm.room("A", 8) == Room(1, 4, 1)  # B's 4 blocks come back when its swap-out lands
    settle(tm, eng)
    assert tm.room("A", 8) == Room(0, 0, 0)


def test_victim_is_the_policys_first_and_swap_mode_passes_over_what_cannot_swap():
    tm, _ = make_tm(gpu=9, cpu=0)  # no CPU tier: nobody can be swapped
    run(tm, "A", "aaaabbbbcccc")
    run(tm, "B", "ddddeeee")
    before = tm_snapshot(tm)
    assert tm.victim("A", ["A", "B"]) == "B"  # last_admitted: the last of the scheduler's order
    assert tm.victim("A", ["B", "A"]) == "A"
    assert tm.victim("A", ["A", "B"], "largest") == "A"  # 3 blocks against 2
    assert tm.victim("A", ["A", "B"], "last_admitted", "swap") == "A"  # B cannot swap; the requester yields
    assert tm.victim("A", ["B"], "last_admitted", "swap") is None
    assert tm_snapshot(tm) == before  # a query: nothing changed


def test_victim_refuses_a_candidate_not_on_the_gpu_and_changes_nothing():
    tm, eng = make_tm(gpu=9, cpu=9)
    run(tm, "A", "aaaabbbbcccc")
    run(tm, "B", "ddddeeee")
    assert tm.preempt("B", "swap") is not None
    before = tm_snapshot(tm)
    with pytest.raises(InvalidTransitionError, match="'B'"):
        tm.victim("A", ["A", "B"])
    with pytest.raises(InvalidArgumentError, match="mode"):
        tm.victim("A", ["A"], "last_admitted", "sideways")
    assert tm_snapshot(tm) == before
    settle(tm, eng)


def test_the_table_names_every_move_and_refuses_any_other():
    assert move("preempt", Residency.GPU, Residency.SWAPPING_OUT) is Residency.SWAPPING_OUT
    assert move("settle", Residency.SWAPPING_OUT, Residency.GPU) is Residency.GPU  # a failed swap-out
    with pytest.raises(AssertionError, match="resume: no transition gpu -> swapping_in"):
        move("resume", Residency.GPU, Residency.SWAPPING_IN)
    with pytest.raises(AssertionError, match="settle"):
        move("settle", Residency.CPU, Residency.GPU)  # nothing moves a swapped request but resume
    moving = {Residency.LOADING, Residency.SWAPPING_OUT, Residency.SWAPPING_IN}
    assert set(TRANSITIONS["settle"]) == moving  # only a copy's settling leaves a moving state
    assert not moving & set(TRANSITIONS["free"]) and not moving & set(TRANSITIONS["preempt"])
