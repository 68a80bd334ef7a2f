"""A request resumed without a copy, when nothing else is pending, runs in the next step instead of ending the run."""

from __future__ import annotations

from simutil import config, run


def test_a_resume_with_nothing_in_flight_is_progress_not_a_stall():
    # Request 3 is swapped out to make room; when the swap-out lands its blocks are still cached on
    # the GPU, so it resumes with no copy, after that step's batch was picked.  Nothing else is
    # pending then: the run used to stop with "no progress" here.
    cfg = config(
        workload__num_requests=24,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 3, "high": 13},
        workload__output_len={"dist": "uniform", "low": 2, "high": 14},
        scheduler__max_num_batched_tokens=16,
        runs=[{"name": "swap", "policy": "lru", "mode": "swap", "offload": "none"}],
    )
    res, sim = run(cfg, trace=True)
    assert res["requests_finished"] == 24
    trace = sim.loop.trace
    i = trace.index((31.25, "resume", 3))
    assert trace[i + 1] == (31.25, "step", ((3, 1),))  # the same instant, the next step
