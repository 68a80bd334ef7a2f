"""The simulated link: copies per plan, per-copy cost, the bidirectional cap, queues, layerwise steps."""

import math

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.link import CopyGeometry, SimLink
from tiered_kv.sim.profiles import LinkProfile
from tiered_kv.transfer.plan import CPU, GPU, PlanKind, TransferPlan, TransferStatus


def plan(pid, direction, src, dst=None, kind=PlanKind.COPY, wait_for=()):
    a, b = (CPU, GPU) if direction == "H2D" else (GPU, CPU)
    dst = dst if dst is not None else src
    return TransferPlan(pid, a, b, tuple(src), tuple(dst), kind, None, False, tuple(wait_for))


def drain(loop, link):
    """Run the link's events; return {plan id: finish time}."""
    ends = {}
    while (ev := loop.pop_until(math.inf)) is not None:
        job = link.on_event(ev[2])
        if job is not None:
            ends[job.plan.plan_id] = loop.now
    return ends


def test_copies_per_plan_follow_layout_and_coalescing():
    src, dst = (1, 2, 3, 7), (5, 6, 7, 9)  # one run of three, then one block
    assert CopyGeometry(100, 3).num_copies(src, dst) == 2
    assert CopyGeometry(100, 3, "layer_first").num_copies(src, dst) == 2 * 6
    assert CopyGeometry(100, 3, "layer_first", coalesce=False).num_copies(src, dst) == 4 * 6
    assert CopyGeometry(100, 3, coalesce=False).num_copies(src, dst) == 4
    with pytest.raises(InvalidArgumentError, match="layout must be one of"):
        CopyGeometry(100, 3, "diagonal")


def test_a_plan_costs_its_copies_and_its_bytes():
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(100.0, 100.0, 200.0, 0.5), CopyGeometry(50, 1))
    h = link.submit(plan(1, "H2D", (1, 3)))  # two blocks, not adjacent: 2 copies x 0.5 s + 100 B / 100 B/s
    assert h.status is TransferStatus.RUNNING
    assert drain(loop, link) == {1: 2.0}
    assert h.status is TransferStatus.DONE and link.intervals == [(0.0, 2.0, "H2D", 100)]


def test_both_directions_share_the_cap_and_speed_up_when_one_ends():
    # 100 B/s one way, 150 B/s both ways: each direction gets 75 B/s while both move.
    # H2D 100 B ends at 100/75 = 1.333 s; by then D2H has moved 100 of its 200 B, and the rest
    # goes at the full 100 B/s: it ends at 2.333 s.
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(100.0, 100.0, 150.0, 0.0), CopyGeometry(100, 1))
    link.submit(plan(1, "H2D", (1,)))
    link.submit(plan(2, "D2H", (1, 2)))
    assert link.idle_at() == pytest.approx(7 / 3)
    ends = drain(loop, link)
    assert ends[1] == pytest.approx(4 / 3) and ends[2] == pytest.approx(7 / 3)


def test_a_cap_of_twice_one_way_is_full_duplex():
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(100.0, 100.0, 200.0, 0.0), CopyGeometry(100, 1))
    link.submit(plan(1, "H2D", (1,)))
    link.submit(plan(2, "D2H", (1, 2)))
    assert drain(loop, link) == {1: 1.0, 2: 2.0}


def test_each_direction_is_a_queue_and_a_plan_waits_for_its_wait_for():
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(100.0, 100.0, 200.0, 0.0), CopyGeometry(100, 1))
    link.submit(plan(1, "D2H", (1,)))
    link.submit(plan(2, "D2H", (2,)))  # behind plan 1
    link.submit(plan(3, "H2D", (3,), wait_for=(2,)))  # may not start before plan 2 ends
    assert drain(loop, link) == {1: 1.0, 2: 2.0, 3: 3.0}


def test_a_direction_without_bandwidth_fails_at_once():
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(0.0, 100.0, 100.0, 0.0), CopyGeometry(100, 1))
    h = link.submit(plan(1, "H2D", (1,)))
    assert h.status is TransferStatus.FAILED and "link is down" in str(h.error) and len(loop) == 0


def test_effective_bandwidth_of_small_copies():
    link = LinkProfile(50e9, 50e9, 90e9, 2e-6)
    assert link.effective_bytes_per_s(100e3) == pytest.approx(100e3 / (2e-6 + 2e-6))  # half the bandwidth
    assert link.effective_bytes_per_s(1e12) == pytest.approx(50e9, rel=1e-6)


def test_layerwise_swap_in_is_final_at_once_and_stretches_the_step_that_reads_it():
    loop = EventLoop()
    link = SimLink(loop, LinkProfile(100.0, 100.0, 200.0, 0.0), CopyGeometry(100, 4), mode="layerwise")
    h = link.submit(plan(1, "H2D", (1, 2), kind=PlanKind.SWAP_IN))  # 2 s of copy
    assert h.status is TransferStatus.DONE  # ordered before the compute that reads it
    jobs = link.take_layerwise()
    assert [j.plan.plan_id for j in jobs] == [1] and link.take_layerwise() == []
    # A 1 s step from t=0 over 4 layers: layer i waits for the copy's layer i (0.5 s each):
    # max(0 + 1, 0 + 2/4 + 1, 2 + 1/4) = 2.25.
    assert link.layerwise_end(jobs, 0.0, 1.0, 4) == pytest.approx(2.25)
    # A long step hides the copy but its first layer: max(8, 0.5 + 8, 2 + 2) = 8.5.
    assert link.layerwise_end(jobs, 0.0, 8.0, 4) == pytest.approx(8.5)
    d2h = link.submit(plan(2, "D2H", (3,), kind=PlanKind.SWAP_OUT))
    assert d2h.status is TransferStatus.RUNNING and link.take_layerwise() == []  # swap-outs stay async
    assert drain(loop, link) == {1: 2.0, 2: 1.0}


def test_unknown_mode_is_refused():
    with pytest.raises(InvalidArgumentError, match="copy mode must be one of"):
        SimLink(EventLoop(), LinkProfile(1.0, 1.0, 2.0, 0.0), CopyGeometry(1, 1), mode="eager")
