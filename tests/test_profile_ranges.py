"""Every physical number of a profile is held to a plausible range for its unit; a slip is refused with the fix."""

import copy

import pytest
import yaml
from simutil import TINY, TOY_STEP

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.profiles import load_hardware, load_model
from tiered_kv.sim.shipped import shipped, shipped_names


def _shipped_hw(name="l40s"):
    return yaml.safe_load(shipped("hardware", name).read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"peak_bf16_flops": 121}, r"hardware\.peak_bf16_flops: 121 is 121 FLOP/s, .*; did you mean 121e12\?"),
        (
            {"hbm_bytes_per_s": 0.864},
            r"hardware\.hbm_bytes_per_s: 0\.864 is 0\.864 bytes/s, .*did you mean 0\.864e12\?",
        ),
        ({"memory_gib": 48e9}, r"hardware\.memory_gib: 4\.8e\+10 is 4\.8e\+10 GiB, .*; did you mean 48\?"),
        (
            {"link": {"h2d_gbps": 25.0e9, "per_copy_overhead_s": 2.35e-6}},
            r"hardware\.link\.h2d_gbps: .* GB/s, .*did you mean 25\?",
        ),
        (
            {"link": {"h2d_gbps": 25.0, "per_copy_overhead_s": 2.35}},
            r"hardware\.link\.per_copy_overhead_s: 2\.35 is 2\.35 s, .*did you mean 2\.35e-6\?",
        ),
        (
            {"step_model": {"vllm-v1": dict(TOY_STEP, frontend_s=32.7)}},
            r"hardware\.step_model\.vllm-v1\.frontend_s: 32\.7 is 32\.7 s, .*; did you mean 32\.7e-3\?",
        ),
        (
            {"allreduce": {"interconnect": "pcie", "latency_us": 42e-6, "small_gbps": 24.0, "small_max_bytes": 1048576,
                           "busbw_gbps": 24.0}},
            r"hardware\.allreduce\.latency_us: .* us, .*did you mean 42\?",
        ),
    ],
)  # fmt: skip
def test_a_unit_slip_in_a_hardware_profile_is_refused_with_the_unit_and_the_fix(change, message):
    raw = {**_shipped_hw(), **change}
    with pytest.raises(ConfigError, match=message):
        load_hardware(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_params": 8.03}, r"model\.num_params: 8\.03 is 8\.03 parameters, .*did you mean 8\.03e9\?"),
        ({"vocab_size": 128256000}, r"model\.vocab_size: 1\.28256e\+08 is 1\.28256e\+08 tokens"),
    ],
)
def test_a_unit_slip_in_a_model_profile_is_refused(change, message):
    raw = {**yaml.safe_load(shipped("models", "llama3-8b").read_text()), **change}
    with pytest.raises(ConfigError, match=message):
        load_model(raw)


@pytest.mark.parametrize("name", shipped_names("hardware"))
def test_every_shipped_hardware_profile_is_within_the_ranges(name):
    load_hardware(name)  # refused otherwise


def test_a_made_up_device_may_skip_the_ranges():
    toy = dict(TINY["hardware"])
    assert toy["skip_range_checks"] is True and load_hardware(toy).link.h2d_bytes_per_s == 4096.0
    with pytest.raises(ConfigError, match=r"hardware\.link\.h2d_gbps: 4\.096e-06 is 4\.096e-06 GB/s"):
        load_hardware(dict(toy, skip_range_checks=False))


def test_simulate_refuses_the_slip_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    raw = copy.deepcopy(TINY)
    raw["hardware"] = {**_shipped_hw(), "peak_bf16_flops": 121}
    raw["compute"] = {}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "c.yaml", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "hardware.peak_bf16_flops: 121 is 121 FLOP/s" in err and "did you mean 121e12?" in err
