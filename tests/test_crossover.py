"""Crossover smoke run on a tiny model; the calibration it writes loads and drives the simulator."""

import json

import pytest
from simutil import TINY

from tiered_kv.engine.model import ModelConfig
from tiered_kv.errors import ConfigError
from tiered_kv.sim.calibration import load_calibration
from tiered_kv.sim.config import setup, validate_config
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate
from tiered_kv.tools.crossover import crossover, plot

TINY_MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
FIELDS = {"tokens", "blocks", "bytes", "swap_out_s", "swap_in_s", "swap_with_compute_s", "recompute_s", "winner"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("crossover")
    doc, cal = crossover(TINY_MODEL, block_size=4, lengths=[32, 64], repeats=1, emit=lambda s: None, step_scale=0.25)
    cal.save(out / "cal.json")
    (out / "doc.json").write_text(json.dumps(doc))
    return doc, out


def test_crossover_json_has_every_field_and_positive_times(measured):
    doc, out = measured
    assert [r["tokens"] for r in doc["rows"]] == [32, 64]
    for r in doc["rows"]:
        assert FIELDS <= set(r)
        assert r["swap_out_s"] > 0 and r["swap_in_s"] > 0 and r["swap_with_compute_s"] > 0 and r["recompute_s"] > 0
        assert r["winner"] == ("swap" if r["swap_out_s"] + r["swap_in_s"] < r["recompute_s"] else "recompute")
    assert doc["summary"] and 0 <= doc["step_fit_error"]
    assert plot(doc, out).stat().st_size > 1000


def test_calibration_file_loads_and_drives_the_simulator(measured):
    _, out = measured
    cal = load_calibration(out / "cal.json")
    assert cal.block_size == 4 and cal.model["hidden_size"] == 32
    assert cal.cost_model.d2h_bytes_per_s > 0 and cal.cost_model.h2d_bytes_per_s > 0
    assert all(c >= 0 for c in cal.step_model) and any(c > 0 for c in cal.step_model)
    raw = dict(TINY, memory={"block_size": 4, "gpu_blocks": 12, "cpu_blocks": 64, "activation_reserve_gib": 0})
    raw["runs"] = [{"name": "swap", "mode": "swap"}]
    cfg = validate_config(raw)
    st = setup(cfg, 0, cal)
    assert st.model.kv_bytes_per_token == 2 * 1 * 1 * 16 * 4
    assert st.cost_model == cal.cost_model and st.compute.linear == cal.step_model
    res = Simulator(st, generate(cfg["workload"], 0)).run()
    assert res["requests_finished"] == 2 and res["makespan_s"] > 0
    with pytest.raises(ConfigError, match=r"memory\.block_size: 16 differs from the calibration"):
        setup(
            validate_config(dict(raw, memory={"block_size": 16, "gpu_blocks": 12, "activation_reserve_gib": 0})), 0, cal
        )


def test_bad_calibration_files(tmp_path):
    p = tmp_path / "c.json"
    with pytest.raises(ConfigError, match="does not exist"):
        load_calibration(p)
    p.write_text('{"device": "cpu"}')
    with pytest.raises(ConfigError, match=r"calibration\.block_size: required key is missing"):
        load_calibration(p)


def test_fidelity_reports_predicted_against_measured(measured, tmp_path):
    import yaml

    from tiered_kv.tools.fidelity import METRICS, fidelity

    _, out = measured
    raw = {k: v for k, v in TINY.items() if k not in ("memory", "workload", "runs", "model")}
    raw["memory"] = {"block_size": 4, "gpu_blocks": 10, "cpu_blocks": 64, "activation_reserve_gib": 0}
    raw["workload"] = {
        "num_requests": 6,
        "arrival": {"process": "fixed", "rate": 1000.0},
        "prompt_len": {"dist": "fixed", "value": 12},
        "output_len": {"dist": "fixed", "value": 5},
    }
    raw["runs"] = [{"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0}, {"name": "swap", "mode": "swap"}]
    cfg = tmp_path / "fid.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    lines = []
    doc = fidelity(out / "cal.json", cfg, emit=lines.append)
    rows = {(r["run"], r["metric"]): r for r in doc["rows"]}
    for run in ("recompute", "swap"):
        for m in METRICS:
            assert (run, m) in rows
        tp = rows[(run, "throughput_rps")]
        assert tp["predicted"] > 0 and tp["measured"] > 0 and tp["error"] >= 0
        assert rows[(run, "preemptions")]["measured"] >= 0
    assert any("throughput error" in line for line in lines)
