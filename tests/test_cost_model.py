"""The swap/recompute cost model: formulas, limits, calibration and serialisation."""

import math

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.manager import CostModel


def test_transfer_time_is_bytes_over_bandwidth_plus_overhead_per_run():
    cm = CostModel(
        kv_bytes_per_token=2048, block_size=16, d2h_bytes_per_s=4e9, h2d_bytes_per_s=8e9, per_copy_overhead_s=1e-5
    )
    assert cm.bytes_per_block == 32768
    assert math.isclose(cm.swap_out_time(10, 3), 10 * 32768 / 4e9 + 3e-5)
    assert math.isclose(cm.swap_in_time(10, 1), 10 * 32768 / 8e9 + 1e-5)
    assert cm.swap_out_time(0, 0) == 0.0


def test_infinite_and_zero_bandwidth():
    free = CostModel(kv_bytes_per_token=1, d2h_bytes_per_s=math.inf, h2d_bytes_per_s=math.inf, per_copy_overhead_s=0)
    assert free.swap_out_time(1000, 5) == 0.0
    dead = CostModel(kv_bytes_per_token=1, d2h_bytes_per_s=0.0, h2d_bytes_per_s=0.0)
    assert dead.swap_in_time(1, 1) == math.inf


def test_prefill_time_grows_quadratically_with_context():
    cm = CostModel(
        kv_bytes_per_token=1, prefill_tokens_per_s=1000.0, prefill_quadratic_s_per_token2=2e-6, prefill_overhead_s=0.01
    )
    assert math.isclose(cm.recompute_time(100), 0.01 + 0.1 + 2e-6 * 100 * 100 / 2)
    # Chunked: the second half costs more than the first (attention over a longer context).
    assert cm.prefill_time(50, 50) - 0.01 > cm.prefill_time(50) - 0.01
    assert math.isclose(cm.prefill_time(50) + cm.prefill_time(50, 50), cm.recompute_time(100) + 0.01)


def test_from_flops():
    cm = CostModel.from_flops(
        kv_bytes_per_token=131072, num_params=8e9, num_layers=32, attn_dim=4096, peak_flops=989e12, mfu=0.5
    )
    rate = 989e12 * 0.5
    assert math.isclose(cm.prefill_tokens_per_s, rate / 16e9)
    # The docstring's attention FLOPs, 2 * layers * L^2 * attn_dim (QK^T and PV, causal), at the same rate.
    for length in (512, 4096, 32768):
        attention = cm.prefill_time(length) - length / cm.prefill_tokens_per_s
        assert math.isclose(attention, 2 * 32 * length**2 * 4096 / rate)
    assert math.isclose(cm.prefill_quadratic_s_per_token2, 4 * 32 * 4096 / rate)
    with pytest.raises(ConfigError, match="mfu"):
        CostModel.from_flops(1, 1e9, 1, 1, 1e12, 1.5)


def test_from_flops_agrees_with_the_simulators_compute_model():
    """The manager's recompute estimate and the simulator's step time count the same FLOPs."""
    from tiered_kv.sim.compute import ComputeModel
    from tiered_kv.sim.profiles import load_hardware, load_model

    hw, model = load_hardware("h200"), load_model("llama3-8b")
    compute = ComputeModel(hw, model, mfu=0.5, hbm_efficiency=0.8, step_overhead_s=0.0)
    cm = CostModel.from_flops(
        kv_bytes_per_token=model.kv_bytes_per_token,
        num_params=model.params_per_gpu,
        num_layers=model.num_layers,
        attn_dim=model.attn_dim_per_gpu,
        peak_flops=hw.peak_bf16_flops,
        mfu=0.5,
    )
    assert math.isclose(cm.prefill_quadratic_s_per_token2, compute.prefill_quadratic())
    assert math.isclose(cm.prefill_tokens_per_s, compute.prefill_tokens_per_s())


def test_calibration_recovers_parameters_from_measurements():
    truth = CostModel(
        kv_bytes_per_token=1024,
        d2h_bytes_per_s=20e9,
        h2d_bytes_per_s=25e9,
        per_copy_overhead_s=8e-6,
        prefill_tokens_per_s=12_000.0,
        prefill_quadratic_s_per_token2=3e-9,
        prefill_overhead_s=0.002,
    )
    transfers = []
    for d in ("D2H", "H2D"):
        for blocks, runs in ((10, 1), (100, 3), (400, 40), (1000, 7)):
            b = blocks * truth.bytes_per_block
            transfers.append((d, b, runs, truth.transfer_time(blocks, runs, d)))
    prefills = [(n, truth.recompute_time(n)) for n in (256, 1024, 4096, 8192)]
    fit = CostModel(kv_bytes_per_token=1024).calibrated(transfers, prefills)
    assert math.isclose(fit.d2h_bytes_per_s, 20e9, rel_tol=1e-6)
    assert math.isclose(fit.h2d_bytes_per_s, 25e9, rel_tol=1e-6)
    assert math.isclose(fit.per_copy_overhead_s, 8e-6, rel_tol=1e-6)
    assert math.isclose(fit.prefill_tokens_per_s, 12_000.0, rel_tol=1e-6)
    assert math.isclose(fit.prefill_quadratic_s_per_token2, 3e-9, rel_tol=1e-5)
    assert CostModel.from_dict(fit.to_dict()) == fit


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": 1, "block_size": -1}, "block_size"),
        ({"kv_bytes_per_token": 1, "d2h_bytes_per_s": -1.0}, "d2h_bytes_per_s must be a number >= 0"),
        ({"kv_bytes_per_token": 1, "prefill_tokens_per_s": 0}, "prefill_tokens_per_s must be > 0"),
        ({"kv_bytes_per_token": 1, "per_copy_overhead_s": "fast"}, "per_copy_overhead_s"),
    ],
)
def test_bad_parameters(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        CostModel(**kw)
    with pytest.raises(ConfigError, match="unknown key"):
        CostModel.from_dict({"kv_bytes_per_token": 1, "bandwidth": 3})
