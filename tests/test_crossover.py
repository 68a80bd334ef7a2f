"""Crossover smoke run on a tiny model; the calibration it writes loads and drives the simulator."""

import json

import pytest
from simutil import TINY

from tiered_kv.bench.crossover import crossover, plot
from tiered_kv.engine.model import ModelConfig
from tiered_kv.errors import ConfigError
from tiered_kv.sim.calibration import load_calibration
from tiered_kv.sim.config import setup, validate_config
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

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

    from tiered_kv.cli.fidelity import METRICS, fidelity

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


# ---------------------------------------------------------------- repeats, spreads and rows


def test_every_point_is_repeated_and_its_spread_kept(measured):
    doc, _ = measured
    for r in doc["rows"]:
        for key in ("swap_out", "swap_in", "swap_with_compute", "recompute"):
            s = r[key]
            assert s["n"] == 1 and s["min"] <= s["median"] <= s["max"] and s["median"] == r[f"{key}_s"]


def test_rows_reach_the_row_file_as_they_are_measured(tmp_path):
    from tiered_kv.bench.timing import RowFile

    seen = []
    path = tmp_path / "rows.jsonl"

    def emit(line):  # each table line comes after its row was written and flushed
        if line.strip().startswith(("32 ", "64 ")):
            seen.append(len(path.read_text().splitlines()))

    with RowFile(path) as rows:
        crossover(TINY_MODEL, block_size=4, lengths=[32, 64], repeats=2, emit=emit, step_scale=0.1, rows=rows)
    assert seen == [1, 2]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["tokens"] for r in lines] == [32, 64] and all(r["recompute"]["n"] == 2 for r in lines)


# ---------------------------------------------------------------- a user's model (--model)


def test_spread_summarises_samples():
    from tiered_kv.bench.timing import relative_spread, spread

    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s["min"], s["median"], s["max"], s["n"]) == (1.0, 2.5, 10.0, 4)
    assert relative_spread(s) == pytest.approx(9.0 / 2.5)
    with pytest.raises(ValueError):
        spread([])


def test_fit_link_recovers_a_line():
    from tiered_kv.bench.crossover import fit_link

    points = ((1e8, 1), (4e8, 2), (8e8, 9))
    samples = [(d, b, c, b / bw + c * 20e-6) for d, bw in (("D2H", 20e9), ("H2D", 25e9)) for b, c in points]
    got = fit_link(samples)
    assert got["d2h_bytes_per_s"] == pytest.approx(20e9) and got["h2d_bytes_per_s"] == pytest.approx(25e9)
    assert got["per_copy_overhead_s"] == pytest.approx(20e-6)
    one = fit_link([("D2H", 1e9, 1, 0.1), ("H2D", 1e9, 1, 0.05)])  # one sample each: bytes over seconds
    assert one["d2h_bytes_per_s"] == pytest.approx(1e10) and one["h2d_bytes_per_s"] == pytest.approx(2e10)
    assert one["per_copy_overhead_s"] == 0


def test_fitted_crossover_finds_where_the_line_meets_the_curve():
    """Swap costs 2 us a token; recompute 1 us a token plus q * L / 2: they meet at L = 2e-6 / q = 1000."""
    from tiered_kv.bench.crossover import fitted_crossover
    from tiered_kv.manager.pricing import CostModel

    cm = CostModel(
        kv_bytes_per_token=1000,
        block_size=1,
        d2h_bytes_per_s=1e9,
        h2d_bytes_per_s=1e9,
        per_copy_overhead_s=0.0,
        prefill_tokens_per_s=1e6,
        prefill_quadratic_s_per_token2=2e-9,
    )
    got = fitted_crossover(cm, 0.0, 16)
    assert got["short"] == "recompute" and got["long"] == "swap" and 999 <= got["tokens"] <= 1001
    flat = fitted_crossover(CostModel(kv_bytes_per_token=1000, block_size=1, prefill_tokens_per_s=1e3), 0.0, 16)
    assert flat == {"short": "swap", "long": "swap", "tokens": None}


def _profile(tmp_path, *extra):
    from tiered_kv.cli import main

    out = tmp_path / "cal.json"
    argv = ["crossover", "--model", "llama3-8b", "--lengths", "512,1024,2048", "--repeats", "2"]
    return main([*argv, "--calibration-out", str(out), "--no-progress", *extra]), out


def test_crossover_for_a_model_profile_answers_and_saves_each_row(tmp_path, capsys):
    rc, out = _profile(tmp_path, "--hardware", "h200", "--json", str(tmp_path / "doc.json"))
    assert rc == 0
    text = capsys.readouterr().out
    assert "no GPU here" in text and "not a PCIe measurement" in text  # this machine's link is host memory
    assert "compute: roofline of H200 at MFU 0.5" in text
    assert text.count(" swap\n") + text.count(" recompute\n") == 3  # a row per length
    rows = [json.loads(x) for x in (tmp_path / "cal-rows.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [512, 1024, 2048]
    for r in rows:
        assert r["bytes"] == r["tokens"] * 131072  # Llama-3-8B: 128 KiB of KV per token
        for key in ("swap_out", "swap_in"):
            assert r[key]["n"] == 2 and 0 < r[key]["min"] <= r[key]["median"] <= r[key]["max"]
        assert r["winner"] == ("swap" if r["swap_s"] < r["recompute_s"] else "recompute")
        assert r["swap_profile_s"] > 0
    doc = json.loads((tmp_path / "doc.json").read_text())
    assert doc["answer"] in text and doc["model"]["num_layers"] == 32
    cal = load_calibration(out)
    assert cal.model["num_kv_heads"] == 8 and cal.block_size == 16
    assert cal.cost_model.kv_bytes_per_token == 131072 and cal.cost_model.d2h_bytes_per_s > 0
    # The simulator, given this calibration, simulates the user's model (not a small one).
    assert cal.model_profile().kv_bytes_per_token == 131072


def test_a_calibration_of_the_same_model_prices_recompute(tmp_path, capsys):
    rc, first = _profile(tmp_path, "--hardware", "h200")
    assert rc == 0
    cal = load_calibration(first)
    (tmp_path / "again").mkdir()
    rc, _ = _profile(tmp_path / "again", "--calibration", str(first))
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "again" / "cal-rows.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["recompute_s"] == pytest.approx(cal.cost_model.recompute_time(r["tokens"]))
        assert r["recompute_source"].startswith(f"calibration {first}")


def test_a_calibration_of_another_model_is_refused(measured, capsys):
    from tiered_kv.cli import main

    _, out = measured
    assert main(["crossover", "--model", "llama3-8b", "--calibration", str(out / "cal.json")]) == 2
    err = capsys.readouterr().err
    assert "measured on a model with num_layers 1, but --model Llama-3-8B has 32" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama3-8b"], r"recompute needs a compute source: --hardware PROFILE"),
        (["--model", "llama3-8b", "--hardware", "h200", "--layers", "2"], r"--layers: the model comes from --model"),
        (["--hardware", "h200"], r"--hardware: applies to --model only"),
        (["--model", "nope", "--hardware", "h200"], r"--model: no models profile 'nope'"),
        (["--model", "llama3-8b", "--hardware", "h200", "--lengths", "8"], r"8 tokens is less than one block of 16"),
        (["--model", "llama3-8b", "--hardware", "h200", "--mfu", "2"], r"--mfu: expected a number in \(0, 1\]"),
    ],
)
def test_bad_model_arguments_are_one_line(argv, message, tmp_path, capsys):
    import re

    from tiered_kv.cli import main

    assert main(["crossover", *argv, "--calibration-out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not list(tmp_path.iterdir())


def test_memory_is_estimated_first_and_what_does_not_fit_is_refused_with_numbers(tmp_path, capsys):
    import re

    from tiered_kv.cli import main

    argv = ["crossover", "--model", "llama3-8b", "--hardware", "h200", "--lengths", "100000000"]
    assert main([*argv, "--calibration-out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "crossover for Llama-3-8B up to 100000000 tokens needs" in err
    assert re.search(r"needs [\d.]+ TiB of host memory \(CPU tier [\d.]+ TiB, GPU tier [\d.]+ TiB in host memory", err)
    assert re.search(r"but only [\d.]+ [MGT]iB is available", err)
    fits = int(err.split("the longest context that fits is about ")[1].split()[0])
    assert 0 < fits < 100_000_000 and f"--max-tokens {fits}" in err
    assert not list(tmp_path.iterdir())  # refused before anything was written
