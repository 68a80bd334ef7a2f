"""Copy engines: byte-exact round trips, exact coalescing/chunking, lanes, cancel, faults, bad plans."""

import threading

import pytest
import torch
from engineutil import HAS_CUDA, HAS_CUPY, SPEC, fill_random, finish, make_engine, tiers

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.transfer import CopyRun, PlanKind, TransferPlan, TransferStatus
from tiered_kv.transfer.cpu_engine import CpuCopyEngine

ENGINES = [
    "cpu",
    "controlled",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
    pytest.param("cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUPY, reason="needs cupy + CUDA")]),
]
LAYOUTS = ["block_contiguous", "layer_first"]
ID_SETS = {
    "coalesced": ([3, 4, 5, 6], [2, 3, 4, 5], [9, 10, 11, 12]),
    "scattered": ([7, 2, 13, 5], [11, 3, 8, 1], [4, 15, 6, 10]),
}


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ids", sorted(ID_SETS))
def test_round_trip_is_byte_exact(kind, layout, ids):
    t = tiers(layout)
    eng = make_engine(kind, t)
    gpu_ids, cpu_ids, back_ids = ID_SETS[ids]
    want = fill_random(t["GPU"], gpu_ids, seed=1)
    out = eng.submit(TransferPlan(1, "GPU", "CPU", tuple(gpu_ids), tuple(cpu_ids), PlanKind.SWAP_OUT))
    assert finish(eng, out)
    fill_random(t["GPU"], range(1, 16), seed=99)  # overwrite every GPU block
    back = eng.submit(TransferPlan(2, "CPU", "GPU", tuple(cpu_ids), tuple(back_ids), PlanKind.SWAP_IN, urgent=True))
    assert finish(eng, back)
    for g, b in zip(gpu_ids, back_ids, strict=True):
        assert torch.equal(t["GPU"].block(b).cpu(), want[g]), f"block {g} -> {b} differs"
    assert out.num_bytes == back.num_bytes == 4 * SPEC.bytes_per_block
    eng.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_coalescing_and_chunking_issue_exactly_these_copies(layout):
    t = tiers(layout, 32, 32)
    with CpuCopyEngine(t, max_blocks_per_chunk=3, record=True) as eng:
        plan = TransferPlan(5, "GPU", "CPU", (1, 2, 3, 4, 9, 10, 20), (5, 6, 7, 8, 11, 12, 2), PlanKind.SWAP_OUT)
        assert eng.submit(plan).wait(10)
    assert eng.trace == [
        (5, "d2h", 0, CopyRun(1, 5, 3)),
        (5, "d2h", 1, CopyRun(4, 8, 1)),
        (5, "d2h", 1, CopyRun(9, 11, 2)),
        (5, "d2h", 2, CopyRun(20, 2, 1)),
    ]


def test_swap_in_is_not_blocked_by_a_stalled_swap_out():
    t = tiers("block_contiguous")
    release = threading.Event()

    def stall(plan, run):
        if plan.direction == "D2H":
            assert release.wait(10)

    with CpuCopyEngine(t, copy_hook=stall) as eng:
        out = eng.submit(TransferPlan(1, "GPU", "CPU", (1, 2), (1, 2), PlanKind.SWAP_OUT))
        back = eng.submit(TransferPlan(2, "CPU", "GPU", (3,), (5,), PlanKind.SWAP_IN, urgent=True))
        assert back.wait(10) and not out.done()
        release.set()
        assert out.wait(10)


def test_cancel_before_start_and_between_chunks():
    t = tiers("block_contiguous", 32, 32)
    gate = threading.Event()
    copied = []

    def hook(plan, run):
        copied.append((plan.plan_id, run))
        if plan.plan_id == 1:
            assert gate.wait(10)

    with CpuCopyEngine(t, max_blocks_per_chunk=1, copy_hook=hook) as eng:
        first = eng.submit(TransferPlan(1, "GPU", "CPU", (1, 2, 3), (1, 2, 3), PlanKind.SWAP_OUT))
        queued = eng.submit(TransferPlan(2, "GPU", "CPU", (4,), (4,), PlanKind.SWAP_OUT))
        assert eng.cancel(queued) and queued.status is TransferStatus.CANCELLED
        while not copied:
            threading.Event().wait(0.001)
        assert eng.cancel(first)  # running: stops at the next chunk boundary
        gate.set()
        first.wait(10)
    assert first.status is TransferStatus.CANCELLED and not first.ok
    assert [pid for pid, _ in copied] == [1]  # one chunk copied, plan 2 never started
    assert eng.cancel(first) is False


def test_failed_copy_reports_the_error_and_leaves_the_source_intact():
    t = tiers("layer_first")
    want = fill_random(t["GPU"], [1, 2, 3], seed=5)

    def boom(plan, run):
        if run.src_start == 3:
            raise RuntimeError("DMA error")

    with CpuCopyEngine(t, copy_hook=boom) as eng:
        h = eng.submit(TransferPlan(1, "GPU", "CPU", (1, 2, 3), (4, 5, 7), PlanKind.SWAP_OUT))
        assert h.wait(10) is False
    assert h.status is TransferStatus.FAILED and "DMA error" in str(h.error)
    with pytest.raises(TransferError, match="plan 1 failed"):
        h.result(0)
    for b in (1, 2, 3):
        assert torch.equal(t["GPU"].block(b).cpu(), want[b])


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize(
    ("src", "dst", "msg"),
    [
        ((1, 2), (3,), "2 source ids but 1 destination ids"),
        ((1, 16), (3, 4), r"source id 16 out of range \[0, 16\)"),
        ((0, 2), (3, 4), "null block 0"),
        ((1, 2), (5, 5), "destination block 5 listed twice"),
    ],
)
def test_bad_plans_are_refused_before_anything_is_copied(kind, src, dst, msg):
    t = tiers("block_contiguous")
    fill_random(t["GPU"], range(1, 16), seed=3)
    before = t["CPU"].byte_view().clone()
    eng = make_engine(kind, t)
    with pytest.raises(PlanError, match=msg):
        eng.submit(TransferPlan(1, "GPU", "CPU", src, dst, PlanKind.SWAP_OUT))
    assert torch.equal(t["CPU"].byte_view(), before)
    eng.close()


def test_wait_for_orders_a_write_after_the_read_of_its_destination():
    t = tiers("block_contiguous")
    old = fill_random(t["GPU"], [4], seed=11)
    gate = threading.Event()

    def slow_offload(plan, run):
        if plan.plan_id == 1:
            assert gate.wait(10)

    fill_random(t["CPU"], [9], seed=12)
    new = t["CPU"].block(9).clone()
    with CpuCopyEngine(t, copy_hook=slow_offload) as eng:
        offload = eng.submit(TransferPlan(1, "GPU", "CPU", (4,), (2,), PlanKind.OFFLOAD))
        swap_in = eng.submit(TransferPlan(2, "CPU", "GPU", (9,), (4,), PlanKind.SWAP_IN, urgent=True, wait_for=(1,)))
        threading.Event().wait(0.05)
        assert not swap_in.done()  # waits for the offload that reads block 4
        gate.set()
        assert swap_in.wait(10) and offload.wait(10)
    assert torch.equal(t["CPU"].block(2), old[4]) and torch.equal(t["GPU"].block(4).cpu(), new)


def test_engine_refuses_unknown_tier_and_duplicate_plan_ids():
    t = tiers("block_contiguous")
    gate = threading.Event()
    with CpuCopyEngine(t, copy_hook=lambda p, r: gate.wait(10)) as eng:
        eng.submit(TransferPlan(1, "GPU", "CPU", (1,), (1,)))
        with pytest.raises(PlanError, match="already in flight"):
            eng.submit(TransferPlan(1, "GPU", "CPU", (2,), (2,)))
        gate.set()
    with pytest.raises(PlanError, match="no DISK tier"):
        CpuCopyEngine(t).submit(TransferPlan(1, "GPU", "DISK", (1,), (1,)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_compute_stream_waits_on_swap_in_without_host_sync():
    from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

    t = tiers("block_contiguous")
    want = fill_random(t["CPU"], [3], seed=2)
    eng = TorchCudaCopyEngine(t)
    h = eng.submit(TransferPlan(1, "CPU", "GPU", (3,), (6,), PlanKind.SWAP_IN, urgent=True))
    eng.make_compute_wait(h)
    out = t["GPU"].block(6).float().sum()  # runs on the current stream after the copy
    assert torch.isclose(out.cpu(), want[3].float().sum())
    assert h.wait() and h.elapsed_s >= 0


def test_cancel_racing_the_last_chunk_answers_truthfully_and_leaks_nothing_to_a_reused_id():
    """A plan finishing while cancel runs: cancel's answer matches the final status, and the id is clean.

    The handle's ``done()`` is wrapped so that cancel's first look lets the
    copy try to finish (for up to half a second) and then answers "not done":
    the worst interleaving, made deterministic.  Whatever the engine decides,
    ``cancel`` must return True exactly when the handle ends CANCELLED, and a
    later plan reusing the id must run to completion.
    """
    t = tiers("block_contiguous")
    gate = threading.Event()

    def hold(plan, run):
        if plan.plan_id == 1 and not gate.is_set():
            assert gate.wait(10)

    with CpuCopyEngine(t, copy_hook=hold) as eng:
        h = eng.submit(TransferPlan(1, "GPU", "CPU", (1,), (1,), PlanKind.SWAP_OUT))
        while h.status is TransferStatus.PENDING:
            threading.Event().wait(0.001)
        real_done = h.done
        calls = []

        def racing_done():
            if not calls:
                calls.append(1)
                gate.set()  # let the worker finish its only chunk...
                h.wait(0.5)
                return False  # ...while cancel believes it is still running
            return real_done()

        h.done = racing_done
        answer = eng.cancel(h)
        assert h.wait(10) is not None and real_done()
        assert calls and answer == (h.status is TransferStatus.CANCELLED)
        again = eng.submit(TransferPlan(1, "GPU", "CPU", (2,), (2,), PlanKind.SWAP_OUT))
        assert again.wait(10) and again.status is TransferStatus.DONE


def test_cancel_true_means_cancelled_even_after_the_last_chunk():
    """A cancel registered while the last chunk copies still ends the plan CANCELLED (never DONE)."""
    t = tiers("block_contiguous")
    started, gate = threading.Event(), threading.Event()

    def hold(plan, run):
        started.set()
        assert gate.wait(10)

    with CpuCopyEngine(t, copy_hook=hold) as eng:
        h = eng.submit(TransferPlan(1, "GPU", "CPU", (1,), (1,), PlanKind.SWAP_OUT))
        assert started.wait(10)
        assert eng.cancel(h) is True
        gate.set()
        h.wait(10)
    assert h.status is TransferStatus.CANCELLED


@pytest.mark.parametrize("kind", ["cpu", "controlled"])
@pytest.mark.parametrize("bad", [None, "plan 1", 1, (1, "GPU", "CPU")])
def test_engines_refuse_what_is_not_a_plan_or_a_handle(kind, bad):
    t = tiers("block_contiguous")
    eng = make_engine(kind, t)
    try:
        with pytest.raises(PlanError, match="takes a TransferPlan"):
            eng.submit(bad)
        with pytest.raises(PlanError, match="takes a TransferHandle"):
            eng.cancel(bad)
        h = eng.submit(TransferPlan(1, "GPU", "CPU", (1,), (1,), PlanKind.SWAP_OUT))
        assert finish(eng, h)  # the engine still works
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"plan_id": 1.0}, "plan_id must be an int"),
        ({"plan_id": True}, "plan_id must be an int"),
        ({"src_block_ids": [1]}, "src_block_ids must be a tuple of ints"),
        ({"dst_block_ids": (1.0,)}, "dst_block_ids must be a tuple of ints"),
        ({"wait_for": (None,)}, "wait_for must be a tuple of ints"),
        ({"src_medium": None}, "src_medium must name a tier"),
        ({"kind": "swap_out"}, "kind must be a PlanKind"),
        ({"urgent": 1}, "urgent a bool"),
    ],
)
def test_plans_with_fields_of_the_wrong_type_are_refused(kwargs, message):
    args = {
        "plan_id": 1,
        "src_medium": "GPU",
        "dst_medium": "CPU",
        "src_block_ids": (1,),
        "dst_block_ids": (2,),
        "kind": PlanKind.SWAP_OUT,
    }
    args.update(kwargs)
    with pytest.raises(PlanError, match=message):
        TransferPlan(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")),
        pytest.param("cupy", marks=pytest.mark.skipif(not HAS_CUPY, reason="needs cupy + CUDA")),
    ],
)
def test_swap_out_reads_the_kv_a_still_running_kernel_writes(kind):
    """A GPU-to-CPU copy submitted behind compute reads what compute wrote, not what was there before."""
    t = tiers("block_contiguous")
    t["GPU"].kv.zero_()
    eng = make_engine(kind, t)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy well past the submission
    t["GPU"].kv[3].fill_(7)  # queued on the compute stream behind the sleep
    h = eng.submit(TransferPlan(1, "GPU", "CPU", (3,), (5,), PlanKind.SWAP_OUT))
    assert h.wait(60)
    assert torch.all(t["CPU"].kv[5] == 7)


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
def test_a_layer_wise_plan_lands_layer_by_layer_byte_exact(layout):
    """Each layer is announced once its K and V landed; the whole plan equals a whole-plan copy."""
    t = tiers(layout)
    want = fill_random(t["CPU"], [2, 3, 5], seed=7)
    landed_before = []

    def note(plan, layer):
        landed_before.append([h.layer_done(i) for i in range(SPEC.num_layers)] if handles else None)

    handles = []
    with CpuCopyEngine(t, layer_hook=note, layer_order=lambda n: list(reversed(range(n)))) as eng:
        plan = TransferPlan(1, "CPU", "GPU", (2, 3, 5), (7, 8, 4), PlanKind.SWAP_IN, urgent=True, num_layers=2)
        h = eng.submit(plan)
        handles.append(h)
        assert h.wait_layer(1, 10) and h.wait_layer(0, 10) and h.wait(10)
    for s, d in ((2, 7), (3, 8), (5, 4)):
        assert torch.equal(t["GPU"].block(d).cpu(), want[s])
    assert [h.layer_done(i) for i in range(2)] == [True, True]


def test_a_layer_wise_plan_failing_at_a_layer_ends_the_layers_not_landed():
    t = tiers("block_contiguous")
    fill_random(t["CPU"], [2], seed=8)

    def fail_at_1(plan, layer):
        if layer == 1:
            raise RuntimeError("DMA error at layer 1")

    with CpuCopyEngine(t, layer_hook=fail_at_1) as eng:
        h = eng.submit(TransferPlan(1, "CPU", "GPU", (2,), (3,), PlanKind.SWAP_IN, urgent=True, num_layers=2))
        assert h.wait_layer(0, 10) is True  # layer 0 landed before the fault
        assert h.wait_layer(1, 10) is False and h.wait(10) is False
    assert h.status is TransferStatus.FAILED and "layer 1" in str(h.error)


def test_controlled_layers_land_in_any_order_and_complete_finishes_the_rest():
    from tiered_kv.transfer import ControlledCopyEngine

    landed = []
    eng = ControlledCopyEngine({"GPU": 8, "CPU": 8}, on_complete_layer=lambda p, layer: landed.append(layer))
    h = eng.submit(TransferPlan(1, "CPU", "GPU", (1,), (2,), PlanKind.SWAP_IN, num_layers=3))
    eng.complete_layer(1, 2)
    assert [h.layer_done(i) for i in range(3)] == [False, False, True] and not h.done()
    eng.complete(1)
    assert landed == [2, 0, 1] and h.ok and all(h.layer_done(i) for i in range(3))
    with pytest.raises(PlanError, match="has no layer 3"):
        eng.submit(TransferPlan(2, "CPU", "GPU", (1,), (3,), PlanKind.SWAP_IN, num_layers=3))
        eng.complete_layer(2, 3)


def test_a_layer_wise_plan_must_cover_the_models_layers():
    t = tiers("block_contiguous")
    with CpuCopyEngine(t) as eng, pytest.raises(PlanError, match="must cover the 2 layers"):
        eng.submit(TransferPlan(1, "CPU", "GPU", (1,), (2,), PlanKind.SWAP_IN, num_layers=5))
