"""vLLM 0.33's memory knobs in a simulator config: the full-prompt gate, the KV-cache watermark, prefix caching.

The tiny config (tests/simutil.py) has 8 GPU blocks of 4 tokens (7 usable, block 0 is the null
block) and one step per simulated second, so each decision below can be worked out by hand.
"""

from __future__ import annotations

import pytest
from simutil import TINY, config, run

from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import setup


def two_long_requests(**changes):
    """Two 20-token prompts (5 blocks each), 4 output tokens, arriving at 0 s and 1 s, 8 tokens a step."""
    return config(
        workload__num_requests=2,
        workload__arrival={"process": "fixed", "rate": 1.0},
        workload__prompt_len={"dist": "fixed", "value": 20},
        workload__output_len={"dist": "fixed", "value": 4},
        scheduler__max_num_batched_tokens=8,
        **changes,
    )


def test_the_defaults_are_vllm_033s():
    st = setup(config(), 0)
    assert st.scheduler.scheduler_reserve_full_isl
    assert (st.manager.watermark, st.manager.enable_caching) == (0.0, True)


def test_the_full_prompt_gate_admits_a_request_only_when_its_whole_prompt_fits():
    # At 1 s request 0 holds 4 blocks (16 tokens computed, 8 more this step): 3 are free, and
    # request 1's whole prompt needs 5.  Gated, it waits for request 0 to finish (6 s).
    res, sim = run(two_long_requests(), trace=True)
    assert (6.0, "admit", 1) in sim.loop.trace
    assert res["preemptions_recompute"] == 0
    # Without the gate its first chunk fits at 2 s; at 3 s request 0 needs a 6th block and the
    # last admitted goes: recomputed later from the one full block it had cached.
    res, sim = run(two_long_requests(scheduler__scheduler_reserve_full_isl=False), trace=True)
    trace = sim.loop.trace
    assert trace[5:8] == [(2.0, "admit", 1), (2.0, "step", ((0, 4), (1, 4))), (3.0, "preempt_recompute", 1)]
    assert res["preemptions_recompute"] == 1 and res["tokens_recomputed"] == 0


def test_prefix_caching_off_a_preempted_request_cannot_find_its_own_blocks():
    # The same preemption as above: with prefix caching on, request 1 re-hits the block of 4
    # tokens it had computed; off, it computes them again.
    on, _ = run(two_long_requests(scheduler__scheduler_reserve_full_isl=False))
    off, _ = run(two_long_requests(scheduler__scheduler_reserve_full_isl=False, memory__prefix_caching=False))
    assert (on["tokens_recomputed"], on["lookup_tokens"]["readmitted"]["gpu"]) == (0, 4)
    assert (off["tokens_recomputed"], off["lookup_tokens"]["readmitted"]["gpu"]) == (4, 0)


def test_the_watermark_keeps_blocks_free_while_a_request_runs():
    # Two 8-token prompts (2 blocks each), arriving at 0 s and 1 s.  At 1 s request 0 holds 3
    # blocks (its 9th token), 4 are free.  int(0.375 * 8) = 3 blocks of watermark leave room for
    # 1: request 1 (2 blocks) waits for request 0 to finish; int(0.25 * 8) = 2 leave 2: it runs.
    def two(watermark):
        return config(
            workload__arrival={"process": "fixed", "rate": 1.0},
            workload__prompt_len={"dist": "fixed", "value": 8},
            workload__output_len={"dist": "fixed", "value": 4},
            scheduler__watermark=watermark,
        )

    _, sim = run(two(0.25), trace=True)
    assert (1.0, "admit", 1) in sim.loop.trace
    _, sim = run(two(0.375), trace=True)
    assert (1.0, "admit", 1) not in sim.loop.trace
    assert sim.loop.trace.index((4.0, "finish", 0)) < sim.loop.trace.index((4.0, "admit", 1))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scheduler__watermark": -0.1}, r"^scheduler\.watermark: must be in \[0, 1\) .*got -0\.1$"),
        ({"scheduler__watermark": 1.0}, r"^scheduler\.watermark: must be in \[0, 1\) .*got 1\.0$"),
        ({"scheduler__watermark": "5%"}, r"^scheduler\.watermark: "),
        ({"scheduler__watermark": True}, r"^scheduler\.watermark: "),
        ({"scheduler__scheduler_reserve_full_isl": "yes"}, r"^scheduler\.scheduler_reserve_full_isl: "),
        ({"memory__prefix_caching": 0}, r"^memory\.prefix_caching: "),
        (
            {"memory__prefix_caching": False, "runs": [dict(TINY["runs"][0], offload="write_through", cpu_kv_gib=1)]},
            r"^runs\[0\]\.offload: write_through keeps a CPU prefix tier, which needs prefix caching, "
            r"but memory\.prefix_caching is false",
        ),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_key(changes, message):
    with pytest.raises(ConfigError, match=message) as info:
        config(**changes)
    assert "\n" not in str(info.value)
