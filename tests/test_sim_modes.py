"""Copy modes: whole event traces of a tiny swap scenario, worked out by hand, in each mode.

Setup (as in test_sim.py): 7 usable GPU blocks of 4 tokens (1 KiB each), a link of 4096 B/s
each way with no per-copy cost, 1 s per step, two 12-token prompts at t=0 with 6 output tokens
each.  The model has two layers, so a layerwise swap-in arrives half a copy per layer.
B (request 1) cannot grow at t=1 and swaps itself out (3 blocks: 0.75 s); later it comes back
from the GPU prefix cache, is swapped again without a copy, and at A's finish its last block
comes back from the CPU (1 block: 0.25 s).
"""

import pytest
from simutil import config, run

TOY2 = {
    "name": "toy2",
    "num_params": 1.0e6,
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 32,
    "vocab_size": 0,
    "dtype": "float16",
}


def swap_config(copies: str, gbps: float | None = None, **run_keys):
    changes = {}
    if gbps is not None:
        changes["link"] = {"gbps_per_direction": gbps}
    return config(
        workload__arrival={"process": "bursty", "rate": 1.0, "burst_size": 2},
        workload__prompt_len={"dist": "fixed", "value": 12},
        workload__output_len={"dist": "fixed", "value": 6},
        model=TOY2,
        runs=[
            {
                "name": "swap",
                "victim_policy": "last_admitted",
                "mode": "swap",
                "offload": "none",
                "copies": copies,
                **run_keys,
            }
        ],
        **changes,
    )


HEAD = [
    (0.0, "arrival", 0),
    (0.0, "arrival", 1),
    (0.0, "admit", 0),
    (0.0, "admit", 1),
    (0.0, "step", ((0, 12), (1, 12))),
    (1.0, "transfer_start", (1, "swap_out", "D2H", 3, 1.75)),
    (1.0, "preempt_swap", 1),
    (1.0, "step", ((0, 1),)),  # issued at 1.0; in blocking mode it runs after the swap-out
    (1.75, "transfer_done", 1),
]


def test_blocking_the_step_waits_for_every_copy_issued_before_it():
    res, sim = run(swap_config("blocking"), trace=True)
    # The step issued at 1.0 runs 1.75-2.75; the swap-in at 6.75 holds B's step until 7.0.
    assert sim.loop.trace == [
        *HEAD,
        (2.75, "step", ((0, 1),)),
        (3.75, "step", ((0, 1),)),
        (4.75, "step", ((0, 1),)),
        (5.75, "step", ((0, 1),)),
        (6.75, "finish", 0),
        (6.75, "transfer_start", (2, "swap_in", "H2D", 1, 7.0)),
        (6.75, "resume", 1),
        (7.0, "transfer_done", 2),
        (7.0, "step", ((1, 1),)),
        (8.0, "step", ((1, 1),)),
        (9.0, "step", ((1, 1),)),
        (10.0, "step", ((1, 1),)),
        (11.0, "step", ((1, 1),)),
        (12.0, "finish", 1),
    ]
    assert res["makespan_s"] == 12.0 and res["stall_s"] == 0.75  # the swap-in wait is idle time, not a stall


def test_layerwise_a_swap_in_runs_in_the_next_step_layer_by_layer():
    res, sim = run(swap_config("layerwise"), trace=True)
    # At 6.0 the swap-in is ordered before B's step, which starts at once; its 2 layers arrive at
    # 6.125 and 6.25, so the step ends at max(6 + 1, 6 + 0.125 + 1, 6.25 + 0.5) = 7.125.
    assert sim.loop.trace == [
        *HEAD,
        (2.0, "step", ((0, 1),)),
        (3.0, "step", ((0, 1),)),
        (4.0, "step", ((0, 1),)),
        (5.0, "step", ((0, 1),)),
        (6.0, "finish", 0),
        (6.0, "transfer_start", (2, "swap_in", "H2D", 1, 6.25)),
        (6.0, "resume", 1),
        (6.0, "step", ((1, 1),)),
        (6.25, "transfer_done", 2),
        (7.125, "step", ((1, 1),)),
        (8.125, "step", ((1, 1),)),
        (9.125, "step", ((1, 1),)),
        (10.125, "step", ((1, 1),)),
        (11.125, "finish", 1),
    ]
    assert res["makespan_s"] == 11.125 and res["stall_s"] == 0.125


@pytest.mark.parametrize(("gbps", "makespan"), [(4.096e-6, 12.0), (8.192e-6, 11.5), (16.384e-6, 11.25)])
def test_blocking_swap_costs_exactly_its_copies(gbps, makespan):
    """11 steps of 1 s, plus the 3-block swap-out and the 1-block swap-in at the link's speed."""
    res, _ = run(swap_config("blocking", gbps))
    assert res["makespan_s"] == pytest.approx(11.0 + 4 * 1024 / (gbps * 1e9))
    assert res["makespan_s"] == pytest.approx(makespan)


def test_layer_first_without_coalescing_pays_a_copy_per_block_per_layer():
    """vLLM v0's layout: 3 blocks x 2 layers x K/V = 12 copies; at 0.1 s each the swap-out takes 1.95 s."""
    cfg = swap_config("blocking", kv_layout="layer_first", coalesce=False)
    cfg["link"]["per_copy_overhead_s"] = 0.1
    from tiered_kv.sim.config import setup

    st = setup(cfg, 0)
    assert st.link.per_copy_s == 0.1
    res, sim = run(cfg, trace=True)
    assert (1.0, "transfer_start", (1, "swap_out", "D2H", 3, 2.95)) in sim.loop.trace
    assert res["copies_issued"] == 12 + 4  # the swap-in of one block: 2 layers x K/V
