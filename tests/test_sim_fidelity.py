"""Prefill efficiency, the serving front end and multi-step scheduling: hand-derived timings on tiny setups."""

import itertools
import json

import pytest
from simutil import KIB_IN_GIB, TOY_STEP, config, run

from tiered_kv.errors import ConfigError
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.profiles import load_hardware, load_model


def test_prefill_chunks_run_at_prefill_mfu_and_decode_rows_at_mfu():
    hw, m = load_hardware("h200"), load_model("llama3-8b")
    cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0, prefill_mfu=0.8)
    p, lm, a = 2 * m.params_per_gpu, 2 * m.vocab_size * m.hidden_size, 2 * m.num_layers * m.attn_dim_per_gpu
    # one 1000-token prompt from scratch (it samples its first token) and two decode rows at context 100
    pre_attn = 1000**2
    dec_attn = 2 * (101**2 - 100**2)
    decode = p * 2 + lm * 3 + a * dec_attn
    prefill = p * 1000 + a * pre_attn
    expected = decode / (989e12 * 0.5) + prefill / (989e12 * 0.8)
    memory = (m.streamed_weight_bytes_per_gpu + (1000 + 2 * 101) * m.kv_bytes_per_token) / 4.8e12
    assert expected > memory  # compute-bound, so the prediction is the compute roof
    got = cm.step_time(1002, float(pre_attn + dec_attn), 1202, 3, 3, 1000, float(pre_attn))
    assert got == pytest.approx(expected, rel=1e-12)
    # the manager's cost model prices recompute (a prefill) at the prefill roof
    assert cm.prefill_tokens_per_s() == pytest.approx(989e12 * 0.8 / p)
    assert cm.prefill_quadratic() == pytest.approx(2 * a / (989e12 * 0.8))
    # without prefill_mfu one efficiency prices both
    one = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
    assert one.step_time(1002, float(pre_attn + dec_attn), 1202, 3, 3, 1000, float(pre_attn)) == pytest.approx(
        (decode + prefill) / (989e12 * 0.5), rel=1e-12
    )


def test_a_long_prefill_is_priced_by_its_attention():
    # 100k tokens of Llama-3-8B from scratch: attention is 2 * 32 * 4096 * 1e10 FLOPs, dense 2 * P * 1e5
    hw, m = load_hardware("h100-sxm"), load_model("llama3-8b")
    cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0, prefill_mfu=0.6)
    n = 100_000
    attn = 2 * 32 * 4096 * n**2
    dense = 2 * m.params_per_gpu * n
    assert attn > dense  # past 53k tokens attention is the larger share
    lm = 2 * m.vocab_size * m.hidden_size
    expected = lm / (989e12 * 0.5) + (dense + attn) / (989e12 * 0.6)
    assert cm.step_time(n, float(n * n), n, 1, 1, n, float(n * n)) == pytest.approx(expected, rel=1e-12)


def test_the_front_end_delays_entry_and_counts_in_ttft_but_in_no_step():
    # TINY: two 4-token prompts with 2 output tokens, sent at 0 s and 2 s; every step takes 1 s.  With
    # 0.25 s of front end each reaches the scheduler 0.25 s after it was sent: prefill [0.25, 1.25],
    # decode [1.25, 2.25]; the second one [2.25, 3.25] and [3.25, 4.25].
    res, sim = run(config(compute__frontend_s=0.25), trace=True)
    assert sim.loop.trace == [
        (0.25, "arrival", 0),
        (0.25, "admit", 0),
        (0.25, "step", ((0, 4),)),
        (1.25, "step", ((0, 1),)),
        (2.25, "finish", 0),
        (2.25, "arrival", 1),
        (2.25, "admit", 1),
        (2.25, "step", ((1, 4),)),
        (3.25, "step", ((1, 1),)),
        (4.25, "finish", 1),
    ]
    assert res["ttft_s"]["p50"] == 1.25 and res["e2e_s"]["p99"] == 2.25 and res["makespan_s"] == 4.25
    assert res["tpot_s"]["p50"] == 1.0  # no step pays for the front end
    assert res["queue_s"]["p99"] == 0.0  # nor is it a wait in the scheduler's queue
    assert res["frontend_s"] == 0.25  # the results name it apart from the queue and the steps
    assert [r.arrival for r in sim.records.values()] == [0.0, 2.0]  # the records keep the time it was sent


def _trace_config(tmp_path, rows, **changes):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return config(workload__trace=str(p), workload__num_requests=len(rows), **changes)


ROWS = [
    {"arrival": 0.0, "prompt_len": 4, "output_len": 6},  # A
    {"arrival": 1.5, "prompt_len": 4, "output_len": 2},  # B
]


def test_multi_step_scheduling_holds_an_arrival_until_the_run_of_decodes_ends(tmp_path):
    # Three steps per decision.  A's prefill [0, 1] is a decision of its own (it has a prefill chunk);
    # the decode at 1 s starts a run of three (1, 2, 3); B, sent at 1.5 s, waits for the decision at
    # 4 s, where its prefill joins A's decode: B's first token at 5 s, 3.5 s after it was sent.
    _, sim = run(_trace_config(tmp_path, ROWS, compute__scheduler_steps=3, engine="vllm-0.6.0"), trace=True)
    assert sim.loop.trace == [
        (0.0, "arrival", 0),
        (0.0, "admit", 0),
        (0.0, "step", ((0, 4),)),
        (1.0, "step", ((0, 1),)),
        (2.0, "step", ((0, 1),)),
        (3.0, "step", ((0, 1),)),
        (4.0, "arrival", 1),
        (4.0, "admit", 1),
        (4.0, "step", ((0, 1), (1, 4))),
        (5.0, "step", ((0, 1), (1, 1))),
        (6.0, "finish", 0),
        (6.0, "finish", 1),
    ]
    ttft = {r.rid: r.first_token - r.arrival for r in sim.records.values()}
    assert ttft == {0: 1.0, 1: 3.5}
    # one step per decision: B joins at 2 s, first token at 3 s
    _, one = run(_trace_config(tmp_path, ROWS), trace=True)
    assert {r.rid: r.first_token - r.arrival for r in one.records.values()} == {0: 1.0, 1: 1.5}


def test_a_held_arrival_enters_when_nothing_runs(tmp_path):
    # A finishes inside its run of decodes (two output tokens: prefill, one decode at 1 s that starts a
    # run of four); B, sent at 1.5 s, is held, and when nothing is left to run the decision is at once.
    rows = [{"arrival": 0.0, "prompt_len": 4, "output_len": 2}, {"arrival": 1.5, "prompt_len": 4, "output_len": 2}]
    res, sim = run(_trace_config(tmp_path, rows, compute__scheduler_steps=4, engine="vllm-0.6.0"), trace=True)
    assert [e for e in sim.loop.trace if e[1] in ("arrival", "finish")] == [
        (0.0, "arrival", 0),
        (2.0, "finish", 0),
        (2.0, "arrival", 1),
        (4.0, "finish", 1),
    ]
    assert res["makespan_s"] == 4.0


def _step_model_without(key):
    return {"vllm-v1": {k: v for k, v in TOY_STEP.items() if k != key}}


def _step_model_with(**changes):
    return {"vllm-v1": dict(TOY_STEP, **changes)}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compute__scheduler_steps": 0}, r"compute\.scheduler_steps: must be > 0"),
        ({"compute__scheduler_steps": True}, r"compute\.scheduler_steps: expected an integer"),
        ({"compute__frontend_s": -1.0}, r"compute\.frontend_s: must be >= 0"),
        ({"compute__prefill_mfu": 1.5}, r"compute\.prefill_mfu: must be in \(0, 1\]"),
        ({"compute__prefill_mfu": float("nan")}, r"compute\.prefill_mfu: .*nan"),
        ({"compute__frontend_s": float("nan")}, r"compute\.frontend_s: .*nan"),
        (
            {"hardware__step_model": _step_model_with(prefill_mfu=-0.5)},
            r"hardware\.step_model\.vllm-v1\.prefill_mfu: must be in \(0, 1\]",
        ),
        (
            {"hardware__step_model": _step_model_with(prefill_mfu=float("nan"))},
            r"hardware\.step_model\.vllm-v1\.prefill_mfu: .*nan",
        ),
        (
            {"hardware__step_model": _step_model_with(frontend_s=-0.01)},
            r"hardware\.step_model\.vllm-v1\.frontend_s: must be >= 0",
        ),
        (
            {"hardware__step_model": _step_model_with(frontend_s=float("inf"))},
            r"hardware\.step_model\.vllm-v1\.frontend_s: .*inf",
        ),
        (
            {"hardware__step_model": _step_model_without("prefill_mfu")},
            r"hardware\.step_model\.vllm-v1\.prefill_mfu: required key is missing$",
        ),
        (
            {"hardware__step_model": _step_model_without("frontend_s")},
            r"hardware\.step_model\.vllm-v1\.frontend_s: required key is missing$",
        ),
    ],
)
def test_bad_fidelity_settings_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        config(**changes)


def test_a_shipped_profile_prices_the_front_end_into_every_run():
    from tiered_kv.sim.config import config_from_raw, setup

    hw = load_hardware("h200")
    cfg = config_from_raw({"hardware": "h200", "model": "llama3-8b"}, "main")
    step = hw.step_for("vllm-v1")
    assert step is not None and step.frontend_s > 0 and setup(cfg, 0).compute.frontend_s == step.frontend_s
    off = config_from_raw({"hardware": "h200", "model": "llama3-8b", "compute": {"frontend_s": 0}}, "x")
    assert setup(off, 0).compute.frontend_s == 0.0  # the config's override wins


def test_the_front_end_shifts_a_saturated_run_and_changes_no_step():
    # Eight 4-token prompts with 3 output tokens each, all sent at once, at most four running: a step
    # runs every second from the first arrival to the last finish (eight steps; the 8-block pool preempts
    # one request once).  With 0.25 s of front end every event happens 0.25 s later: the steps (their
    # rows, their count, the preemption) and the busy span are the same, so the throughput over the busy
    # span is unchanged while every TTFT grows by exactly 0.25 s.
    changes = {
        "workload__num_requests": 8,
        "workload__arrival": {"process": "fixed", "rate": 1.0e9},
        "workload__output_len": {"dist": "fixed", "value": 3},
    }
    res0, sim0 = run(config(**changes), trace=True)
    res1, sim1 = run(config(compute__frontend_s=0.25, **changes), trace=True)
    shifted = [(round(t - 0.25, 9), kind, what) for t, kind, what in sim1.loop.trace]
    assert shifted == [(round(t, 9), kind, what) for t, kind, what in sim0.loop.trace]
    assert sum(e[1] == "step" for e in sim0.loop.trace) == 8
    assert [e for e in sim1.loop.trace if e[1] == "preempt_recompute"] == [(2.25, "preempt_recompute", 3)]
    assert res1["makespan_s"] - res0["makespan_s"] == pytest.approx(0.25, abs=1e-9)
    tokens = sum(r.output_tokens for r in sim1.records.values())
    assert tokens == 24
    assert tokens / (res1["makespan_s"] - 0.25) == pytest.approx(tokens / res0["makespan_s"], rel=1e-12)
    ttft0 = sorted(r.first_token - r.arrival for r in sim0.records.values())
    ttft1 = sorted(r.first_token - r.arrival for r in sim1.records.values())
    assert ttft1 == pytest.approx([t + 0.25 for t in ttft0], abs=1e-9)
    assert res1["tpot_s"] == res0["tpot_s"]


def test_chunked_prefill_attention_grows_with_the_cached_context_and_adds_up_to_the_whole_prompts():
    # TINY's model: one layer, attention width 64, 1e6 dense parameters, no vocabulary (no LM head), on
    # 1e12 FLOP/s.  One 4,000-token prompt in chunks of 1,000: chunk k (c = 1,000k cached tokens) costs
    # 2e6 * 1,000 dense FLOPs plus 2 * 64 * ((c + 1,000)^2 - c^2) attention FLOPs, both at prefill_mfu
    # (0.5; decode's mfu is 0.25 here and must not price them), plus 0.5 ms a step.  Compute-bound: a
    # step reads at most 2 MB of weights and 1 MB of KV at 80 GB/s (38 us).
    changes = {
        "compute__fixed_step_s": None,
        "compute__mfu": 0.25,
        "compute__prefill_mfu": 0.5,
        "memory__gpu_kv_gib": 2048 * KIB_IN_GIB,
        "workload__num_requests": 1,
        "workload__prompt_len": {"dist": "fixed", "value": 4000},
        "workload__output_len": {"dist": "fixed", "value": 1},
    }
    _, sim = run(config(scheduler__max_num_batched_tokens=1000, **changes), keep_timeline=True)
    rate = 1e12 * 0.5
    expected = [5e-4 + (2e6 * 1000 + 128 * ((c + 1000) ** 2 - c**2)) / rate for c in (0, 1000, 2000, 3000)]
    got = [s.compute_s for s in sim.steps]
    assert got == pytest.approx(expected, rel=1e-12)
    # each chunk's attention grows linearly with the cached context: 2 * 64 * 2 * 1,000^2 FLOPs more a chunk
    steps = [b - a for a, b in itertools.pairwise(got)]
    assert steps == pytest.approx([128 * 2 * 1000**2 / rate] * 3, rel=1e-9)
    # the chunks' attention adds up to the whole prompt's, 2 * 64 * 4,000^2: unchunked, one step that
    # costs the chunks' total less three steps' overhead
    _, whole = run(config(scheduler__max_num_batched_tokens=4000, **changes), keep_timeline=True)
    assert [s.compute_s for s in whole.steps] == pytest.approx([5e-4 + (2e6 * 4000 + 128 * 4000**2) / rate])
    assert sum(got) - 3 * 5e-4 == pytest.approx(whole.steps[0].compute_s, rel=1e-12)
