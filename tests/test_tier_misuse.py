"""Misuse of the tier manager: bad arguments, foreign engines, cancels that race, two threads.

Every row of the argument table names a public method and one bad argument; the
call must raise a :class:`TieredKVError` and leave both pools, every request and
every plan exactly as they were.
"""

from __future__ import annotations

import threading

import pytest
from fakekv import FakeKV
from mgrutil import make_tm, run, tm_snapshot
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.errors import ConcurrentUseError, InvalidArgumentError, TieredKVError
from tiered_kv.manager import RequestState, TierManager
from tiered_kv.transfer import ControlledCopyEngine, TransferHandle, TransferPlan

np = pytest.importorskip("numpy")

BAD_COUNTS = [2.5, True, None, "2", np.int64(2)]
BAD_IDS = [["run"], {"run": 1}, None]


def populated():
    """Requests in every state: running, swapping out (in flight), swapped, preempted; a CPU prefix tier."""
    tm, eng = make_tm(gpu=13, cpu=11, offload="write_through")
    run(tm, "run", "AAAABBBBCC")
    run(tm, "out", "XXXXYYYYZ")
    run(tm, "sw", "QQQQRRRRS")
    eng.complete_all()
    tm.poll()
    tm.preempt_request("sw", "swap")
    eng.complete_all()
    tm.poll()
    tm.preempt_request("out", "swap")  # left in flight
    run(tm, "pre", "PPPP")
    tm.preempt_request("pre", "recompute")
    return tm, eng


def new_req(text: str = "AAAABBBBCCCCqq") -> Request:
    return Request("new", letters(text))  # AAAA BBBB hit the GPU, CCCC the CPU


ROWS: list[tuple[str, object]] = []
for v in BAD_COUNTS:
    ROWS += [
        (f"admit num_new_tokens={v!r}", lambda tm, eng, v=v: tm.admit(new_req(), v)),
        (f"admit num_lookahead_tokens={v!r}", lambda tm, eng, v=v: tm.admit(new_req(), 4, v)),
        (f"allocate num_new_tokens={v!r}", lambda tm, eng, v=v: tm.allocate("run", v)),
        (f"allocate num_lookahead_tokens={v!r}", lambda tm, eng, v=v: tm.allocate("run", 1, v)),
        (f"preempt num_blocks_needed={v!r}", lambda tm, eng, v=v: tm.preempt(v)),
        (f"handle plan_id={v!r}", lambda tm, eng, v=v: tm.handle(v)),
    ]
for v in BAD_IDS:
    for name in (
        "allocate",
        "mark_scheduled",
        "on_tokens_computed",
        "quote",
        "preempt_request",
        "resume",
        "drop_swapped",
        "finish",
        "cancel",
        "state",
        "is_runnable",
        "gpu_block_ids",
        "cpu_block_ids",
    ):
        args = (v, 1) if name == "allocate" else (v,)
        ROWS.append((f"{name} request_id={v!r}", lambda tm, eng, n=name, a=args: getattr(tm, n)(*a)))
ROWS += [
    ("admit request=None", lambda tm, eng: tm.admit(None, 1)),
    ("admit a request id", lambda tm, eng: tm.admit("new", 1)),
    ("preempt policy=3", lambda tm, eng: tm.preempt(1, policy=3)),
    ("preempt policy='random'", lambda tm, eng: tm.preempt(1, policy="random")),
    ("preempt mode=''", lambda tm, eng: tm.preempt(1, mode="")),
    ("preempt mode=True", lambda tm, eng: tm.preempt(1, mode=True)),
    ("preempt exclude='run'", lambda tm, eng: tm.preempt(1, exclude="run")),
    ("preempt exclude=[['run']]", lambda tm, eng: tm.preempt(1, exclude=[["run"]])),
    ("preempt exclude=5", lambda tm, eng: tm.preempt(1, exclude=5)),
    ("preempt_request mode='auto'", lambda tm, eng: tm.preempt_request("run", "auto")),
    ("preempt_request mode=None", lambda tm, eng: tm.preempt_request("run", None)),
    ("process_completion(None)", lambda tm, eng: tm.process_completion(None)),
    ("process_completion(a plan)", lambda tm, eng: tm.process_completion(tm.plans_in_flight()[0])),
    ("wait_all timeout=-1", lambda tm, eng: tm.wait_all(-1)),
    ("wait_all timeout='1'", lambda tm, eng: tm.wait_all("1")),
    ("wait_all timeout=nan", lambda tm, eng: tm.wait_all(float("nan"))),
    ("requests state='running'", lambda tm, eng: tm.requests("running")),
]


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_cpu_blocks": 2.0}, "num_cpu_blocks must be 0 or an int >= 2"),
        ({"num_gpu_blocks": True}, "num_blocks must be an int >= 2"),
        ({"block_size": 4.0}, "block_size must be a positive int"),
        ({"mode": ""}, "mode must be one of"),
        ({"mode": None}, "mode must be one of"),
        ({"offload": None}, "offload must be one of"),
        ({"policy": None}, "policy must be a policy name or a VictimPolicy"),
        ({"policy": "random"}, "unknown victim policy"),
        ({"enable_caching": 0}, "enable_caching must be True or False"),
        ({"enable_caching": False, "offload": "write_through"}, "needs prefix caching"),
        ({"evict_window": 0}, "evict_window must be an int > 0"),
        ({"hash_fn": "md5"}, "unknown hash function"),
        ({"hash_seed": -1}, "hash_seed must be an int >= 0"),
        ({"copy_engine": object()}, "copy_engine must have submit"),
        ({"cost_model": {"kv_bytes_per_token": 1}}, "cost_model must be a CostModel"),
    ],
)
def test_bad_construction(kwargs, message):
    args = {"num_gpu_blocks": 8, "num_cpu_blocks": 8, "block_size": 4, "copy_engine": ControlledCopyEngine()}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=message):
        TierManager(**args)


@pytest.mark.parametrize("bad", [2.5, np.int64(4)])
def test_admit_with_a_bad_count_leaves_no_phantom_entry_and_no_held_cpu_block(bad):
    """The count is checked before the entry is inserted and the CPU prefix hits are touched."""
    tm, eng = make_tm(gpu=9, cpu=17, offload="write_through")
    run(tm, "P", "AAAABBBBC")
    eng.complete_all()
    tm.poll()
    tm.finish("P")
    run(tm, "F", "f" * 32)  # every GPU block: P's prefix now lives on the CPU only
    tm.finish("F")
    eng.complete_all()
    tm.poll()
    req = Request("Q", letters("AAAABBBBq"))
    before = tm_snapshot(tm)
    with pytest.raises(InvalidArgumentError, match="num_new_tokens must be an int > 0"):
        tm.admit(req, bad)
    assert tm_snapshot(tm) == before
    assert "Q" not in tm.requests()
    res = tm.admit(req, 9)  # and the retry is not refused as "already running"
    assert (res.num_gpu_hit_tokens, res.num_cpu_hit_tokens) == (0, 8)
    eng.complete_all()
    tm.poll()
    tm.finish("Q")
    assert tm.cpu_pool.get_num_free_blocks() == 16  # no CPU block leaked


def test_caching_off_is_a_working_configuration():
    """Nothing is hashed or cached in either tier, and swaps round-trip through later allocations."""
    tm, eng = make_tm(gpu=9, cpu=9, enable_caching=False)
    kv = FakeKV()
    eng.on_complete = kv.copy

    def computed(rid, text):
        req = Request(rid, letters(text))
        res = tm.admit(req, req.num_tokens)
        assert res.runnable and res.num_gpu_hit_tokens == 0
        kv.compute(tm, rid, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        return req

    a = computed("A", "AAAABBBBCC")
    computed("B", "AAAABBBBCC")  # the same prompt: no prefix hit with caching off
    assert tm.gpu_block_ids("B") == [4, 5, 6]
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    assert tm.state("A") is RequestState.SWAPPED and tm.cpu_block_ids("A") == [1, 2, 3]
    tm.finish("B")
    computed("C", "c" * 20)  # every GPU block is reused
    tm.finish("C")
    res = tm.resume("A")
    assert res.plan is not None and res.num_restored_tokens == 10
    eng.complete_all()
    tm.poll()
    assert tm.is_runnable("A") and a.num_computed_tokens == 10
    kv.check(tm)
    a.append_output_token_ids(letters("DD"))
    assert tm.allocate("A", 2) is not None  # caching the now-full block would have raised
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    assert tm.resume("A") is not None
    eng.complete_all()
    tm.poll()
    assert tm.is_runnable("A")
    for pool in (tm.gpu_pool, tm.cpu_pool):
        assert all(b.block_hash is None for b in pool.blocks), "something was hashed with caching off"
    tm.finish("A")
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
    tm = TierManager(9, 9, 4, eng)
    eng.broken = False
    run(tm, "A", "AAAABBBBCC")
    eng.broken = True
    before_gpu = tm.gpu_block_ids("A")
    tm.preempt_request("A", "swap")  # submit raises OSError: no exception escapes
    assert tm.cancel("A") is False  # the engine's cancel raises too; the plan had failed, not been cancelled
    assert tm.state("A") is RequestState.RUNNING and tm.gpu_block_ids("A") == before_gpu
    c = tm.metrics().counters
    assert (c.plans_failed, c.swap_out_blocks) == (1, 0)
    tm.check_invariants()
    eng.broken = False  # the request is still whole: a later swap works
    tm.preempt_request("A", "swap")
    eng.complete_all()
    tm.poll()
    assert tm.state("A") is RequestState.SWAPPED
    eng.broken = True
    tm.resume("A")  # the swap-in's submit raises: the request stays swapped, resumable
    (done,) = tm.poll()
    assert not done.ok and tm.state("A") is RequestState.SWAPPED and tm.cpu_block_ids("A") == [1, 2, 3]
    eng.broken = False
    tm.resume("A")
    eng.complete_all()
    tm.poll()
    assert tm.is_runnable("A")
    tm.check_invariants()


def test_cancel_of_a_plan_the_engine_already_finished_says_false_and_commits():
    tm, eng = make_tm()
    run(tm, "A", "AAAABBBBCC")
    tm.preempt_request("A", "swap")
    (plan,) = tm.plans_in_flight()
    eng.complete(plan.plan_id)  # finished on the engine's side; the manager has not polled yet
    assert tm.cancel("A") is False
    assert tm.state("A") is RequestState.SWAPPED and tm.plans_in_flight() == []
    assert tm.metrics().counters.plans_cancelled == 0
    tm.check_invariants()


def test_cancel_true_means_rolled_back():
    tm, _eng = make_tm()
    run(tm, "A", "AAAABBBBCC")
    tm.preempt_request("A", "swap")
    assert tm.cancel("A") is True
    assert tm.state("A") is RequestState.RUNNING and tm.metrics().counters.plans_cancelled == 1


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
    tm = TierManager(9, 9, 4, eng)
    eng.release.set()
    run(tm, "A", "AAAABBBBCC")
    run(tm, "B", "XXXX")
    eng.release.clear()
    worker = threading.Thread(target=tm.preempt_request, args=("A", "swap"))
    worker.start()
    assert eng.entered.wait(10)  # the worker is inside preempt_request, in the engine's submit
    for call in (lambda: tm.state("B"), lambda: tm.allocate("B", 1), lambda: tm.poll(), lambda: tm.finish("B")):
        with pytest.raises(ConcurrentUseError, match="single-threaded"):
            call()
    eng.release.set()
    worker.join(10)
    assert tm.state("A") is RequestState.SWAPPING_OUT and tm.state("B") is RequestState.RUNNING
    eng.complete_all()
    tm.poll()
    tm.check_invariants()


def test_copy_engine_threads_complete_handles_while_the_owner_polls():
    """Completions arrive on engine threads; the owning thread's poll sees each exactly once."""
    import torch  # noqa: F401  (the CPU engine needs torch)
    from engineutil import SPEC, tiers

    from tiered_kv.manager import CostModel
    from tiered_kv.transfer.cpu_engine import CpuCopyEngine

    t = tiers("block_contiguous", gpu_blocks=33, cpu_blocks=65)
    cm = CostModel(kv_bytes_per_token=SPEC.bytes_per_token, block_size=SPEC.block_size)
    with CpuCopyEngine(t, max_blocks_per_chunk=1) as copy:
        tm = TierManager(33, 65, SPEC.block_size, copy, cost_model=cm)
        reqs = []
        for i in range(8):
            r = Request(i, list(range(100 * i, 100 * i + 14)))
            assert tm.admit(r, 14).runnable
            r.num_computed_tokens = 14
            reqs.append(r)
        settled = []
        for r in reqs:
            tm.preempt_request(r.request_id, "swap")
            settled += tm.poll()
        while tm.plans_in_flight():
            settled += tm.poll()
        assert sorted(c.request_id for c in settled) == list(range(8))
        assert all(tm.state(i) is RequestState.SWAPPED for i in range(8))
        tm.check_invariants()
