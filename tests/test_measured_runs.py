"""Files of measured runs: read and checked, mapped to profiles and workloads, and judged by ``validate --runs``."""

import copy
import json
import math

import pytest
import yaml

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.measured_runs import (
    MeasuredRun,
    hardware_of,
    model_of,
    parse_run_set,
    predicted_metrics,
    run_config,
)
from tiered_kv.sim.records import RequestRecord
from tiered_kv.sim.validate import run_sets

RUN = {
    "id": "tiny-qwen",
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "hw": "H100",
    "tp": 1,
    "cpu_offload": True,
    "cpu_kv_gib_per_gpu": 8,
    "gpu_memory_utilization": 0.9,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 128,
    "workload": {
        "n_sys": 2, "n_users": 2, "sys_len": 100, "question_len": 400, "output_len": 20, "prompt_len": 510,
        "stages": [[4.0, 2], [8.0, 1]],
    },
    "measured": {
        "stage0": {"ttft_mean_ms": 30.0, "itl_mean_ms": 7.0, "e2e_mean_ms": 163.0, "client_output_mean": 20.0},
        "stage1": {"ttft_mean_ms": 30.0, "itl_mean_ms": 7.0, "e2e_mean_ms": 163.0, "client_output_mean": 20.0},
        "summary": {"ttft_mean_ms": 30.0, "itl_mean_ms": 7.0, "e2e_mean_ms": 163.0, "client_output_mean": 20.0},
    },
}  # fmt: skip


def _set(*runs, **extra):
    return parse_run_set({"experiments": [copy.deepcopy(r) for r in runs], **extra}, "test")


def test_the_shipped_set_reads_and_states_its_split():
    (rs,) = run_sets(["vllm-0.15.1-h100-runs"])
    assert rs.engine == "vllm-0.15.1" and len(rs.runs) == 11
    assert sorted(r.id for r in rs.select("fit")) == ["60", "63", "64", "67", "tv-l2-7b-codegen", "tv-l2-7b-general"]
    assert sorted(r.id for r in rs.select("check")) == ["61", "62", "65", "66", "tv-l2-7b-roleplay"]
    models = {model_of(r) for r in rs.runs}
    assert models == {"llama2-7b", "llama3.1-70b-tp4", "mistral-nemo-12b", "qwen2.5-7b", "yi-34b"}
    assert {hardware_of(r) for r in rs.runs} == {"h100-sxm"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"points": []}, r"test: not a file of measured runs \(it needs an 'experiments' list"),
        ({"experiments": []}, r"test\.experiments: must list at least one measured run"),
        ({"experiments": [dict(RUN, tp=0)]}, r"test\.experiments\[0\]\.tp: must be >= 1, got 0"),
        ({"experiments": [{k: v for k, v in RUN.items() if k != "measured"}]},
         r"test\.experiments\[0\]\.measured: required key is missing"),
        ({"experiments": [dict(RUN, measured={"stage2": RUN["measured"]["stage0"]})]},
         r"test\.experiments\[0\]\.measured\.stage2: not a stage of the workload \(stage0 to stage1"),
        ({"experiments": [dict(RUN, measured={"summary": {"ttft_mean_ms": 1.0, "itl_mean_ms": 1.0}})]},
         r"test\.experiments\[0\]\.measured\.summary\.e2e_mean_ms: required key is missing"),
        ({"experiments": [dict(RUN, workload=dict(RUN["workload"], stages=[[0, 1]]))]},
         r"test\.experiments\[0\]\.workload\.stages\[0\]: must be \[rate"),
        ({"experiments": [RUN, RUN]}, r"test\.experiments: run ids must be unique, 'tiny-qwen' appears twice"),
        ({"experiments": [RUN], "split": {"fit": ["nope"]}}, r"test\.split\.fit: no run 'nope' in the set"),
        ({"experiments": [RUN], "engine": "vllm"}, r"test\.engine: expected the engine and its version"),
    ],
)  # fmt: skip
def test_a_bad_run_set_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_run_set(raw, "test")


def test_profiles_are_found_by_name_or_by_hugging_face_id_and_the_gpu_by_its_name():
    rs = _set(
        RUN,
        dict(RUN, id="b", hw="A100", sim_model="model-mistral-nemo-12b-tp2.yaml", model="x/y"),
        dict(RUN, id="c", hw="L40S", model="01-ai/Yi-34B"),
        dict(RUN, id="d", hw="H200", hw_profile="l40s", model="meta-llama/Llama-3.1-8B-Instruct"),
        dict(RUN, id="e", hw="TPU", model="nobody/knows"),
        dict(RUN, id="f", hw="A100-40GB", model="mistralai/Mixtral-8x7B-v0.1"),  # the base of the Instruct
        dict(RUN, id="g", hw="A100 PCIe", model="meta-llama/Llama-2-7b-chat-hf"),
        dict(RUN, id="h", hw="H100", model="RedHatAI/Qwen2.5-7B-Instruct-FP8-dynamic"),  # FP8: not the BF16 one
    )
    got = [(hardware_of(r), model_of(r)) for r in rs.runs[:4] + rs.runs[5:7]]
    assert got == [
        ("h100-sxm", "qwen2.5-7b"),
        ("a100-80gb-sxm", "mistral-nemo-12b"),
        ("l40s", "yi-34b"),
        ("l40s", "llama3.1-8b"),
        ("a100-sxm4-40gb", "mixtral-8x7b"),
        ("a100-80gb-pcie", "llama2-7b"),
    ]
    with pytest.raises(ConfigError, match=r"no model profile for 'RedHatAI/Qwen2\.5-7B-Instruct-FP8-dynamic'"):
        model_of(rs.runs[7])
    with pytest.raises(ConfigError, match=r"test\.e\.hw: no hardware profile for 'TPU'"):
        hardware_of(rs.runs[4])
    with pytest.raises(ConfigError, match=r"test\.e\.model: no model profile for 'nobody/knows' \(add configs/models"):
        model_of(rs.runs[4])


def test_a_run_is_simulated_as_measured():
    (run,) = _set(dict(RUN, tp=2, model="meta-llama/Llama-3.1-70B-Instruct")).runs
    cfg = config_from_raw(run_config(run, "vllm-0.15.1"))
    st = setup(cfg, 0)
    assert st.model.tensor_parallel == 2 and st.model.name == "Llama-3.1-70B (TP=4)"  # the profile at the run's TP
    sp = cfg["workload"]["shared_prefix"]
    # the measured mean prompt (510) keeps the 100 system tokens; the question takes the rest
    assert (sp["systems"], sp["users_per_system"], sp["system_len"], sp["question_len"], sp["output_len"]) == (
        2, 2, 100, 410, 20,
    )  # fmt: skip
    assert (st.manager.offload, st.cpu_kv_gib) == ("write_through", 8.0)
    assert (st.scheduler.max_num_batched_tokens, st.scheduler.max_num_seqs) == (2048, 128)
    assert st.engine == "vllm-0.15.1" and st.async_scheduling and st.manager.block_size == 16


def test_itl_is_the_campaigns_formula_with_the_tokens_the_client_counted():
    # Two requests sent in stage 0 and one in stage 1; the client counted 11 tokens of each answer.
    run = MeasuredRun(dict(RUN, measured={
        "stage0": dict(RUN["measured"]["stage0"], client_output_mean=11.0),
        "stage1": dict(RUN["measured"]["stage1"], client_output_mean=11.0),
        "summary": dict(RUN["measured"]["summary"], client_output_mean=11.0),
    }), "test")  # fmt: skip
    recs = []
    for rid, (t0, first, last) in enumerate([(0.0, 0.03, 0.13), (0.5, 0.55, 0.75), (2.1, 2.14, 2.34)]):
        r = RequestRecord(rid, rid, t0, 510)
        r.first_token, r.finish = first, last
        recs.append(r)
    got = predicted_metrics(run, recs, [(4.0, 2.0), (8.0, 1.0)])
    assert got["stage0"]["ttft_mean_ms"] == pytest.approx(40.0)
    assert got["stage0"]["e2e_mean_ms"] == pytest.approx(190.0)
    assert got["stage0"]["itl_mean_ms"] == pytest.approx((190.0 - 40.0) / 10)
    assert got["stage1"]["ttft_mean_ms"] == pytest.approx(40.0) and got["stage1"]["e2e_mean_ms"] == pytest.approx(240.0)
    assert got["summary"]["e2e_mean_ms"] == pytest.approx((130 + 250 + 240) / 3)
    assert math.isclose(got["summary"]["itl_mean_ms"], (got["summary"]["e2e_mean_ms"] - 40.0) / 10)


def test_validate_runs_prints_measured_predicted_and_ratio_and_the_summaries(tmp_path, capsys):
    f = tmp_path / "held-out.json"
    f.write_text(json.dumps({"experiments": [RUN], "split": {"fit": []}}))
    assert main(["validate", "--runs", str(f), "--only-runs", "--no-progress", "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "held-out: measured runs of vllm-0.15.1 (means in ms)" in out
    assert "tiny-qwen          stage0  TTFT       30.00" in out
    assert "stages, check runs" in out and "median abs error" in out and "within ±15%" in out
    doc = json.loads((tmp_path / "v.json").read_text())
    rows = doc["runs"]
    assert {(r["stage"], r["metric"]) for r in rows} == {
        (s, m) for s in ("stage0", "stage1", "summary") for m in ("ttft_mean_ms", "itl_mean_ms", "e2e_mean_ms")
    }
    assert all(r["ratio"] == pytest.approx(r["predicted"] / r["measured"]) for r in rows)
    assert doc["run_summaries"]["held-out"][0]["label"] == "stages, check runs"


def test_validate_runs_refuses_another_format_with_one_line(tmp_path, capsys):
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump({"name": "an experiment config"}))
    assert main(["validate", "--runs", str(f), "--only-runs", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "x: not a file of measured runs" in err


def test_a_run_the_simulator_cannot_express_is_listed_and_the_others_are_judged(tmp_path, capsys):
    f = tmp_path / "mixed.json"
    f.write_text(json.dumps({"experiments": [RUN, dict(RUN, id="moe", model="nobody/knows-7B")]}))
    assert main(["validate", "--runs", str(f), "--only-runs", "--no-progress", "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen          stage0  TTFT" in out
    assert "NOT SIMULATED moe: mixed.moe.model: no model profile for 'nobody/knows-7B'" in out
    doc = json.loads((tmp_path / "v.json").read_text())
    assert {r["run"] for r in doc["runs"]} == {"tiny-qwen"}
    assert doc["runs_not_simulated"]["mixed"][0]["run"] == "moe"


def test_a_run_on_a_gpu_without_the_eras_step_model_says_it_ran_uncalibrated(tmp_path, capsys):
    f = tmp_path / "two-gpus.json"
    f.write_text(json.dumps({"experiments": [RUN, dict(RUN, id="on-l40s", hw="L40S")]}))
    assert main(["validate", "--runs", str(f), "--only-runs", "--no-progress", "--json", str(tmp_path / "v.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "two-gpus: measured runs of vllm-0.15.1 (means in ms)"
    note = "note: runs on-l40s: L40S has no step model for vllm-v1 (vllm-0.15.1): running UNCALIBRATED"
    assert lines[2].startswith(note)
    assert lines[3].startswith("run ")  # the H100 run is calibrated: no note names it
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["runs_uncalibrated"]["two-gpus"] == [{"run": "on-l40s", "note": lines[2].split(": ", 2)[2]}]
