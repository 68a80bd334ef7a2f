"""The tier manager does what its docstrings say: refusals, completions' fields, live counters, bounded logs.

Each test pins one contract a user reads in the README or a docstring, on tiny
managers driven through the public API, with exact values.
"""

from __future__ import annotations

import pytest
from mgrutil import make_tm, run, settle, tm_snapshot
from poolutil import letters

import tiered_kv.manager as manager_pkg
from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, TieredKVError
from tiered_kv.manager import BoundedLog, CostModel, ManagerConfig, PlanKind, PreemptMode, Residency, TierManager
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer import ControlledCopyEngine
from tiered_kv.transfer.cpu_engine import CpuCopyEngine

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)


# ------------------------------------------------- item 9: an impossible swap
def test_a_forced_swap_of_a_request_with_nothing_computed_returns_none_and_changes_nothing():
    tm, _ = make_tm()
    req = Request("a", letters("abcdefgh"))
    assert tm.admit(req, req.num_tokens) is not None  # blocks held, nothing computed yet
    tm.poll()  # a later step, in which it is not batched (a request batched in its step is no victim)
    before = tm_snapshot(tm)
    assert tm.preempt("a", "swap") is None
    assert tm_snapshot(tm) == before and tm.residency("a") is Residency.GPU and len(tm.decision_log) == 0
    p = tm.preempt("a", "auto")  # "auto" recomputes it, which loses nothing
    assert p is not None and (p.mode, p.residency, p.blocks_freed_now) == (PreemptMode.RECOMPUTE, None, 2)


# ------------------------------------------ item 10: what a completion carries
def test_plankind_is_exported_from_the_manager_package():
    assert manager_pkg.PlanKind is PlanKind and "PlanKind" in manager_pkg.__all__


def test_a_write_through_offload_completion_carries_its_request_id_and_no_progress():
    tm, eng = make_tm(offload="write_through")
    run(tm, "a", "abcdefghi")  # two full prompt blocks are stored
    (c,) = settle(tm, eng)
    assert (c.kind, c.request_id, c.ok, c.num_tokens, c.residency) == (
        PlanKind.OFFLOAD,
        "a",
        True,
        0,
        Residency.GPU,
    )


def test_an_onboarding_completion_reports_the_requests_absolute_progress_gpu_hits_included():
    # "abcd" stays cached on the GPU (held by a running request); "efgh" is only on the CPU.
    tm, eng = make_tm(gpu=9, cpu=9, offload="write_through")
    run(tm, "a", "abcdefghi")
    settle(tm, eng)
    tm.free("a")
    run(tm, "keep", "abcdz")  # re-hits block "abcd" on the GPU and keeps it there
    run(tm, "fill", "mnopqrstuvwxyzMNOPQRSTUV")  # takes every other block: "efgh" is evicted from the GPU
    settle(tm, eng)
    tm.free("fill")
    req = Request("b", letters("abcdefghj"))
    res = tm.admit(req, req.num_tokens)
    assert res is not None and (res.num_computed_tokens, res.num_loading_tokens) == (4, 4)
    req.num_computed_tokens = res.num_computed_tokens  # the scheduler's job
    eng.complete_all()
    (c,) = [c for c in tm.poll() if c.request_id == "b"]
    # The same meaning as a swap-in's: the progress the request has now, hits and load together.
    assert (c.kind, c.ok, c.num_tokens, c.residency) == (PlanKind.ONBOARD, True, 8, Residency.GPU)


def test_a_swap_in_completion_reports_the_requests_absolute_progress():
    tm, eng = make_tm()
    req = run(tm, "a", "abcdefghi")
    p = tm.preempt("a", "swap")
    assert p is not None and p.plan is not None
    settle(tm, eng)
    res = tm.resume("a")
    assert res is not None and res.plan is not None
    (c,) = settle(tm, eng)
    assert (c.kind, c.ok, c.num_tokens, c.residency) == (PlanKind.SWAP_IN, True, req.num_computed_tokens, Residency.GPU)


# ---------------------------- item 11: the engine is checked against the pools
def _cpu_engine(gpu_name: str, cpu_name: str, gpu_blocks: int, cpu_blocks: int) -> CpuCopyEngine:
    return CpuCopyEngine(
        {gpu_name: KVStorage(SPEC, gpu_blocks, "GPU", device="cpu"), cpu_name: KVStorage(SPEC, cpu_blocks, "CPU")}
    )


@pytest.mark.parametrize(
    ("names", "sizes", "message"),
    [
        (("gpu", "cpu"), (32, 32), r"copy_engine has no 'GPU' tier \(its tiers: \['cpu', 'gpu'\]\)"),
        (("GPU", "cpu"), (32, 32), r"copy_engine has no 'CPU' tier"),
        (("GPU", "CPU"), (8, 32), r"copy_engine's GPU tier holds 8 blocks, fewer than the manager's 32-block GPU pool"),
        (
            ("GPU", "CPU"),
            (32, 16),
            r"copy_engine's CPU tier holds 16 blocks, fewer than the manager's 32-block CPU pool",
        ),
    ],
)
def test_an_engine_that_cannot_execute_the_managers_plans_is_refused_when_the_manager_is_built(names, sizes, message):
    with _cpu_engine(*names, *sizes) as eng, pytest.raises(InvalidArgumentError, match=message) as info:
        TierManager(ManagerConfig(32, 32, 4), eng)
    assert isinstance(info.value, TieredKVError)


def test_an_engine_whose_tiers_fit_is_accepted_and_a_controlled_engine_is_checked_too():
    with _cpu_engine("GPU", "CPU", 32, 40) as eng:
        assert TierManager(ManagerConfig(32, 40, 4), eng).num_layers == 2
        no_cpu = TierManager(ManagerConfig(16, 0, 4), eng)  # no CPU tier: its storage is not needed
        assert not no_cpu.has_cpu_tier and no_cpu.store.capacity == 0  # an empty store stands in for it
    cm = CostModel(kv_bytes_per_token=1024, block_size=4)
    with pytest.raises(InvalidArgumentError, match="copy_engine's GPU tier holds 8 blocks"):
        TierManager(ManagerConfig(32, 32, 4), ControlledCopyEngine({"GPU": 8, "CPU": 32}), cost_model=cm)
    assert TierManager(ManagerConfig(32, 32, 4), ControlledCopyEngine(), cost_model=cm).has_cpu_tier  # unchecked


def test_a_failed_copy_says_why_in_its_completion():
    tm, eng = make_tm()
    run(tm, "a", "abcdefghi")
    p = tm.preempt("a", "swap")
    assert p is not None and p.plan is not None
    eng.fail(p.plan.plan_id, "DMA error")
    (c,) = tm.poll()
    assert (c.kind, c.ok, c.residency, c.error) == (
        PlanKind.SWAP_OUT,
        False,
        Residency.GPU,
        f"TransferError: plan {p.plan.plan_id}: DMA error",
    )
    assert tm.residency("a") is Residency.GPU and tm.counters.plans_failed == 1
    p = tm.preempt("a", "swap")
    assert p is not None and p.plan is not None
    (c,) = settle(tm, eng)
    assert c.ok and c.error is None


# ------------------------------------------------ item 13: counters are live
def test_counters_read_what_happened_without_a_metrics_snapshot():
    tm, eng = make_tm(offload="write_through")
    run(tm, "a", "abcdefghi")  # one write-through store submitted
    assert tm.counters.plans_submitted == 1
    p = tm.preempt("a", "swap")
    assert p is not None and p.plan is not None
    assert tm.counters.plans_submitted == 2 and tm.counters.preemptions_swap == 1
    settle(tm, eng)
    assert tm.counters == tm.metrics().counters


def test_cpu_evictions_are_counted_without_a_metrics_snapshot():
    tm, eng = make_tm(gpu=16, cpu=3, offload="write_through")  # room for two CPU blocks
    for rid, text in (("a", "abcdefghi"), ("b", "mnopqrstu")):
        run(tm, rid, text)
        settle(tm, eng)
    assert tm.counters.cpu_blocks_evicted == 2 == tm.metrics().counters.cpu_blocks_evicted


# -------------------------------------------- item 17: logs keep the last N
def test_the_decision_log_keeps_the_last_n_and_counts_the_rest():
    tm, _ = make_tm(gpu=9, cpu=0, log_size=3)
    for i in range(5):
        run(tm, f"r{i}", "abcdefgh")
        tm.preempt(f"r{i}", "recompute")
    log = tm.decision_log
    assert isinstance(log, BoundedLog) and log.capacity == 3
    assert [d.request_id for d in log] == ["r2", "r3", "r4"] and (len(log), log.total, log.dropped) == (3, 5, 2)
    assert log[0].request_id == "r2" and log[-1].request_id == "r4"
    new, missed = log.since(1)  # a reader that had read one: r1 fell off unread, r2.. are there
    assert [d.request_id for d in new] == ["r2", "r3", "r4"] and missed == 1
    assert log.since(4) == ([log[-1]], 0) and log.since(5) == ([], 0)
    assert tm.metrics().counters.preemptions_recompute == 5  # the counters still count every one


def test_log_size_is_checked_and_none_keeps_everything():
    cm = CostModel(kv_bytes_per_token=1024, block_size=4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="log_size"):
            TierManager(ManagerConfig(9, 0, 4, log_size=bad), ControlledCopyEngine(), cost_model=cm)
    tm, _ = make_tm(gpu=9, cpu=0, log_size=None)
    for i in range(4):
        run(tm, f"r{i}", "abcd")
        tm.preempt(f"r{i}", "recompute")
    assert tm.decision_log.capacity is None and len(tm.decision_log) == 4 and tm.decision_log.dropped == 0
    assert tm.load_log == [] and tm.load_log.capacity is None


# ------------------------------- item 8: what a resume would take, before it is tried
def test_blocks_to_resume_counts_free_cached_hits_and_new_blocks_but_not_shared_hits():
    tm, eng = make_tm(gpu=9, cpu=9)
    req = run(tm, "a", "abcdefghi")  # 9 tokens: blocks "abcd", "efgh" (cached) and a partial tail
    run(tm, "b", "abcdz")  # shares "abcd"
    p = tm.preempt("a", "swap")
    assert p is not None and p.plan is not None
    settle(tm, eng)
    free = tm.num_free_gpu_blocks()
    before = tm_snapshot(tm)
    # "abcd" is held by b (no free block), "efgh" is cached and free (it leaves the free queue), the
    # tail is a new block; a 10th token still fits the tail, the 13th needs a fourth block.
    assert tm.blocks_to_resume("a") == 2 and tm.blocks_to_resume("a", 1) == 2
    assert tm.blocks_to_resume("a", 4) == 3
    assert tm_snapshot(tm) == before
    res = tm.resume("a")
    assert res is not None and tm.num_free_gpu_blocks() == free - 2 and req.num_computed_tokens == 9
    with pytest.raises(InvalidTransitionError):
        tm.blocks_to_resume("a")
