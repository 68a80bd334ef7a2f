"""Skipping allocations that change nothing: the manager's fact, and the same decisions with or without the skip."""

from __future__ import annotations

import hashlib

import pytest
from mgrutil import make_tm, run, settle
from plain_path import PlainPathTierManager
from poolutil import admit, letters, manager_snapshot, pool_snapshot
from simutil import config
from test_scheduler import drive, four, make

from tiered_kv.core import BlockStored, KVCacheManager, Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, UnknownRequestError
from tiered_kv.manager import ManagerConfig, TierManager
from tiered_kv.sched import SchedulerConfig
from tiered_kv.sim.config import setup
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate


# ------------------------------------------------------------- KVCacheManager.num_quiet_tokens
def test_quiet_tokens_stop_one_short_of_filling_the_next_uncached_block():
    mgr = KVCacheManager(10, 4, hash_fn="sha256")
    req = admit(mgr, "a", "abcdef")  # 6 tokens: block 1 full and cached, block 2 holds 2 of 4
    assert [len(mgr.get_blocks("a")), mgr.num_cached_block["a"]] == [2, 1]
    # The 7th token lands in block 2 and fills nothing; the 8th fills (and so caches) block 2.
    assert mgr.num_quiet_tokens("a") == 7
    # Caching delayed (KV still landing): only the room in the table counts.
    assert mgr.num_quiet_tokens("a", delay_cache_blocks=True) == 8
    req.append_output_token_ids(letters("g"))
    before = manager_snapshot(mgr)
    assert mgr.allocate_slots(req, 1) == []  # 6 + 1 <= 7: nothing at all changes
    assert manager_snapshot(mgr) == before
    req.num_computed_tokens = 7
    req.append_output_token_ids(letters("h"))
    assert mgr.allocate_slots(req, 1) == []  # 7 + 1 > 7: no new block, but block 2 is cached now
    assert mgr.num_cached_block["a"] == 2 and manager_snapshot(mgr) != before
    assert mgr.num_quiet_tokens("a") == 8  # full table: the next token needs a block
    req.num_computed_tokens = 8
    req.append_output_token_ids(letters("i"))
    new = mgr.allocate_slots(req, 1)
    assert new is not None and len(new) == 1
    assert mgr.num_quiet_tokens("a") == 11  # block 3 holds token 9; 12 would fill it


def test_quiet_tokens_without_caching_are_the_room_in_the_table():
    mgr = KVCacheManager(10, 4, enable_caching=False)
    admit(mgr, "a", "abcdef")
    assert mgr.num_quiet_tokens("a") == 8


def test_quiet_tokens_are_zero_without_a_table_or_with_a_length_cap():
    mgr = KVCacheManager(10, 4, hash_fn="sha256")
    assert mgr.num_quiet_tokens("nobody") == 0
    capped = KVCacheManager(10, 4, hash_fn="sha256", max_model_len=64)
    admit(capped, "a", "abcdef")
    assert capped.num_quiet_tokens("a") == 0  # the cap is applied per call: never skip one


@pytest.mark.parametrize(
    ("args", "message"),
    [((["a"],), "request_id"), ((None,), "request_id"), (("a", 1), "delay_cache_blocks")],
)
def test_quiet_tokens_refuse_bad_arguments_and_change_nothing(args, message):
    mgr = KVCacheManager(10, 4, hash_fn="sha256")
    admit(mgr, "a", "abcdef")
    before = manager_snapshot(mgr)
    with pytest.raises(InvalidArgumentError, match=message):
        mgr.num_quiet_tokens(*args)
    assert manager_snapshot(mgr) == before


def test_quiet_limit_holds_for_every_token_count_up_to_it_and_not_one_past():
    """The invariant itself, checked exhaustively on a small table: at or below the limit nothing changes."""
    for prompt_len in range(1, 13):
        for caching in (True, False):
            mgr = KVCacheManager(12, 4, enable_caching=caching, hash_fn="sha256")
            req = admit(mgr, "a", "abcdefghijklm"[:prompt_len])
            limit = mgr.num_quiet_tokens("a")
            assert limit >= req.num_computed_tokens
            before = manager_snapshot(mgr)
            for n in range(1, limit - req.num_computed_tokens + 1):
                assert mgr.allocate_slots(req, n) == []
                assert manager_snapshot(mgr) == before
            req.append_output_token_ids(letters("z" * 8))
            assert mgr.allocate_slots(req, limit - req.num_computed_tokens + 1) is not None
            assert manager_snapshot(mgr) != before  # one past the limit: a block is taken or cached


# ------------------------------------------------------------------- the pool's one-block path
def test_caching_one_block_queues_the_same_event_as_the_general_path():
    events = []
    for as_tuple in (False, True):  # a tuple table takes the general path
        mgr = KVCacheManager(10, 4, hash_fn="sha256", enable_kv_cache_events=True, medium="GPU")
        req = admit(mgr, "a", "abcdefg")
        mgr.take_events()
        req.append_output_token_ids(letters("h"))
        mgr.hasher.update(req)
        table = mgr.get_blocks("a")
        mgr.block_pool.cache_full_blocks(req, tuple(table) if as_tuple else list(table), 1, 2, 4)
        events.append(mgr.take_events())
    assert events[0] == events[1]
    ev = events[0][0]
    assert isinstance(ev, BlockStored)
    assert (ev.token_ids, ev.block_size, ev.medium) == (letters("efgh"), 4, "GPU")


# ---------------------------------------------------------------------- the TierManager's facts
def test_tier_manager_quiet_tokens_and_block_count():
    tm, eng = make_tm(gpu=9, cpu=9)
    req = run(tm, "a", "abcdef")
    assert tm.quiet_tokens("a") == 7
    assert tm.gpu_table_length("a") == len(tm.gpu_block_ids("a")) == 2
    req.append_output_token_ids(letters("g"))
    before = pool_snapshot(tm.gpu.block_pool)
    assert tm.allocate("a", 1) == []
    assert pool_snapshot(tm.gpu.block_pool) == before
    tm.poll()  # the next step, before "a" is batched again (a request batched in its step is no victim)
    p = tm.preempt("a", "swap")
    assert p is not None
    settle(tm, eng)
    with pytest.raises(InvalidTransitionError, match="cpu"):
        tm.quiet_tokens("a")  # swapped out: allocate would refuse it too
    assert tm.gpu_table_length("a") == 0
    with pytest.raises(UnknownRequestError):
        tm.quiet_tokens("nobody")
    with pytest.raises(UnknownRequestError):
        tm.gpu_table_length("nobody")


# ------------------------------------------------------------------------ same decisions, both paths
def test_a_manager_that_reports_nothing_quiet_is_asked_every_allocation():
    """The plain path really is plain: every running request scheduled is allocated, where the fast path skips."""
    calls, scheduled = {}, {}
    for base in (TierManager, PlainPathTierManager):

        class Counting(base):  # type: ignore[misc, valid-type]
            allocations = 0

            def grow(self, request_id, num_new_tokens):
                type(self).allocations += 1
                return super().grow(request_id, num_new_tokens)

        s, eng = make(gpu=40, manager_class=Counting, mode="recompute")
        four(s)
        log = drive(s, eng, steps=200)
        calls[base] = Counting.allocations
        scheduled[base] = sum(1 for batch, _, admitted in log for rid, _ in batch if rid not in admitted)
    assert calls[PlainPathTierManager] == scheduled[PlainPathTierManager]  # admissions go through admit
    assert calls[TierManager] < calls[PlainPathTierManager]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("gpu", [9, 13, 40])
def test_scheduler_decides_the_same_with_and_without_skipping(mode, gpu):
    logs = []
    for manager_class in (TierManager, PlainPathTierManager):
        s, eng = make(gpu=gpu, cpu=16 if mode != "recompute" else 0, mode=mode, manager_class=manager_class)
        four(s)
        s.add_request(Request("E", [7] * 5, max_tokens=20, arrival_time=4.0))
        logs.append((drive(s, eng, steps=200), s.tm.metrics().counters))
    assert logs[0] == logs[1]
    assert any(pre for _, pre, _ in logs[0][0]) or gpu == 40  # the small pools do preempt


def _trace(cfg: dict, index: int, fast: bool) -> tuple[str, dict]:
    manager_class = TierManager if fast else PlainPathTierManager
    sim = Simulator(
        setup(cfg, index), generate(cfg["workload"], cfg["seed"]), record_trace=True, manager_class=manager_class
    )
    res = sim.run()
    assert sim.loop.trace
    return hashlib.sha256(repr(sim.loop.trace).encode()).hexdigest(), res


@pytest.mark.parametrize("copies", ["async", "blocking", "layerwise"])
def test_simulator_event_trace_is_identical_on_the_fast_and_the_plain_path(copies):
    runs = [
        {
            "name": "recompute",
            "victim_policy": "last_admitted",
            "mode": "recompute",
            "offload": "none",
            "cpu_kv_gib": 0,
        },
        {"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none", "copies": copies},
        {"name": "auto", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through", "copies": copies},
    ]
    cfg = config(
        workload__num_requests=24,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 3, "high": 13},
        workload__output_len={"dist": "uniform", "low": 2, "high": 14},
        scheduler__max_num_batched_tokens=16,
        runs=runs,
    )
    for i in range(len(runs)):
        fast, plain = _trace(cfg, i, True), _trace(cfg, i, False)
        assert fast == plain
        assert fast[1]["requests_finished"] == 24


def _random_run(seed: int, skip: bool, mode: str, layerwise: bool) -> list:
    """A random workload with arrivals, aborts and copies landing late, driven step by step; the whole log."""
    import random

    from tiered_kv.manager import CostModel
    from tiered_kv.sched import Scheduler
    from tiered_kv.storage.spec import KVSpec
    from tiered_kv.transfer import ControlledCopyEngine

    rng = random.Random(seed)
    gpu, cpu = rng.choice([9, 13, 21]), 24 if mode != "recompute" else 0
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)})
    spec = KVSpec(3, 1, 2, "float32", 4)  # 48 bytes of KV per token
    cm = CostModel(kv_bytes_per_token=spec.bytes_per_token, block_size=4, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    manager_class = TierManager if skip else PlainPathTierManager
    tm = manager_class(ManagerConfig(gpu, cpu, 4), eng, cost_model=cm, kv_spec=spec if layerwise else None)
    config = SchedulerConfig(max_num_batched_tokens=rng.choice([6, 16, 64]), mode=mode, layerwise=layerwise)
    s = Scheduler(tm, config)
    log: list = []
    n = 0
    for step in range(400):
        if n < 12 and rng.random() < 0.3:
            s.add_request(
                Request(n, [rng.randrange(5) for _ in range(rng.randint(1, 14))], max_tokens=rng.randint(1, 12))
            )
            n += 1
        if s.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(s.requests))
            s.abort(victim)
            log.append(("abort", victim))
        if rng.random() < 0.5:
            eng.complete_all()
        out = s.schedule()
        log.append(([(r.request_id, k) for r, k in out.scheduled], out.preempted, out.resumed, out.admitted))
        if out.loads:  # the step waits for every layer it reads: let the copies land first
            eng.complete_all()
        done = s.update(out, {r.request_id: step % 5 for r, k in out.scheduled if out.needs_sample(r, k)})
        log.append([r.request_id for r in done])
        s.check_consistency()
        if n == 12 and not s.num_unfinished:
            break
    for _ in range(10):  # copies still in flight (stores): land them without blocking
        eng.complete_all()
        s.settle()
    log.append((s.num_unfinished, s.copies_in_flight(), s.tm.metrics().counters))
    return log


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("mode", "layerwise"), [("recompute", False), ("swap", False), ("auto", False), ("swap", True)]
)
def test_random_runs_with_aborts_decide_the_same_with_and_without_skipping(seed, mode, layerwise):
    fast = _random_run(seed, True, mode, layerwise)
    assert fast == _random_run(seed, False, mode, layerwise)
    assert fast[-1][0] == 0  # everything finished or was aborted
