"""Mixture-of-experts models: a token multiplies its experts only; a step reads every expert its tokens use."""

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.kv_pool import GIB
from tiered_kv.sim.profiles import load_hardware, load_model, model_profile_raw


def test_a_token_multiplies_its_experts_and_a_step_reads_the_experts_its_tokens_use():
    m = load_model("mixtral-8x7b")  # 8 experts of 3 x 4096 x 14336 a layer, 2 a token
    expert = 3 * 4096 * 14336
    heads = 2 * 32000 * 4096
    assert m.expert_params == expert
    assert m.params_per_gpu == 46702792704 - heads - 32 * 6 * expert  # 12.6B multiplied per token
    one = (m.params_per_gpu + m.lm_head_params_per_gpu) * 2
    assert m.streamed_weight_bytes(1) == pytest.approx(one)  # one token: its 2 experts a layer
    # four tokens touch 8 x (1 - (6/8)^4) = 5.47 experts a layer on average
    four = one + 32 * (8 * (1 - 0.75**4) - 2) * expert * 2
    assert m.streamed_weight_bytes(4) == pytest.approx(four)
    # a large batch reads (nearly) every expert: all the weights but the embedding table
    assert m.streamed_weight_bytes(512) == pytest.approx((46702792704 - 32000 * 4096) * 2, rel=1e-9)
    dense = load_model("llama3-8b")
    assert dense.streamed_weight_bytes(1) == dense.streamed_weight_bytes(512) == dense.streamed_weight_bytes_per_gpu


def test_the_step_prices_the_experts_it_reads():
    hw, m = load_hardware("h100-sxm"), load_model("qwen3-30b-a3b")
    cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
    # memory-bound decode steps of 1 and 32 requests (context 1000): weights read grow with the experts used
    for b in (1, 32):
        kv = b * 1000
        t = cm.step_time(b, float(b * 1999), kv, b)
        assert t == pytest.approx((m.streamed_weight_bytes(b) + kv * m.kv_bytes_per_token) / 3.35e12)
    assert cm.parts(32, 32 * 1999.0, 32000, 32).memory_bytes == pytest.approx(
        m.streamed_weight_bytes(32) + 32000 * m.kv_bytes_per_token
    )


def test_the_pool_holds_every_expert_and_tp_splits_them():
    raw = model_profile_raw("mixtral-8x7b")
    raw["tensor_parallel"] = 2
    cfg = config_from_raw({"hardware": "h100-sxm", "model": raw, "workload": {"num_requests": 1}})
    st = setup(cfg, 0)
    assert st.model.weight_bytes_per_gpu == pytest.approx(46702792704 / 2 * 2)
    assert st.gpu_kv_gib < 79.205 * 0.9 - 46702792704 / GIB


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"experts_per_token": 9}, r"model\.experts_per_token: must be 1 to num_experts \(8\), got 9"),
        ({"experts_per_token": 0}, r"model\.experts_per_token: must be 1 to num_experts \(8\), got 0"),
        ({"moe_intermediate_size": 0}, r"model\.moe_intermediate_size: required key is missing \(with num_experts 8\)"),
        ({"num_experts": 0}, r"model\.num_experts: required key is missing \(the model gives other experts' keys\)"),
    ],
)
def test_bad_expert_shapes_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        load_model({**model_profile_raw("mixtral-8x7b"), **change})
