"""Transfer plans: validation, coalescing and chunking (exact), and the controlled engine."""

import pytest

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.transfer import (
    ControlledCopyEngine,
    CopyRun,
    PlanKind,
    TransferPlan,
    TransferStatus,
    chunk_runs,
    coalesce,
    count_runs,
)


def plan(src, dst, pid=1, s="GPU", d="CPU", **kw):
    return TransferPlan(pid, s, d, tuple(src), tuple(dst), **kw)


@pytest.mark.parametrize(
    ("src", "dst", "msg"),
    [
        ((1, 2), (3,), "2 source ids but 1 destination ids"),
        ((1, 9), (3, 4), r"source id 9 out of range \[0, 8\)"),
        ((1, 2), (3, -1), r"destination id -1 out of range"),
        ((0, 2), (3, 4), "source lists the null block 0"),
        ((1, 2), (0, 4), "destination lists the null block 0"),
        ((1, 2), (3, 3), "destination block 3 listed twice"),
    ],
)
def test_bad_plans_are_refused_before_anything_is_copied(src, dst, msg):
    copies = []
    eng = ControlledCopyEngine({"GPU": 8, "CPU": 8}, on_complete=copies.append)
    with pytest.raises(PlanError, match=msg):
        eng.submit(plan(src, dst))
    assert eng.pending_ids() == [] and copies == []


def test_same_tier_overlap_is_refused():
    with pytest.raises(PlanError, match="overlap within GPU"):
        plan((1, 2), (2, 3), d="GPU").validate(8, 8)


def test_coalescing_is_exact():
    assert coalesce([4, 5, 6, 9, 10, 2], [1, 2, 3, 4, 5, 7]) == [CopyRun(4, 1, 3), CopyRun(9, 4, 2), CopyRun(2, 7, 1)]
    # Consecutive on one side only: not one copy.
    assert coalesce([1, 2, 3], [5, 7, 8]) == [CopyRun(1, 5, 1), CopyRun(2, 7, 2)]
    assert coalesce([], []) == []
    assert count_runs([3, 4, 5, 7, 8, 1]) == 3


def test_chunking_is_exact_and_splits_long_runs():
    runs = [CopyRun(1, 11, 5), CopyRun(20, 30, 2), CopyRun(40, 50, 4)]
    assert chunk_runs(runs, 4) == [
        [CopyRun(1, 11, 4)],
        [CopyRun(5, 15, 1), CopyRun(20, 30, 2), CopyRun(40, 50, 1)],
        [CopyRun(41, 51, 3)],
    ]
    assert sum(r.length for c in chunk_runs(runs, 3) for r in c) == 11
    with pytest.raises(ValueError, match="> 0"):
        chunk_runs(runs, 0)


def test_plan_properties():
    p = plan((1, 2), (3, 4), s="CPU", d="GPU", kind=PlanKind.SWAP_IN)
    assert (p.direction, p.num_blocks) == ("H2D", 2)


def test_controlled_engine_handle_semantics():
    done = []
    eng = ControlledCopyEngine({"GPU": 8, "CPU": 8}, bytes_per_block=100, on_complete=done.append)
    h1, h2, h3 = (eng.submit(plan((1,), (i,), pid=i)) for i in (1, 2, 3))
    assert not h1.done() and h1.status is TransferStatus.PENDING and h1.num_bytes == 100
    eng.complete(2)
    assert h2.done() and h2.ok and h2.wait(0) and done == [h2.plan]
    eng.fail(1, "bus error")
    assert h1.done() and not h1.ok and isinstance(h1.error, TransferError)
    with pytest.raises(TransferError, match="failed: plan 1: bus error"):
        h1.result(0)
    assert eng.cancel(h3) is True and h3.status is TransferStatus.CANCELLED
    assert eng.cancel(h3) is False and done == [h2.plan]
    with pytest.raises(PlanError, match="not pending"):
        eng.complete(1)
    with pytest.raises(PlanError, match="already in flight"):
        eng.submit(plan((1,), (5,), pid=9)) and eng.submit(plan((1,), (6,), pid=9))
