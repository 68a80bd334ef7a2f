"""CUDA copy engines on a real device: asynchrony, ordering between streams, no host synchronisation.

A copy lane's stream (or the compute stream) is kept busy with a device-side
sleep, so a copy or a kernel queued behind it cannot have run yet; what each
test checks then follows from stream order alone, never from timing.
"""

from __future__ import annotations

import pytest
import torch
from engineutil import HAS_CUDA, HAS_CUPY, fill_random, make_engine, tiers

from tiered_kv.transfer import PlanKind, TransferPlan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
KINDS = ["cuda", pytest.param("cupy", marks=pytest.mark.skipif(not HAS_CUPY, reason="needs cupy + CUDA"))]
LAYOUTS = ["block_contiguous", "layer_first"]
SLEEP_CYCLES = 500_000_000  # a quarter of a second or more at any clock an H200 runs


def busy(engine, lane: str) -> None:
    """Queue a device-side sleep on one of the engine's lanes (torch or cupy stream)."""
    s = engine.streams[lane]
    stream = s if isinstance(s, torch.cuda.Stream) else torch.cuda.ExternalStream(s.ptr)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)


def swap_in(plan_id: int, src: tuple[int, ...], dst: tuple[int, ...], **kw) -> TransferPlan:
    return TransferPlan(plan_id, "CPU", "GPU", src, dst, PlanKind.SWAP_IN, urgent=True, **kw)


def swap_out(plan_id: int, src: tuple[int, ...], dst: tuple[int, ...], **kw) -> TransferPlan:
    return TransferPlan(plan_id, "GPU", "CPU", src, dst, PlanKind.SWAP_OUT, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_submit_returns_before_the_copy_has_run(kind, layout):
    t = tiers(layout)
    eng = make_engine(kind, t)
    want = fill_random(t["CPU"], [3, 4], seed=1)
    torch.cuda.synchronize()
    busy(eng, "h2d_urgent")
    h = eng.submit(swap_in(1, (3, 4), (6, 7)))
    assert not h.done()  # queued behind the sleep: submit handed it to the device and returned
    assert h.wait(60) and h.elapsed_s > 0
    for src, dst in ((3, 6), (4, 7)):
        assert torch.equal(t["GPU"].block(dst).cpu(), want[src])
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_compute_ordered_after_a_delayed_swap_in_reads_the_new_kv(kind):
    t = tiers("block_contiguous")
    eng = make_engine(kind, t)
    want = fill_random(t["CPU"], [3], seed=2)
    t["GPU"].kv.zero_()
    torch.cuda.synchronize()
    busy(eng, "h2d_urgent")
    h = eng.submit(swap_in(1, (3,), (6,)))
    eng.make_compute_wait(h)  # the device orders the current stream after the copy; the host goes on
    out = t["GPU"].block(6).float().sum()  # without the wait this would read zeros
    assert not h.done()
    assert torch.isclose(out.cpu(), want[3].float().sum())
    assert h.wait(60)
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_wait_for_keeps_a_write_behind_the_read_it_must_follow(kind):
    """A swap-in into block 3 waits on the device for the delayed swap-out still reading block 3."""
    t = tiers("block_contiguous")
    eng = make_engine(kind, t)
    old = fill_random(t["GPU"], [3], seed=3)
    new = fill_random(t["CPU"], [9], seed=4)
    torch.cuda.synchronize()
    busy(eng, "d2h")
    out = eng.submit(swap_out(1, (3,), (5,)))
    back = eng.submit(swap_in(2, (9,), (3,), wait_for=(1,)))
    assert out.wait(60) and back.wait(60)
    assert torch.equal(t["CPU"].block(5), old[3])  # the swap-out read block 3 before it was overwritten
    assert torch.equal(t["GPU"].block(3).cpu(), new[9])
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_submitting_and_ordering_copies_never_synchronises_the_host(kind, layout):
    """torch's sync debug mode raises on any synchronising torch op made while plans are issued.

    It sees torch's ops only (the cupy engine's own CUDA calls are counted from
    the profiler trace by ``tiered-kv gpu-check``).
    """
    t = tiers(layout)
    eng = make_engine(kind, t)
    want = fill_random(t["GPU"], [2, 7, 11], seed=5)
    back = fill_random(t["CPU"], [12, 4, 8], seed=6)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h_out = eng.submit(swap_out(1, (2, 7, 11), (3, 9, 1)))
        h_in = eng.submit(swap_in(2, (12, 4, 8), (5, 13, 14)))
        eng.make_compute_wait(h_in)
        total = t["GPU"].block(5).float().sum()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert h_out.wait(60) and h_in.wait(60), (h_out.error, h_in.error)
    for src, dst in ((2, 3), (7, 9), (11, 1)):
        assert torch.equal(t["CPU"].block(dst), want[src])
    for src, dst in ((12, 5), (4, 13), (8, 14)):
        assert torch.equal(t["GPU"].block(dst).cpu(), back[src])
    assert torch.isclose(total.cpu(), back[12].float().sum())
    eng.close()
