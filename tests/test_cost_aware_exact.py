"""Cost-aware preemption prices only the candidates it needs, and decides exactly as pricing every one would.

Its ranking prunes with bounds from the tier manager's per-request counts of
freeable blocks, kept as tables change (``TierManager.preemption_bounds``);
with no cost model the same policy prices every candidate and sorts them all.
Both drive the same scheduler on random workloads under preemption churn, and
every decision (who, in what order, by which mode) must be the same.  The
bounds themselves are checked against exact quotes at every step, and the kept
counts against a fresh scan of every table (``check_invariants``).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, ManagerConfig, Residency, TierManager
from tiered_kv.manager.victim_policy import CostAwarePolicy
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

# (offload, CPU blocks, prefix caching): a CPU prefix tier, swaps only, no CPU tier, no caching.
SETUPS = {
    "write_through": ("write_through", 48, True),
    "swap_only": ("none", 48, True),
    "no_cpu_tier": ("none", 0, True),
    "no_caching": ("none", 48, False),
}


def make(seed: int, mode: str, setup: str) -> tuple[random.Random, ControlledCopyEngine, TierManager, Scheduler]:
    rng = random.Random(seed)
    offload, cpu, caching = SETUPS[setup]
    gpu, bs = 40, 4
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)})
    cm = CostModel(
        kv_bytes_per_token=4096, block_size=bs, d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9, prefill_tokens_per_s=3e5
    )
    tm = TierManager(ManagerConfig(gpu, cpu, bs, offload=offload, enable_caching=caching), eng, cost_model=cm)
    s = Scheduler(tm, SchedulerConfig(max_num_batched_tokens=64, victim_policy="cost_aware", mode=mode))
    shared = [rng.randrange(500) for _ in range(12)]
    for i in range(24):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(500) for _ in range(rng.randrange(3, 30))]
        s.add_request(Request(i, prompt, max_tokens=rng.randrange(4, 24), arrival_time=float(i)))
    return rng, eng, tm, s


def steps(rng: random.Random, eng: ControlledCopyEngine, s: Scheduler):
    """Drive the scheduler to the end; yields after every step."""
    for _ in range(2000):
        if rng.random() < 0.7:  # copies land late or early, the same way in both runs
            eng.complete_all()
        out = s.schedule()
        s.update(out, {r.request_id: 7 for r, n in out.scheduled if out.needs_sample(r, n)})
        yield out
        if not s.num_unfinished:
            break
        if not out.scheduled:
            eng.complete_all()
    assert not s.num_unfinished


def run(seed: int, exact: bool, mode: str, setup: str = "write_through") -> tuple[list, list]:
    rng, eng, tm, s = make(seed, mode, setup)
    if exact:
        s.config = dataclasses.replace(s.config, victim_policy=CostAwarePolicy(None))  # no bound: a full sort
    preempted = [list(out.preempted) for out in steps(rng, eng, s)]
    return preempted, [(d.tick, d.request_id, d.mode, d.reason, d.quote) for d in tm.decision_log]


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_cost_aware_decides_exactly_as_full_pricing(seed, mode):
    pruned = run(seed, exact=False, mode=mode)
    full = run(seed, exact=True, mode=mode)
    assert pruned == full
    assert sum(len(p) for p in pruned[0]) > 0  # the workload really preempted


@pytest.mark.parametrize("setup", ["swap_only", "no_cpu_tier", "no_caching"])
@pytest.mark.parametrize("seed", range(3))
def test_pruned_cost_aware_decides_exactly_without_a_prefix_tier(seed, setup):
    pruned = run(seed, exact=False, mode="auto", setup=setup)
    assert pruned == run(seed, exact=True, mode="auto", setup=setup)
    assert sum(len(p) for p in pruned[0]) > 0


def exact_key(tm: TierManager, rid: object, mode: str) -> float:
    q = tm.quote(rid)
    return q.cost(mode) / q.blocks_freed if q.blocks_freed else math.inf


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("seed", range(3))
def test_bounds_never_exceed_the_exact_key_and_kept_counts_match_a_fresh_scan(seed, setup):
    rng, eng, tm, s = make(seed, "auto", setup)
    checked = tight = 0
    for _ in steps(rng, eng, s):
        tm.check_invariants()  # kept counts of every table == a fresh scan; no tail key of a GPU request stored
        on_gpu = [rid for rid in tm.requests() if tm.residency(rid) is Residency.GPU]
        for mode in ("auto", "swap", "recompute"):
            cheap = tm.preemption_bounds(on_gpu, mode, lookups=False)
            looked = tm.preemption_bounds(on_gpu, mode)
            for rid, lo, mid in zip(on_gpu, cheap, looked, strict=True):
                key = exact_key(tm, rid, mode)
                assert lo <= mid * (1 + 1e-12) and mid <= key * (1 + 1e-12), (rid, mode, lo, mid, key)
                checked += 1
                tight += key != math.inf and mid >= key * (1 - 1e-9)
    assert checked > 100
    assert tight > checked // 4  # often exact: only the copy runs out and blocks beyond the lookups can differ


def test_a_block_released_to_one_holder_counts_as_freed_at_once():
    """Two requests share a prefix; when one goes, the other alone holds it: its bound and quote agree at once."""
    eng = ControlledCopyEngine({"GPU": 20, "CPU": 20})
    cm = CostModel(kv_bytes_per_token=4096, block_size=4, d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9)
    tm = TierManager(ManagerConfig(20, 20, 4), eng, cost_model=cm)
    prompt = list(range(12))
    a, b = Request("a", [*prompt, 50, 51]), Request("b", [*prompt, 60, 61])
    for r in (a, b):
        tm.admit(r, 14)
        r.num_computed_tokens = 14
    tm.allocate("a", 1)  # prefix blocks touched by both; each has a tail of its own
    assert tm.quote("b").blocks_freed == 1 and tm.preemption_bounds(["b"], "recompute") == [cm.recompute_time(14) / 1]
    tm.free("a")
    assert tm.quote("b").blocks_freed == 4
    assert tm.preemption_bounds(["b"], "recompute") == [cm.recompute_time(14) / 4]
    tm.check_invariants()
