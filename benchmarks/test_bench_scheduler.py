"""pytest-benchmark version of ``bench_scheduler.py`` (collected only by ``pytest benchmarks``).

Run: ``.venv-vllm/bin/python -m pytest benchmarks/test_bench_scheduler.py --benchmark-enable``.

One replay of a 40-request stream through vLLM 0.33.0's ``Scheduler`` and ours in lockstep,
after the differential test's checked replay; without ``--benchmark-enable`` (the project's
default options) it runs once, as a smoke test.  Skips where vLLM 0.33.0 does not import.
"""

from __future__ import annotations

import bench_scheduler as bsch
import pytest
from vllm_env import PROBLEM  # importable once bench_scheduler has put tests/ on the path

pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"{PROBLEM}: run in .venv-vllm")


@pytest.fixture(scope="module")
def replay():
    diff = bsch.load_diff()
    setup = diff.Setup(num_blocks=65, max_num_batched_tokens=128, max_num_seqs=16, block_size=16, max_model_len=1024)
    stream = bsch.make_stream(diff, 40, 0, setup)
    checked = diff.run_both(setup, stream)  # raises on the first step where the schedulers differ
    assert checked.all_preempted  # the pool is small enough that the stream preempts
    return diff, setup, stream, checked


@pytest.mark.parametrize("hash_at_intake", [False, True], ids=["hashed-in-schedule", "hashed-at-intake"])
def test_lockstep_replay(benchmark, replay, hash_at_intake):
    diff, setup, stream, checked = replay
    benchmark.group = "scheduler step: 40 requests, vLLM 0.33 and ours in lockstep"
    dec, tim = benchmark.pedantic(
        bsch.timed_replay,
        (diff, setup, stream, bsch.CLOCKS["cpu"], 5000, hash_at_intake),
        rounds=1,
        warmup_rounds=0,
    )
    bsch.compare(checked, dec)
    assert tim.steps == len(checked.batches)
    assert tim.vllm_schedule > 0 and tim.ours_schedule > 0


def test_a_differing_decision_is_reported_with_its_step(replay):
    diff, _, _, checked = replay
    dec = diff.Trace(list(checked.batches), list(checked.preempted), list(checked.finished))
    rid, n = dec.batches[3][0]
    dec.batches[3] = [(rid, n + 1), *dec.batches[3][1:]]
    with pytest.raises(bsch.Mismatch, match=r"^step 3: batches differ"):
        bsch.compare(checked, dec)
