"""Equal inputs and equal completion order give equal decisions, in any process.

The scheduler and the manager decide from ordered structures only: the same
run under different string-hash seeds (``PYTHONHASHSEED``, which reorders every
set and dict keyed by strings that is iterated without an order) makes the same
preemptions, resumes and batches, step for step.  Runs over a threaded copy
engine differ only because its copies land at different times; the controlled
engine, completing copies in a fixed order, repeats exactly.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = """
import json
from tiered_kv.core import Request
from tiered_kv.manager import VICTIM_POLICIES, ManagerConfig, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.storage import KVSpec
from tiered_kv.transfer import ControlledCopyEngine

out = []
for policy in VICTIM_POLICIES:
    for offload in ("none", "write_through"):
        spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
        eng = ControlledCopyEngine({"GPU": 24, "CPU": 64})
        tm = TierManager(ManagerConfig(24, 64, 4, offload=offload), eng, kv_spec=spec)
        s = Scheduler(tm, SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, victim_policy=policy, mode="auto"))
        for i in range(30):
            prompt = [1, 2, 3, 4, 5] + list(range(100 * i, 100 * i + 3 + i % 9))
            s.add_request(Request(f"r{i}", prompt, max_tokens=12 + i % 7, arrival_time=float(i)))
        while s.num_unfinished:
            eng.complete_all()
            o = s.schedule()
            out.append([[p[0], p[1].value] for p in o.preempted] + o.resumed + o.admitted
                       + [[r.request_id, n] for r, n in o.scheduled])
            s.update(o, {r.request_id: 7 for r, n in o.scheduled if o.needs_sample(r, n)})
        c = tm.counters
        out.append([policy, offload, c.preemptions_swap, c.preemptions_recompute])
print(json.dumps(out))
"""


@functools.cache
def _decisions(seed: int) -> list:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    root = Path(__file__).parents[1]
    done = subprocess.run(
        [sys.executable, "-c", RUN], env=env, cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.parametrize("seed", [2, 3])
def test_the_same_run_under_another_hash_seed_makes_the_same_decisions(seed):
    first, other = _decisions(1), _decisions(seed)
    totals = [row for row in first if len(row) == 4 and row[1] in ("none", "write_through")]
    assert len(totals) == 8 and all(swaps > 0 for _, _, swaps, _ in totals)  # every run preempts
    assert other == first
