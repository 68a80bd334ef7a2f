"""Cost-aware preemption prices only the candidates it needs, and decides exactly as pricing every one would.

Its ranking prunes with a lower bound (``CostAwarePolicy.lower_key``); with no
cost model the same policy prices every candidate and sorts them all.  Both
drive the same scheduler on random workloads under preemption churn, and every
decision (who, in what order, by which mode) must be the same.
"""

from __future__ import annotations

import random

import pytest

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, TierManager
from tiered_kv.manager.policies import CostAwarePolicy
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine


def run(seed: int, exact: bool, mode: str) -> tuple[list, list]:
    rng = random.Random(seed)
    gpu, cpu, bs = 40, 48, 4
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": cpu})
    cm = CostModel(
        kv_bytes_per_token=4096, block_size=bs, d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9, prefill_tokens_per_s=3e5
    )
    tm = TierManager(gpu, cpu, bs, eng, cost_model=cm, offload="write_through")
    s = Scheduler(tm, SchedulerConfig(max_num_batched_tokens=64, policy="cost_aware", mode=mode))
    if exact:
        s.policy = CostAwarePolicy(None)  # no bound: every candidate priced, a full sort
    shared = [rng.randrange(500) for _ in range(12)]
    for i in range(24):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(500) for _ in range(rng.randrange(3, 30))]
        s.add_request(Request(i, prompt, max_tokens=rng.randrange(4, 24), arrival_time=float(i)))
    preempted = []
    for _ in range(2000):
        if rng.random() < 0.7:  # copies land late or early, the same way in both runs
            eng.complete_all()
        out = s.schedule()
        preempted.append(list(out.preempted))
        s.update(out, {r.request_id: 7 for r, n in out.scheduled if out.needs_sample(r, n)})
        if not s.num_unfinished:
            break
        if not out.scheduled:
            eng.complete_all()
    assert not s.num_unfinished
    return preempted, [(d.tick, d.request_id, d.mode, d.reason, d.quote) for d in tm.decision_log]


@pytest.mark.parametrize("mode", ["auto", "swap", "recompute"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_cost_aware_decides_exactly_as_full_pricing(seed, mode):
    pruned = run(seed, exact=False, mode=mode)
    full = run(seed, exact=True, mode=mode)
    assert pruned == full
    assert sum(len(p) for p in pruned[0]) > 0  # the workload really preempted
