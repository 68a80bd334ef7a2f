"""pytest-benchmark version of ``bench_store.py`` (collected only by ``pytest benchmarks``).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_store.py --benchmark-enable``.

One group per policy.  Each member replays the same recorded call sequence
against a fresh store: vLLM 0.33.0's own ``CPUOffloadingManager`` (imported
from its wheel) and our ``CPUStore``.  pytest-benchmark prints beside each time
its factor to the group's fastest member, so vLLM's factor is the speed-up,
measured in the same run.  Before any timing, the fixture checks that our
store answers every call as vLLM's did.
"""

from __future__ import annotations

import bench_store as bs
import pytest

NUM_REQUESTS = 1_000
CAPACITY = 1024
ROUNDS = 5


@pytest.fixture(scope="module", params=["lru", "arc"])
def recording(request):
    v = bs.vllm_ref_offload.load()
    calls, keys = bs.make_trace(v, request.param, CAPACITY, NUM_REQUESTS, 64, seed=0)
    counts = bs.check(calls, keys, request.param, CAPACITY)  # raises on the first answer that differs
    assert counts["evicted"] > 0 and counts["hits"] > 0
    return v, request.param, calls, keys


@pytest.mark.parametrize("impl", ["vllm", "tiered_kv"])
def test_replay(benchmark, recording, impl):
    v, policy, calls, keys = recording
    benchmark.group = f"CPU store replay ({policy}): {NUM_REQUESTS} requests, {len(calls)} calls"
    if impl == "vllm":
        benchmark.pedantic(bs.time_vllm, (v, calls, keys, policy, CAPACITY), rounds=ROUNDS, warmup_rounds=1)
    else:
        benchmark.pedantic(bs.time_ours, (calls, keys, policy, CAPACITY), rounds=ROUNDS, warmup_rounds=1)
