"""pytest-benchmark version of ``bench_store.py`` (collected only by ``pytest benchmarks``).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_store.py --benchmark-enable``.

One group per load (requests running at once).  Each member replays the same
recorded call sequence against a fresh store: the vLLM-structure anchor
(``_vllm_style_store.py``), our ``CPUStore`` with the same per-key lookups, and
our ``CPUStore`` with one ``lookup_prefix`` per admission.  pytest-benchmark
prints beside each time its factor to the group's fastest member, so the
anchor's factor is the speed-up, measured in the same run.  Before any timing,
the fixture checks that our store answers every call as the anchor did.
Without ``--benchmark-enable`` (the project's default options) each case runs
once, as a smoke test.
"""

from __future__ import annotations

import gc

import bench_store as bs
import pytest

NUM_REQUESTS = 2_000
ROUNDS = 5
LOADS = [32, 64]


@pytest.fixture(scope="module", params=LOADS, ids=[f"{n}-running" for n in LOADS])
def recording(request):
    rec = bs.record(bs.make_store_trace(NUM_REQUESTS, seed=0), seed=1, running=request.param)
    counts = bs.check(rec)  # raises on the first decision that differs
    assert counts["calls"] > NUM_REQUESTS and counts["evicted"] > 0
    return request.param, rec


@pytest.mark.parametrize("impl", bs.IMPLS)
def test_replay(benchmark, recording, impl):
    running, rec = recording
    benchmark.group = f"CPU store replay: {NUM_REQUESTS} requests, {running} running, {len(rec.ops)} recorded ops"

    def setup():
        calls = bs.make_calls(rec, impl, "dataclass")
        gc.collect()
        return (calls,), {}

    benchmark.pedantic(bs.run, setup=setup, rounds=ROUNDS, warmup_rounds=1)
