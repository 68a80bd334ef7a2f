"""Misuse of the tier manager: bad arguments, foreign engines, cancels that race, two threads.

Every row of the argument table names a public method and one bad argument; the
call must raise a :class:`TieredKVError` and leave both pools, every request and
every plan exactly as they were.
"""

from __future__ import annotations

import threading

import pytest
from fakekv import FakeKV
from mgrutil import make_tm, run, settle, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import (
    ConcurrentUseError,
    InvalidArgumentError,
    InvalidTransitionError,
    TieredKVError,
    UnknownRequestError,
)
from tiered_kv.manager import CostModel, ManagerConfig, Residency, TierManager
from tiered_kv.transfer import ControlledCopyEngine, TransferHandle, TransferPlan

np = pytest.importorskip("numpy")

BAD_COUNTS = [2.5, True, None, "2", np.int64(2)]
BAD_IDS = [["run"], {"run": 1}, None]


def populated():
    """Requests in every residency: on the GPU, swapping out (in flight), swapped, loading; a CPU prefix tier."""
    tm, eng = make_tm(gpu=13, cpu=21, offload="write_through")
    run(tm, "run", "AAAABBBBCC")
    run(tm, "out", "XXXXYYYYZ")
    run(tm, "sw", "QQQQRRRRS")
    run(tm, "gone", "GGGGHHHHi")
    settle(tm, eng)
    tm.preempt("sw", "swap")
    settle(tm, eng)
    tm.free("gone")
    run(tm, "fill", "f" * 24)  # every free GPU block: evicts gone's prefix; it stays on the CPU
    settle(tm, eng)
    tm.free("fill")
    tm.admit(Request("load", letters("GGGGHHHHj")), 9)  # onboarding from the CPU, left in flight
    tm.preempt("out", "swap")  # left in flight
    return tm, eng


def new_req(text: str = "AAAABBBBGGGGqq") -> Request:
    return Request("new", letters(text))


ROWS: list[tuple[str, object]] = []
for v in BAD_COUNTS:
    ROWS += [
        (f"admit max_new_tokens={v!r}", lambda tm, eng, v=v: tm.admit(new_req(), v)),
        (f"admit num_lookahead_tokens={v!r}", lambda tm, eng, v=v: tm.admit(new_req(), 4, v)),
        (f"allocate num_new_tokens={v!r}", lambda tm, eng, v=v: tm.allocate("run", v)),
        (f"allocate num_lookahead_tokens={v!r}", lambda tm, eng, v=v: tm.allocate("run", 1, v)),
        (f"room num_new_tokens={v!r}", lambda tm, eng, v=v: tm.room("run", v)),
        (f"handle plan_id={v!r}", lambda tm, eng, v=v: tm.handle(v)),
        (f"start_layerwise_store num_tokens_after_step={v!r}", lambda tm, eng, v=v: tm.start_layerwise_store("run", v)),
    ]
for v in BAD_IDS:
    for name in (
        "allocate",
        "on_tokens_computed",
        "quote",
        "preempt",
        "resume",
        "drop_swapped",
        "free",
        "cancel",
        "residency",
        "holds",
        "gpu_block_ids",
        "cpu_block_ids",
        "room",
        "gpu_table_length",
        "quiet_tokens",
        "start_layerwise_store",
    ):
        if name == "room" and v is None:
            continue  # room(None) asks about no request
        args = (v, 1) if name in ("allocate", "room", "start_layerwise_store") else (v,)
        ROWS.append((f"{name} request_id={v!r}", lambda tm, eng, n=name, a=args: getattr(tm, n)(*a)))
    ROWS.append((f"preemption_bounds request_ids=[{v!r}]", lambda tm, eng, v=v: tm.preemption_bounds(["run", v])))
ROWS += [
    ("preemption_bounds request_ids=None", lambda tm, eng: tm.preemption_bounds(None)),
    ("preemption_bounds request_ids='run'", lambda tm, eng: tm.preemption_bounds("run")),
    ("preemption_bounds mode='fast'", lambda tm, eng: tm.preemption_bounds(["run"], "fast")),
    ("preemption_bounds lookups=1", lambda tm, eng: tm.preemption_bounds(["run"], "auto", 1)),
    ("admit request=None", lambda tm, eng: tm.admit(None, 1)),
    ("admit a request id", lambda tm, eng: tm.admit("new", 1)),
    ("preempt mode=''", lambda tm, eng: tm.preempt("run", "")),
    ("preempt mode=True", lambda tm, eng: tm.preempt("run", True)),
    ("preempt mode=None", lambda tm, eng: tm.preempt("run", None)),
    ("process_completion(None)", lambda tm, eng: tm.process_completion(None)),
    ("process_completion(a plan)", lambda tm, eng: tm.process_completion(tm.plans_in_flight()[0])),
    ("wait timeout=-1", lambda tm, eng: tm.wait(-1)),
    ("wait timeout='1'", lambda tm, eng: tm.wait("1")),
    ("wait timeout=nan", lambda tm, eng: tm.wait(float("nan"))),
    ("resume layered=1", lambda tm, eng: tm.resume("sw", 1)),
    ("resume layered=None", lambda tm, eng: tm.resume("sw", None)),
    ("step_computed saves=[None]", lambda tm, eng: tm.step_computed([None])),
    ("step_computed saves=[a plan id]", lambda tm, eng: tm.step_computed([tm.plans_in_flight()[0].plan_id])),
]
TRANSITIONS = [
    ("resume a request on the GPU", InvalidTransitionError, "'run' is gpu, not cpu", lambda tm: tm.resume("run")),
    ("resume mid swap-out", InvalidTransitionError, "'out' is swapping_out, not cpu", lambda tm: tm.resume("out")),
    ("free mid swap-out", InvalidTransitionError, "'out' is swapping_out", lambda tm: tm.free("out")),
    ("free mid onboarding", InvalidTransitionError, "'load' is loading", lambda tm: tm.free("load")),
    ("free an unknown request", UnknownRequestError, "'ghost' is not held", lambda tm: tm.free("ghost")),
    ("admit a held request", InvalidTransitionError, "'sw' is already held", lambda tm: tm.admit(_held("sw"), 1)),
    ("grow a swapped request", InvalidTransitionError, "'sw' is cpu, not gpu", lambda tm: tm.allocate("sw", 1)),
    ("grow a loading request", InvalidTransitionError, "'load' is loading", lambda tm: tm.allocate("load", 1)),
    ("quote a swapped request", InvalidTransitionError, "'sw' is cpu, not gpu", lambda tm: tm.quote("sw")),
    (
        "bound a swapped request",
        InvalidTransitionError,
        "'sw' is cpu, not gpu",
        lambda tm: tm.preemption_bounds(["run", "sw"]),
    ),
    (
        "bound an unknown request",
        UnknownRequestError,
        "'ghost' is not held",
        lambda tm: tm.preemption_bounds(["ghost"]),
    ),
    ("preempt a swapped request", InvalidTransitionError, "'sw' is cpu", lambda tm: tm.preempt("sw", "swap")),
    ("preempt mid swap-out", InvalidTransitionError, "'out' is swapping_out", lambda tm: tm.preempt("out")),
    ("drop a running request's swap", InvalidTransitionError, "'run' is gpu", lambda tm: tm.drop_swapped("run")),
    (
        "admit a request with computed tokens",
        InvalidArgumentError,
        "has no computed tokens",
        lambda tm: tm.admit(_with_progress(), 1),
    ),
]


def _held(rid: str) -> Request:
    return Request(rid, letters("QQQQRRRRS"))


def _with_progress() -> Request:
    r = new_req()
    r.num_computed_tokens = 4
    return r


@pytest.mark.parametrize(("name", "action"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_argument_raises_and_changes_nothing(name, action):
    tm, eng = populated()
    before = tm_snapshot(tm)
    pending = eng.pending_ids()
    with pytest.raises(TieredKVError):
        action(tm, eng)
    assert tm_snapshot(tm) == before, f"{name}: state changed"
    assert eng.pending_ids() == pending
    tm.check_invariants()


@pytest.mark.parametrize(("name", "exc", "message", "action"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_impossible_transition_raises_and_changes_nothing(name, exc, message, action):
    tm, _eng = populated()
    before = tm_snapshot(tm)
    with pytest.raises(exc, match=message) as info:
        action(tm)
    assert isinstance(info.value, TieredKVError)
    assert tm_snapshot(tm) == before, f"{name}: state changed"
    tm.check_invariants()


def test_resume_that_does_not_fit_returns_none_and_changes_nothing():
    tm, eng = make_tm(gpu=5, cpu=9)
    run(tm, "A", "AAAABBBBC")
    tm.preempt("A", "swap")
    settle(tm, eng)
    tm.admit(Request("F", letters("f" * 16)), 16)  # every GPU block, evicting A's cache
    before = tm_snapshot(tm)
    assert tm.resume("A") is None
    assert tm_snapshot(tm) == before


def test_a_cost_model_for_another_kv_shape_is_refused():
    from engineutil import SPEC, tiers

    from tiered_kv.manager import CostModel
    from tiered_kv.transfer.cpu_engine import CpuCopyEngine

    with CpuCopyEngine(tiers("block_contiguous")) as copy:
        wrong = CostModel(kv_bytes_per_token=128 * 1024, block_size=SPEC.block_size)  # Llama-3-8B's, not SPEC's
        with pytest.raises(InvalidArgumentError, match="built for 131072 KV bytes per token, but the storage"):
            TierManager(ManagerConfig(16, 16, SPEC.block_size), copy, cost_model=wrong)
        tm = TierManager(ManagerConfig(16, 16, SPEC.block_size), copy)  # sizes from the engine's KV spec
        assert tm.cost_model.kv_bytes_per_token == SPEC.bytes_per_token
    with pytest.raises(InvalidArgumentError, match="will not guess KV sizes"):
        TierManager(ManagerConfig(8, 8, 4), ControlledCopyEngine())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_cpu_blocks": 2.0}, "num_cpu_blocks must be 0 or an int >= 2"),
        ({"num_cpu_blocks": 1}, "num_cpu_blocks must be 0 or an int >= 2"),
        ({"num_gpu_blocks": True}, "num_gpu_blocks must be an int >= 2"),
        ({"num_gpu_blocks": 0}, "num_gpu_blocks must be an int >= 2"),
        ({"block_size": 4.0}, "block_size must be a positive int"),
        ({"block_size": -16}, "block_size must be a positive int"),
        ({"offload": None}, "offload must be one of"),
        ({"offload": "always"}, "offload must be one of"),
        ({"offload": "on_evict"}, "offload must be one of .*'on_evict' is now 'write_back'"),
        ({"store_policy": "fifo"}, "policy"),
        ({"enable_caching": 0}, "enable_caching must be True or False"),
        ({"enable_caching": False, "offload": "write_through"}, "needs prefix caching"),
        ({"evict_window": 0}, "evict_window must be an int > 0"),
        ({"hash_fn": "md5"}, "unknown hash function"),
        ({"hash_seed": -1}, "hash_seed must be an int >= 0"),
        ({"copy_engine": object()}, "copy_engine must have submit"),
        ({"cost_model": {"kv_bytes_per_token": 1}}, "cost_model must be a CostModel"),
        ({"cost_model": CostModel(kv_bytes_per_token=8, block_size=16)}, "block_size 16 != manager block_size 4"),
    ],
)
def test_bad_construction(kwargs, message):
    args = {
        "num_gpu_blocks": 8,
        "num_cpu_blocks": 8,
        "block_size": 4,
        "copy_engine": ControlledCopyEngine(),
        "cost_model": CostModel(kv_bytes_per_token=8, block_size=4),
    }
    args.update(kwargs)
    collaborators = {k: args.pop(k) for k in ("copy_engine", "cost_model")}
    with pytest.raises(InvalidArgumentError, match=message):
        TierManager(ManagerConfig(**args), collaborators["copy_engine"], cost_model=collaborators["cost_model"])


@pytest.mark.parametrize("bad", [2.5, np.int64(4)])
def test_admit_with_a_bad_count_leaves_no_phantom_entry_and_no_pinned_cpu_block(bad):
    """The count is checked before the entry is inserted and the CPU prefix hits are pinned."""
    tm, eng = make_tm(gpu=9, cpu=17, offload="write_through")
    run(tm, "P", "AAAABBBBC")
    settle(tm, eng)
    tm.free("P")
    run(tm, "F", "f" * 32)  # every GPU block: P's prefix now lives on the CPU only
    tm.free("F")
    settle(tm, eng)
    req = Request("Q", letters("AAAABBBBq"))
    before = tm_snapshot(tm)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be an int > 0"):
        tm.admit(req, bad)
    assert tm_snapshot(tm) == before
    assert not tm.holds("Q")
    res = tm.admit(req, 9)  # and the retry is not refused as "already held"
    assert (res.num_computed_tokens, res.num_loading_tokens) == (0, 8)
    settle(tm, eng)
    tm.free("Q")
    assert tm.store.num_pinned == 0  # no CPU block stays pinned


def test_caching_off_is_a_working_configuration():
    """Nothing is hashed or cached in either tier, and swaps round-trip through later allocations."""
    tm, eng = make_tm(gpu=9, cpu=9, enable_caching=False)
    kv = FakeKV()
    eng.on_complete = kv.copy
    reqs = {}

    def computed(rid, text):
        req = Request(rid, letters(text))
        res = tm.admit(req, req.num_tokens)
        assert res.runnable and res.num_computed_tokens == 0
        kv.compute(tm, req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        reqs[rid] = req
        return req

    a = computed("A", "AAAABBBBCC")
    computed("B", "AAAABBBBCC")  # the same prompt: no prefix hit with caching off
    assert tm.gpu_block_ids("B") == [4, 5, 6]
    tm.preempt("A", "swap")
    settle(tm, eng)
    assert tm.residency("A") is Residency.CPU and tm.cpu_block_ids("A") == [1, 2, 3]
    tm.free("B")
    computed("C", "c" * 20)  # every GPU block is reused
    tm.free("C")
    res = tm.resume("A")
    assert res.plan is not None and res.num_tokens == 10
    (c,) = settle(tm, eng)
    assert c.ok and c.num_tokens == 10 and tm.residency("A") is Residency.GPU
    kv.check(tm, reqs)
    a.append_output_token_ids(letters("DD"))
    assert tm.allocate("A", 2) is not None  # caching the now-full block would have raised
    a.num_computed_tokens = 12
    tm.preempt("A", "swap")
    settle(tm, eng)
    assert tm.resume("A") is not None
    settle(tm, eng)
    assert tm.residency("A") is Residency.GPU
    assert all(b.block_hash is None for b in tm.gpu.block_pool.blocks), "a GPU block was hashed with caching off"
    assert not any(isinstance(e.key, bytes) for e in tm.store.entries())
    tm.free("A")
    assert tm.store.num_used == 0  # private blocks are dropped with their request
    tm.check_invariants()


class RaisingEngine(ControlledCopyEngine):
    """A third-party engine that fails in its own way when asked to copy."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.broken = True

    def submit(self, plan: TransferPlan) -> TransferHandle:
        if self.broken:
            raise OSError("DMA engine is gone")
        return super().submit(plan)

    def cancel(self, handle: TransferHandle) -> bool:
        if self.broken:
            raise OSError("DMA engine is gone")
        return super().cancel(handle)


def test_an_engine_raising_anything_is_a_failed_copy_and_rolls_back():
    eng = RaisingEngine({"GPU": 9, "CPU": 9})
    tm = TierManager(ManagerConfig(9, 9, 4), eng, cost_model=CostModel(kv_bytes_per_token=8, block_size=4))
    eng.broken = False
    run(tm, "A", "AAAABBBBCC")
    eng.broken = True
    before_gpu = tm.gpu_block_ids("A")
    tm.preempt("A", "swap")  # submit raises OSError: no exception escapes
    assert tm.cancel("A") is False  # the engine's cancel raises too; the copy had failed, not been cancelled
    (c,) = tm.poll()
    assert not c.ok
    assert tm.residency("A") is Residency.GPU and tm.gpu_block_ids("A") == before_gpu
    cnt = tm.metrics().counters
    assert (cnt.plans_failed, cnt.swap_out_blocks) == (1, 0)
    tm.check_invariants()
    eng.broken = False  # the request is still whole: a later swap works
    tm.preempt("A", "swap")
    settle(tm, eng)
    assert tm.residency("A") is Residency.CPU
    eng.broken = True
    tm.resume("A")  # the swap-in's submit raises: the request stays swapped, resumable
    (done,) = tm.poll()
    assert not done.ok and tm.residency("A") is Residency.CPU and tm.cpu_block_ids("A") == [4, 5, 6]
    eng.broken = False
    tm.resume("A")
    settle(tm, eng)
    assert tm.residency("A") is Residency.GPU
    tm.check_invariants()


def test_cancel_of_a_copy_the_engine_already_finished_says_false_and_poll_commits_it():
    tm, eng = make_tm()
    run(tm, "A", "AAAABBBBCC")
    tm.preempt("A", "swap")
    (plan,) = tm.plans_in_flight()
    eng.complete(plan.plan_id)  # finished on the engine's side; the manager has not polled yet
    assert tm.cancel("A") is False
    (c,) = tm.poll()
    assert c.ok and tm.residency("A") is Residency.CPU and tm.plans_in_flight() == []
    assert tm.metrics().counters.plans_cancelled == 0
    tm.check_invariants()


def test_cancel_true_means_rolled_back():
    tm, _eng = make_tm()
    run(tm, "A", "AAAABBBBCC")
    tm.preempt("A", "swap")
    assert tm.cancel("A") is True
    assert tm.residency("A") is Residency.GPU and tm.metrics().counters.plans_cancelled == 1


class GatedEngine(ControlledCopyEngine):
    """``submit`` waits for the test: a thread is then inside the manager for as long as the test likes."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.entered = threading.Event()
        self.release = threading.Event()

    def submit(self, plan: TransferPlan) -> TransferHandle:
        self.entered.set()
        assert self.release.wait(10)
        return super().submit(plan)


def test_a_second_thread_entering_is_refused_with_a_clear_error():
    eng = GatedEngine({"GPU": 9, "CPU": 9})
    tm = TierManager(ManagerConfig(9, 9, 4), eng, cost_model=CostModel(kv_bytes_per_token=8, block_size=4))
    eng.release.set()
    run(tm, "A", "AAAABBBBCC")
    run(tm, "B", "XXXX")
    eng.release.clear()
    eng.entered.clear()
    worker = threading.Thread(target=tm.preempt, args=("A", "swap"))
    worker.start()
    assert eng.entered.wait(10)  # the worker is inside preempt, in the engine's submit
    calls = (
        lambda: tm.residency("B"),
        lambda: tm.allocate("B", 1),
        lambda: tm.quiet_tokens("B"),
        lambda: tm.gpu_table_length("B"),
        lambda: tm.poll(),
        lambda: tm.free("B"),
    )
    for call in calls:
        with pytest.raises(ConcurrentUseError, match="single-threaded"):
            call()
    eng.release.set()
    worker.join(10)
    assert tm.quiet_tokens("B") == 4  # one full, cached block: the 5th token needs a new one
    assert tm.residency("A") is Residency.SWAPPING_OUT and tm.residency("B") is Residency.GPU
    settle(tm, eng)
    tm.check_invariants()


def test_copy_engine_threads_complete_handles_while_the_owner_polls():
    """Completions arrive on engine threads; the owning thread's poll sees each exactly once."""
    from engineutil import SPEC, tiers

    from tiered_kv.transfer.cpu_engine import CpuCopyEngine

    t = tiers("block_contiguous", gpu_blocks=33, cpu_blocks=65)
    with CpuCopyEngine(t, max_blocks_per_chunk=1) as copy:
        tm = TierManager(ManagerConfig(33, 65, SPEC.block_size), copy)
        for i in range(8):
            r = Request(i, list(range(100 * i, 100 * i + 14)))
            assert tm.admit(r, 14).runnable
            r.num_computed_tokens = 14
        settled = []
        for i in range(8):
            tm.preempt(i, "swap")
            settled += tm.poll()
        while tm.plans_in_flight():
            settled += tm.poll()
        assert sorted(c.request_id for c in settled) == list(range(8))
        assert all(tm.residency(i) is Residency.CPU for i in range(8))
        tm.check_invariants()
