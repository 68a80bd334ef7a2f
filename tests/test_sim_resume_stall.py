"""A request resumed without a copy, when nothing else is pending, runs at once instead of ending the run."""

from __future__ import annotations

from simutil import config, run


def test_a_resume_with_nothing_in_flight_is_progress_not_a_stall():
    # A request swapped out to make room whose blocks are still cached on the GPU when it comes back
    # resumes with no copy.  Nothing else may be pending then: the run used to stop with "no
    # progress" here.
    cfg = config(
        workload__num_requests=24,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 3, "high": 13},
        workload__output_len={"dist": "uniform", "low": 2, "high": 14},
        scheduler__max_num_batched_tokens=16,
        # The scenario was found with first-chunk admission (vLLM's full-prompt gate admits fewer).
        scheduler__scheduler_reserve_full_isl=False,
        runs=[{"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none"}],
    )
    res, sim = run(cfg, trace=True)
    assert res["requests_finished"] == 24
    trace = sim.loop.trace
    # Request 2 comes back at 28.5 with every block still cached (no swap-in is started for it) and
    # is computed in the step it resumes in, at the same instant, as vLLM schedules a resumed request.
    i = trace.index((28.5, "resume", 2))
    assert trace[i - 1] == (28.5, "finish", 5) and trace[i + 1] == (28.5, "step", ((2, 1),))
