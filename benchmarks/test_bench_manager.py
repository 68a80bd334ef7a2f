"""pytest-benchmark version of ``bench_manager.py`` (collected only by ``pytest benchmarks``).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_manager.py --benchmark-enable``.

One group: the scheduler step with 256 running requests under preemption churn,
one member per victim policy, each a whole run of ``bench_manager.run`` (the
real Scheduler over the real TierManager, copies completing at once).
pytest-benchmark prints each policy's time and its factor to the fastest, so a
regression of one policy shows against the others measured in the same run;
``--benchmark-compare`` tracks it between commits.  Each run also checks what
it did: the steps were measured, requests ran and the policy preempted.
Without ``--benchmark-enable`` (the project's default options) each case runs
once, as a smoke test.
"""

from __future__ import annotations

import bench_manager as bm
import pytest

STEPS = 200
RUNNING = 256
POLICIES = ["last_admitted", "largest", "prefill_aware", "cost_aware"]


@pytest.mark.parametrize("policy", POLICIES)
def test_scheduler_step(benchmark, policy):
    benchmark.group = f"scheduler step: {RUNNING} running, {STEPS} steps, sha256 hashes"

    def one_run():
        return bm.run(policy, STEPS, RUNNING, 3500, 12000, "sha256", "write_through")

    result = benchmark.pedantic(one_run, rounds=3, warmup_rounds=0)
    assert result["victim_policy"] == policy
    assert result["steps"] == STEPS - STEPS // 5
    assert result["running_at_end"] > 0
    assert result["preemptions_swap"] + result["preemptions_recompute"] > 0
    benchmark.extra_info["us_per_step"] = result["us_per_step"]
