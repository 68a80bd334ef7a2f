"""Config additions: regimes, baselines (vs), copy modes, vLLM v1's defaults, profile sources, the step model."""

import pytest
from simutil import TINY, config

from tiered_kv.cli.simulate import regime_configs
from tiered_kv.errors import ConfigError
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.config import DEFAULT_RUNS, load_config, setup
from tiered_kv.sim.profiles import load_hardware, load_model


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"runs": [{"name": "a", "vs": "b"}, {"name": "b"}]}, r"runs\[0\]\.vs: must name a run listed before it"),
        ({"runs": [{"name": "a", "copies": "eager"}]}, r"runs\[0\]\.copies: must be one of"),
        ({"runs": [{"name": "a", "kv_layout": "diagonal"}]}, r"runs\[0\]\.kv_layout: must be one of"),
        ({"regimes": []}, r"regimes: must list at least one regime"),
        ({"regimes": [{"name": "x"}]}, r"regimes\[0\]\.rate: required key is missing"),
        ({"regimes": [{"name": "x", "rate": -1}]}, r"regimes\[0\]\.rate: must be > 0"),
        ({"regimes": [{"name": "x", "rate": 1, "expect": "maybe"}]}, r"regimes\[0\]\.expect: must be one of"),
        ({"regimes": [{"name": "x", "rate": 1}, {"name": "x", "rate": 2}]}, r"regimes: regime names must be unique"),
        ({"compute__per_seq_s": -1}, r"compute\.per_seq_s: must be >= 0"),
        ({"hardware": dict(TINY["hardware"], link={"bidir_gbps": -1})}, r"hardware\.link\.bidir_gbps: must be >= 0"),
    ],
)
def test_bad_new_keys_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        config(**changes)


def test_regimes_override_the_rate_and_size():
    import copy

    raw = copy.deepcopy(TINY)
    raw["regimes"] = [{"name": "slow", "rate": 0.25, "expect": "below"}, {"name": "fast", "rate": 8, "num_requests": 5}]
    out = regime_configs(raw, "t", None, None)
    assert [(n, r, e) for n, r, e, _ in out] == [("slow", 0.25, "below"), ("fast", 8, None)]
    assert out[0][3]["workload"]["arrival"]["rate"] == 0.25 and out[0][3]["workload"]["num_requests"] == 2
    assert out[1][3]["workload"]["arrival"]["rate"] == 8 and out[1][3]["workload"]["num_requests"] == 5


def test_vllm_v1_defaults_depend_on_the_gpu():
    """1024 sequences and 8192 tokens on a GPU of >= 70 GiB that is not an A100; 256 and 2048 otherwise."""
    assert load_hardware("h200").vllm_default_limits == (1024, 8192)
    assert load_hardware("h100-sxm").vllm_default_limits == (1024, 8192)
    assert load_hardware("a100-80gb-sxm").vllm_default_limits == (256, 2048)
    assert load_hardware("l40s").vllm_default_limits == (256, 2048)
    st = setup(load_config(None), 0)
    assert (st.scheduler.max_num_seqs, st.scheduler.max_num_batched_tokens) == (1024, 8192)
    cfg = config(scheduler={"max_num_batched_tokens": 64})  # the toy GPU: 256 seqs, capped by the budget
    assert setup(cfg, 0).scheduler.max_num_seqs == 64


def test_default_runs_separate_the_effects():
    names = [(r["name"], r.get("vs")) for r in DEFAULT_RUNS]
    assert names == [
        ("recompute-only", None),
        ("recompute+cpu-tier", "recompute-only"),
        ("always-swap", "recompute-only"),
        ("cost-aware", "recompute-only"),
        ("cost-aware+cpu-tier", "recompute+cpu-tier"),
    ]
    cfg = load_config(None)
    assert [r["name"] for r in cfg["runs"]] == [n for n, _ in names]
    v0 = setup(cfg, 2)
    assert (v0.copies, v0.kv_layout, v0.coalesce) == ("blocking", "layer_first", False)
    assert all(setup(cfg, i).copies == "async" for i in (0, 1, 3, 4))
    assert [g["expect"] for g in cfg["regimes"]] == ["below", "over"]


def test_every_shipped_hardware_profile_has_a_link_step_model_and_sources():
    from tiered_kv.sim.shipped import shipped, shipped_names

    for name in shipped_names("hardware"):
        text = shipped("hardware", name).read_text()
        assert "link:" in text and "step_model:" in text and "allreduce:" in text, name
        hw = load_hardware(name)
        assert hw.link.bidir_bytes_per_s < hw.link.h2d_bytes_per_s + hw.link.d2h_bytes_per_s, name
        assert 0 < hw.link.per_copy_overhead_s < 1e-5, name


def test_the_step_model_excludes_the_embedding_table_and_counts_the_lm_head_per_sample():
    m = load_model("llama3-8b")
    embed = 128256 * 4096
    assert m.params_per_gpu == pytest.approx(8030261248 - 2 * embed)
    assert m.streamed_weight_bytes_per_gpu == pytest.approx((8030261248 - embed) * 2)
    hw = load_hardware("h200")
    cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
    # a compute-bound prefill of 4096 tokens sampling once: dense FLOPs + one LM-head row + attention
    flops = 2 * m.params_per_gpu * 4096 + 2 * embed + 2 * 32 * 4096 * 4096**2
    assert cm.step_time(4096, 4096**2, 4096, 1) == pytest.approx(flops / (989e12 * 0.5))
    # a memory-bound decode of one token with 100 tokens of context
    assert cm.step_time(1, 101**2 - 100**2, 101, 1) == pytest.approx(
        (m.streamed_weight_bytes_per_gpu + 101 * m.kv_bytes_per_token) / 4.8e12
    )
    tied = load_model("opt-13b")
    assert tied.params_per_gpu == pytest.approx(12.85e9 - 50272 * 5120)  # one table, shared with the LM head


def test_per_seq_and_allreduce_terms():
    hw = load_hardware("h100-sxm")
    m = load_model("llama3.1-70b-tp4")
    base = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
    more = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.001, per_seq_s=1e-4)
    assert more.step_time(8, 0, 8, 8) - base.step_time(8, 0, 8, 8) == pytest.approx(0.001 + 8e-4)
    # 8 tokens x 8192 x 2 B = 128 KiB per all-reduce: latency + bytes / small-message bandwidth, 2 per layer
    ar = 2 * 80 * (9.8e-6 + 131072 / 33.7e9)
    assert base.allreduce_time(8) == pytest.approx(ar)
    big = 8192 * 8192 * 2  # a prefill's all-reduce: the large-message part goes at the ring's rate
    assert hw.allreduce.seconds(big, 4) == pytest.approx(
        9.8e-6 + (1 << 20) / 33.7e9 + (big - (1 << 20)) / (370e9 * 4 / 6)
    )
    assert hw.allreduce.seconds(big, 1) == 0.0
    assert ComputeModel(hw, load_model("llama3-8b")).allreduce_time(8192) == 0.0  # one GPU: nothing to reduce


def test_the_a100_all_reduce_is_nvlink3s_not_the_h100s():
    # Llama-3-70B at TP4 on A100s: a decode row's 16 KiB all-reduce in the one-shot range at 22.5 GB/s, a
    # ten-prompt prefill's (1,369 tokens, 22.4 MB) at NCCL's ring with the A100's 200 GB/s bus bandwidth.
    hw, h100 = load_hardware("a100-80gb-sxm"), load_hardware("h100-sxm")
    m = load_model("llama3.1-70b-tp4")
    cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
    assert cm.allreduce_time(1) == pytest.approx(2 * 80 * (9.8e-6 + 16384 / 22.5e9), rel=1e-12)
    big = 1369 * 8192 * 2
    ring = 200e9 * 4 / 6  # the ring's algorithm bandwidth on 4 GPUs
    expected = 2 * 80 * (9.8e-6 + (1 << 20) / 22.5e9 + (big - (1 << 20)) / ring)
    assert cm.allreduce_time(1369) == pytest.approx(expected, rel=1e-12)
    # the same prefill's all-reduces cost the A100s 70% more than the H100s (NVLink3 against NVLink4)
    on_h100 = ComputeModel(h100, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0).allreduce_time(1369)
    assert cm.allreduce_time(1369) / on_h100 == pytest.approx(1.70, abs=0.005)
    assert load_hardware("a100-sxm4-40gb").allreduce == hw.allreduce  # same NVLink3
