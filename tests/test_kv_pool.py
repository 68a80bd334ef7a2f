"""The GPU KV pool as vLLM's memory profile sizes it, against the block counts vLLM logged."""

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.engine_version import parse_engine
from tiered_kv.sim.kv_pool import ACTIVATION_FACTOR, GIB, NON_TORCH_GIB, SAMPLER_BYTES, vllm_kv_budget
from tiered_kv.sim.measured_runs import run_config
from tiered_kv.sim.profiles import load_hardware, load_model
from tiered_kv.sim.validate import run_sets


def _logged():
    (rs,) = run_sets(["vllm-0.15.1-h100-runs"])
    return rs, [r for r in rs.runs if r.raw["vllm_kv_blocks"]]


def test_the_pool_is_within_3_percent_of_every_block_count_vllm_logged():
    # Eight H100 runs of vLLM 0.15.1 (five models, TP 1, 2 and 4, token budgets 1024 to 8192) logged
    # their GPU and CPU KV block counts; the old sizing (74.5 GiB, a flat 2 GiB reserve) was 8-13% short.
    rs, logged = _logged()
    assert len(logged) == 8
    for run in logged:
        st = setup(config_from_raw(run_config(run, rs.engine)), 0)
        want = run.raw["vllm_kv_blocks"]
        gpu = st.manager.num_gpu_blocks
        assert abs(gpu / want["gpu_blocks"] - 1) <= 0.03, (run.id, gpu, want)
        # the CPU offloading connector's 8 GiB per GPU, in blocks of the same size
        assert abs(st.manager.num_cpu_blocks - want["cpu_blocks"]) <= 1, (run.id, st.manager.num_cpu_blocks, want)


def test_the_budget_is_vllms_terms_by_hand():
    # Qwen2.5-7B on one H100 at gpu_memory_utilization 0.9, 2048 tokens a step, 128 sequences, vLLM 0.15.1.
    hw, m = load_hardware("h100-sxm"), load_model("qwen2.5-7b")
    b = vllm_kv_budget(hw, m, 0.9, 2048, 128, parse_engine("vllm-0.15.1"))
    assert b.requested_gib == pytest.approx(79.205 * 0.9)
    assert b.weights_gib == pytest.approx(7615616512 * 2 / GIB)
    assert b.activation_gib == pytest.approx(ACTIVATION_FACTOR * 2048 * (2 * 18944 + 3584) * 2 / GIB)
    assert b.sampler_gib == pytest.approx(SAMPLER_BYTES * 128 * 152064 / GIB)
    assert b.non_torch_gib == NON_TORCH_GIB[1] and b.cudagraph_gib == 0.0
    total = b.requested_gib - b.weights_gib - b.activation_gib - b.sampler_gib - b.non_torch_gib
    assert b.kv_gib == pytest.approx(total)
    # from vLLM 0.21.0 the CUDA graphs' estimate is taken too (the config may give it)
    later = vllm_kv_budget(hw, m, 0.9, 2048, 128, parse_engine("vllm-0.33.0"), cudagraph_gib=1.5)
    assert later.kv_gib == pytest.approx(b.kv_gib - 1.5)
    # tensor parallelism: a quarter of the weights and of the MLP's activations, more memory outside torch
    tp = load_model({**_model_raw("llama3.1-70b-tp4")})
    b4 = vllm_kv_budget(hw, tp, 0.9, 8192, 128, parse_engine("vllm-0.15.1"))
    assert b4.weights_gib == pytest.approx(70553706496 / 4 * 2 / GIB)
    assert b4.non_torch_gib == NON_TORCH_GIB[2]


def _model_raw(name):
    from tiered_kv.sim.profiles import model_profile_raw

    return model_profile_raw(name)


def test_a_model_that_does_not_fit_names_what_the_profile_took():
    raw = {"hardware": "l40s", "model": "codellama-34b", "workload": {"num_requests": 1}}
    with pytest.raises(ConfigError, match=r"model: CodeLlama-34B needs 62\.9 GiB of weights per GPU .*vLLM's memory"):
        config_from_raw(raw)


def test_an_explicit_activation_reserve_replaces_the_profile():
    base = {"hardware": "h100-sxm", "model": "llama3-8b", "workload": {"num_requests": 1}}
    st = setup(config_from_raw({**base, "memory": {"activation_reserve_gib": 2.0}}), 0)
    assert st.gpu_kv_gib == pytest.approx(79.205 * 0.9 - 2.0 - 8030261248 * 2 / GIB)
