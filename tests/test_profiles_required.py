"""Profiles give every physical number, or derive it by a stated rule that the run prints; the impossible is refused.

A profile that leaves a number out must not simulate some other machine:
``name: L4`` alone used to get an 80 GiB GPU with a 64 GB/s link, and a model
without ``num_layers`` got 32 of them.
"""

import copy
import re

import pytest
import yaml
from simutil import TINY, TOY_STEP, config

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import derived_fields, setup
from tiered_kv.sim.profiles import load_hardware, load_model
from tiered_kv.sim.shipped import shipped_names

HW = TINY["hardware"]
MODEL = TINY["model"]


def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


@pytest.mark.parametrize(
    ("hardware", "message"),
    [
        ({"name": "L4"}, r"hardware\.memory_gib: required key is missing \(also missing: hardware\.peak_bf16_flops, "),
        (without(HW, "memory_gib"), r"hardware\.memory_gib: required key is missing$"),
        (without(HW, "hbm_bytes_per_s"), r"hardware\.hbm_bytes_per_s: required key is missing"),
        (
            dict(HW, step_model=dict(TOY_STEP)),
            r"hardware\.step_model\.frontend_s: the step model is given per engine era: put these numbers under "
            r"hardware\.step_model\.vllm-v1 \(measured on vLLM 0\.8 or later\) or hardware\.step_model\.vllm-v0",
        ),
        (
            dict(HW, step_model={"vllm-v2": dict(TOY_STEP)}),
            r"hardware\.step_model\.vllm-v2: unknown engine era \(known: vllm-v1, vllm-v0\)",
        ),
        (
            dict(HW, step_model={"vllm-v1": without(TOY_STEP, "per_layer_s")}),
            r"hardware\.step_model\.vllm-v1\.per_layer_s: required key is missing$",
        ),
        (
            without(HW, "link"),
            r"hardware\.link\.h2d_gbps: required key is missing \(also missing: hardware\.link\.per_copy_overhead_s\)",
        ),
        (dict(HW, link={"h2d_gbps": 1.0}), r"hardware\.link\.per_copy_overhead_s: required key is missing$"),
        # The older names of the link's numbers are refused with the key that replaced each.
        (
            dict(HW, pcie_gbps_per_direction=10.0, pcie_efficiency=0.8),
            r"hardware\.pcie_gbps_per_direction: renamed: give link\.h2d_gbps, the one-way bandwidth",
        ),
        (dict(HW, pcie_efficiency=0.8), r"hardware\.pcie_efficiency: renamed: give link\.h2d_gbps"),
        (
            dict(HW, per_copy_overhead_s=1e-6),
            r"hardware\.per_copy_overhead_s: moved: give link\.per_copy_overhead_s: 1e-06 \(seconds\)",
        ),
        (
            dict(HW, link=dict(HW["link"], per_copy_us=2.35)),
            r"hardware\.link\.per_copy_us: renamed: give link\.per_copy_overhead_s, in seconds \(2\.35 us is "
            r"2\.35e-6\)",
        ),
        (
            dict(HW, step_model={"vllm-v1": dict(TOY_STEP, per_step_s=5e-4)}),
            r"hardware\.step_model\.vllm-v1\.per_step_s: renamed: give step_overhead_s: 0\.0005",
        ),
        (
            dict(HW, link=dict(HW["link"], bidir_gbps=1.0)),
            r"hardware\.link\.bidir_gbps: 1 GB/s both ways exceeds H2D \+ D2H \(8\.192e-06 GB/s\)",
        ),
        (
            dict(HW, allreduce={"latency_us": 10.0}),
            r"hardware\.allreduce\.interconnect: required key is missing "
            r"\(it goes with hardware\.allreduce\.latency_us\)",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_hardware_profile_without_a_physical_number_is_refused(hardware, message):
    with pytest.raises(ConfigError, match=message):
        config(hardware=hardware)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (without(MODEL, "num_layers"), r"model\.num_layers: required key is missing"),
        (without(MODEL, "num_params"), r"model\.num_params: required key is missing"),
        (without(MODEL, "num_kv_heads"), r"model\.num_kv_heads: required key is missing"),
        (without(MODEL, "dtype"), r"model\.dtype: required key is missing"),
        (without(MODEL, "vocab_size"), r"model\.vocab_size: required key is missing"),
        (
            dict(MODEL, num_heads=32, num_kv_heads=7, hidden_size=2048, head_dim=64),
            r"model\.num_kv_heads: 7 does not divide model\.num_heads \(32\)",
        ),
        (
            dict(MODEL, num_heads=6, hidden_size=64, head_dim=None),
            r"model\.head_dim: required key is missing \(it cannot be derived: model\.hidden_size 64 is not a "
            r"multiple of model\.num_heads 6\)",
        ),
        (dict(MODEL, num_heads=4, num_kv_heads=4, tensor_parallel=3), r"model\.tensor_parallel: 3 does not divide"),
        (
            dict(MODEL, num_heads=24, num_kv_heads=6, tensor_parallel=4),
            r"model\.tensor_parallel: 4 GPUs can neither split model\.num_kv_heads \(6\) evenly nor replicate them",
        ),
        (
            dict(MODEL, vocab_size=1000),
            r"model\.tie_word_embeddings: required key is missing \(with vocab_size 1000",
        ),
        (
            dict(MODEL, num_params=1000.0),
            r"model\.num_params: 1000 is fewer than the embedding tables \(0\) and the attention projections "
            r"of 1 layers \(1\.638e\+04\) alone",
        ),
        (
            dict(MODEL, num_heads=2, num_kv_heads=2, tensor_parallel=2),
            r"hardware\.allreduce: required key is missing \(model toy runs on 2 GPUs",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_model_profile_without_a_shape_or_with_an_impossible_one_is_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        config(model=model)


def test_derived_numbers_follow_the_stated_rules_and_are_listed():
    model = dict(without(MODEL, "head_dim"), hidden_size=256, num_heads=4, num_kv_heads=2)
    st = setup(config(model=model), 0)
    assert (st.model.head_dim, st.model.weight_dtype_bytes, st.model.tensor_parallel) == (64, 2, 1)
    assert st.link.d2h_bytes_per_s == st.link.h2d_bytes_per_s == 4.096e-6 * 1e9
    assert st.link.bidir_bytes_per_s == 2 * 4.096e3
    assert derived_fields(st) == [
        "hardware.link.d2h_gbps = 4.096e-06 (the H2D bandwidth: a symmetric link)",
        "hardware.link.bidir_gbps = 8.192e-06 (H2D + D2H: full duplex, no shared cap)",
        "model.head_dim = 64 (hidden_size / num_heads)",
        "model.weight_dtype = float16 (the KV dtype)",
        "model.tensor_parallel = 1 (one GPU)",
        # (1e6 parameters - 256 x 2 x (4 + 2) x 64 of attention projections) / (3 x 256): a gated MLP's width
        "model.intermediate_size = 1046 (the parameters left after the tables and the attention, as a gated MLP)",
    ]


def test_a_profile_that_gives_everything_derives_nothing():
    hw = dict(
        HW,
        link={"h2d_gbps": 2.0, "d2h_gbps": 3.0, "bidir_gbps": 4.0, "per_copy_overhead_s": 5e-6},
    )
    model = dict(MODEL, weight_dtype="float16", tensor_parallel=1, intermediate_size=5120)
    st = setup(config(hardware=hw, model=model), 0)
    assert derived_fields(st) == []
    assert (st.link.h2d_bytes_per_s, st.link.d2h_bytes_per_s, st.link.bidir_bytes_per_s) == (2e9, 3e9, 4e9)
    assert st.link.per_copy_overhead_s == pytest.approx(5e-6)


@pytest.mark.parametrize("name", shipped_names("hardware"))
def test_every_shipped_hardware_profile_gives_every_number(name):
    assert load_hardware(name).derived == ()


@pytest.mark.parametrize("name", shipped_names("models"))
def test_every_shipped_model_profile_gives_every_shape(name):
    # Only the weights' dtype is left to its rule (the same as the KV's) where the model card says nothing else.
    m = load_model(name)
    assert m.derived in ((f"model.weight_dtype = {m.dtype} (the KV dtype)",), ())
    assert m.weight_dtype is not None or m.derived


def test_simulate_refuses_an_l4_profile_with_only_a_name(tmp_path, monkeypatch, capsys):
    raw = copy.deepcopy(TINY)
    raw["hardware"] = "l4.yaml"
    (tmp_path / "l4.yaml").write_text("name: L4\n")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "c.yaml", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(
        r"tiered-kv simulate: hardware\.memory_gib: required key is missing \(also missing: "
        r"hardware\.peak_bf16_flops, hardware\.hbm_bytes_per_s, hardware\.link\.h2d_gbps, "
        r"hardware\.link\.per_copy_overhead_s\)\n",
        err,
    ), err


def test_simulate_prints_what_it_derived(tmp_path, monkeypatch, capsys):
    raw = copy.deepcopy(TINY)
    raw["model"] = dict(without(MODEL, "head_dim"), weight_dtype="float16", tensor_parallel=1, intermediate_size=5120)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "c.yaml", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("derived, not given"))
    # One sentence, wrapped at spaces to fit 100 columns.
    assert lines[start : start + 3] == [
        "derived, not given in the profiles: hardware.link.d2h_gbps = 4.096e-06 (the H2D bandwidth: a",
        "  symmetric link); hardware.link.bidir_gbps = 8.192e-06 (H2D + D2H: full duplex, no shared cap);",
        "  model.head_dim = 64 (hidden_size / num_heads)",
    ]


def test_a_tier_medium_the_profile_does_not_describe_is_listed_as_derived():
    run = {
        "name": "disk",
        "mode": "recompute",
        "offload": "write_through",
        "tiers": [{"type": "disk", "capacity_blocks": 16}],
    }
    st = setup(config(runs=[run]), 0)
    assert derived_fields(st)[-1] == (
        "hardware.tiers.disk = the manager's measured DISK link (the profile describes no disk)"
    )
    described = dict(HW, tiers={"disk": {"bandwidth_gbps": 1.0, "block_latency_us": 10}})
    assert not any("tiers" in d for d in derived_fields(setup(config(runs=[run], hardware=described), 0)))
