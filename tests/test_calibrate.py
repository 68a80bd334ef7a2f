"""``tiered-kv calibrate``: one's own measurements in, a GPU's step model out; bad input refused with one line."""

import copy
import json
import re

import pytest
import yaml

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.measured_runs import parse_run_set
from tiered_kv.sim.measurements import Settings, bench_run, read_measurements, read_startup_log
from tiered_kv.sim.profiles import StepProfile, load_hardware, load_model
from tiered_kv.sim.run_fit import fit_runs
from tiered_kv.sim.shipped import shipped
from tiered_kv.sim.validate import run_sets
from tiered_kv.sim.validate_runs import simulate_run, summaries, validate_set

QWEN = {
    "id": "qwen",
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "hw": "H100",
    "tp": 1,
    "gpu_memory_utilization": 0.9,
    "max_num_batched_tokens": 2048,
    "max_num_seqs": 64,
    "workload": {"n_sys": 2, "n_users": 2, "sys_len": 64, "question_len": 200, "output_len": 24,
                 "stages": [[30.0, 4], [80.0, 2]]},
}  # fmt: skip
LLAMA = dict(QWEN, id="llama", model="meta-llama/Llama-3.1-8B-Instruct")
TRUTH = StepProfile(
    mfu=0.6, prefill_mfu=0.7, hbm_efficiency=0.8, step_overhead_s=1.0e-3, per_seq_s=2e-5, frontend_s=0.006,
    per_layer_s=1.0e-5,
)  # fmt: skip


def _measured_by_the_simulator(run_raw, truth):
    """A run whose 'measurements' are the simulator's own means at known coefficients."""
    raw = copy.deepcopy(run_raw)
    dummy = {"ttft_mean_ms": 1.0, "itl_mean_ms": 1.0, "e2e_mean_ms": 1.0}
    raw["measured"] = {"stage0": dummy, "stage1": dummy}
    (probe,) = parse_run_set({"experiments": [raw]}, "t").runs
    overrides = {f"compute.{k}": getattr(truth, k) for k in truth.__dataclass_fields__}
    predicted, _ = simulate_run(probe, "vllm-0.15.1", overrides)
    raw["measured"] = {k: predicted[k] for k in ("stage0", "stage1")}
    return raw


def test_a_fit_recovers_what_the_measurements_determine():
    # 'Measurements' made by the simulator at known coefficients, of two models near 8B parameters at two
    # loads each; the fit starts far away (vLLM 0.6-like costs).  What such runs determine: the front
    # end, and the step time over the batches they ran; HBM efficiency and the fixed cost per step trade
    # off against each other at one model size, so they are checked through the step time they give.
    runs_raw = [_measured_by_the_simulator(r, TRUTH) for r in (QWEN, LLAMA)]
    runs = parse_run_set({"experiments": runs_raw}, "synthetic").runs
    start = StepProfile(0.6, 0.7, 0.6, 3e-4, 6e-5, 0.03, 0.0)
    fit = fit_runs(runs, "vllm-0.15.1", start, iters=6, stage_scale=1.0)
    errs = [abs(r - 1) for _, r in fit.residuals()]
    assert max(errs) < 0.02, errs
    assert fit.coef["frontend_s"] == pytest.approx(0.006, rel=0.05)
    hw, m = load_hardware("h100-sxm"), load_model("llama3.1-8b")

    def step(p):  # a decode step of 8 requests at 300 tokens of context each
        cm = ComputeModel(
            hw, m, p["mfu"], p["hbm_efficiency"], p["step_overhead_s"], per_seq_s=p["per_seq_s"],
            prefill_mfu=p["prefill_mfu"], per_layer_s=p["per_layer_s"],
        )  # fmt: skip
        return cm.step_time(8, 8 * 601.0, 8 * 300, 8)

    truth = {k: getattr(TRUTH, k) for k in TRUTH.__dataclass_fields__}
    assert step({**fit.fixed, **fit.coef}) == pytest.approx(step(truth), rel=0.03)


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([("config.yaml", {"name": "exp", "workload": {"num_requests": 3}})],
         r"calibrate: '.*config\.yaml' is none of the formats calibrate reads"),
        ([("two.yaml", {"experiments": [dict(QWEN, measured={"stage0": {"ttft_mean_ms": 1, "itl_mean_ms": 1,
                                                                       "e2e_mean_ms": 9}}),
                                         dict(LLAMA, hw="L40S", measured={"stage0": {"ttft_mean_ms": 1,
                                                                                     "itl_mean_ms": 1,
                                                                                     "e2e_mean_ms": 9}})]})],
         r"calibrate: the runs are of 2 GPUs \(h100-sxm, l40s\); a step model is one GPU's"),
        ([("one.yaml", {"experiments": [dict(QWEN, workload=dict(QWEN["workload"], stages=[[6.0, 3]]),
                                             measured={"stage0": {"ttft_mean_ms": 1, "itl_mean_ms": 1,
                                                                  "e2e_mean_ms": 9}})]})],
         r"calibrate: 1 run\(s\) with 1 measured load\(s\) \(3 means\) cannot determine the 5 coefficients"),
        ([("bench.json", {"request_rate": "inf", "max_concurrency": 0, "mean_ttft_ms": 30.0, "completed": 80})],
         r"calibrate: bench\.max_concurrency: expected a whole number >= 1 or null, got 0"),
        ([("notes.txt", "hello")], r"calibrate: '.*notes\.txt' is not a vLLM start-up log"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, files, message):
    paths = []
    for name, doc in files:
        p = tmp_path / name
        paths.append(str(p if isinstance(doc, str) and p.write_text(doc) else _write(tmp_path, name, doc)))
    out_path, plot_path = tmp_path / "out.yaml", tmp_path / "fit.png"
    code = main(["calibrate", *paths, "--out", str(out_path), "--plot", str(plot_path), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not out_path.exists() and not plot_path.exists()


def test_a_bench_result_and_a_startup_log_become_one_measured_run(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO 02-17 15:54:51 [api_server.py:1] vLLM API server version 0.15.1\n"
        "INFO [startup.py:96] non-default args: {'model': 'Qwen/Qwen2.5-7B-Instruct', 'tensor_parallel_size': 1, "
        "'max_num_seqs': 64, 'gpu_memory_utilization': 0.85, 'max_num_batched_tokens': 4096}\n"
        "INFO [kv_cache_utils.py:1149] GPU KV cache size: 1,045,632 tokens, Maximum concurrency for 32,768 tokens "
        "per request: 31.91x\n"
    )
    s = read_startup_log(log)
    assert s == Settings("Qwen/Qwen2.5-7B-Instruct", 1, 4096, 64, 0.85, "vllm-0.15.1", None, 1045632 // 16)
    bench = {
        "model_id": "Qwen/Qwen2.5-7B-Instruct", "num_prompts": 200, "request_rate": 4.0, "burstiness": 1.0,
        "max_concurrency": None, "completed": 200, "total_input_tokens": 204800, "total_output_tokens": 25600,
        "mean_ttft_ms": 35.0, "mean_tpot_ms": 7.5, "mean_itl_ms": 7.4,
    }  # fmt: skip
    f = _write(tmp_path, "bench.json", bench)
    runs, engine = read_measurements([f, log], Settings(hw="h100-sxm"))
    assert engine == "vllm-0.15.1"
    (run,) = runs
    raw = run.raw
    assert raw["sim_workload"] == {
        "num_requests": 200,
        "arrival": {"process": "poisson", "rate": 4.0},
        "prompt_len": {"dist": "fixed", "value": 1024},
        "output_len": {"dist": "fixed", "value": 128},
    }
    assert (raw["max_num_batched_tokens"], raw["max_num_seqs"], raw["gpu_memory_utilization"]) == (4096, 64, 0.85)
    m = raw["measured"]["summary"]
    assert m["ttft_mean_ms"] == 35.0 and m["e2e_mean_ms"] == pytest.approx(35.0 + 7.5 * 127)
    assert m["itl_mean_ms"] == pytest.approx(7.5)
    with pytest.raises(ConfigError, match=r"bench\.burstiness: 0\.5: only Poisson arrivals"):
        bench_run(dict(bench, burstiness=0.5), "bench", Settings())


def test_a_closed_loop_bench_result_is_replayed_with_its_concurrency_cap():
    """vllm bench serve --max-concurrency 8 at --request-rate inf: 8 requests in flight, each timed from its send."""
    bench = {
        "model_id": "Qwen/Qwen2.5-7B-Instruct", "num_prompts": 40, "request_rate": "inf", "burstiness": 1.0,
        "max_concurrency": 8, "completed": 40, "total_input_tokens": 40 * 512, "total_output_tokens": 40 * 32,
        "mean_ttft_ms": 40.0, "mean_tpot_ms": 7.0, "mean_e2el_ms": 257.0,
    }  # fmt: skip
    raw = bench_run(bench, "closed", Settings(hw="h100-sxm"))
    assert raw["sim_workload"]["concurrency"] == 8
    assert raw["sim_workload"]["arrival"] == {"process": "fixed", "rate": float("inf")}
    (run,) = parse_run_set({"experiments": [raw]}, "t").runs
    predicted, sim = simulate_run(run, "vllm-0.15.1")
    recs = sorted(sim.records.values(), key=lambda r: r.arrival)
    assert [r.arrival for r in recs[:8]] == [recs[0].arrival] * 8  # the first eight sent at once
    assert recs[8].arrival == min(r.finish for r in recs[:8])  # the ninth when the first of them finished
    assert predicted["summary"]["ttft_mean_ms"] < 200  # from its send, not from 0


def test_an_inference_perf_directory_becomes_a_measured_run(tmp_path):
    d = tmp_path / "run1" / "results"
    d.mkdir(parents=True)
    (tmp_path / "run1" / "profile.yaml").write_text(yaml.safe_dump({
        "data": {"type": "shared_prefix", "shared_prefix": {"num_unique_system_prompts": 9,
                 "num_users_per_system_prompt": 5, "system_prompt_len": 100, "question_len": 447, "output_len": 248}},
        "load": {"type": "constant", "stages": [{"rate": 2.5, "duration": 600}, {"rate": 6, "duration": 600}]},
        "server": {"model_name": "mistralai/Mistral-Nemo-Instruct-2407"},
    }))  # fmt: skip
    for i, (ttft, e2e) in enumerate([(0.022, 1.497), (0.0216, 1.549)]):
        (d / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps({"successes": {
            "latency": {"time_to_first_token": {"mean": ttft}, "request_latency": {"mean": e2e}},
            "output_len": {"mean": 247.0}}}))  # fmt: skip
    runs, _ = read_measurements([d], Settings(hw="h100-sxm", tp=2))
    (run,) = runs
    assert run.raw["workload"]["n_sys"] == 9 and run.raw["workload"]["stages"] == [[2.5, 600], [6, 600]]
    assert run.raw["tp"] == 2 and run.raw["model"] == "mistralai/Mistral-Nemo-Instruct-2407"
    assert run.raw["measured"]["stage1"]["e2e_mean_ms"] == pytest.approx(1549.0)
    assert run.raw["measured"]["stage0"]["itl_mean_ms"] == pytest.approx((1497.0 - 22.0) / 246.0)


def test_calibrate_writes_a_profile_that_loads_and_prints_every_residual(tmp_path, capsys):
    runs_raw = [_measured_by_the_simulator(r, TRUTH) for r in (QWEN, LLAMA)]
    f = _write(tmp_path, "mine.yaml", {"experiments": runs_raw})
    out = tmp_path / "my-h100.yaml"
    assert main(["calibrate", str(f), "--out", str(out), "--stage-scale", "1", "--iters", "4", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "H100 SXM, vllm-0.15.1 (vllm-v1): 2 runs, 12 measured means" in text
    assert text.count("stage0  ttft_mean_ms") == 2 and "median abs error" in text
    hw = load_hardware(str(out))
    step = hw.step_for("vllm-v1")
    assert step is not None and step.frontend_s == pytest.approx(0.006, rel=0.15)
    assert hw.memory_gib == load_hardware("h100-sxm").memory_gib  # the datasheet numbers are kept
    assert hw.step_for("vllm-v0") == load_hardware("h100-sxm").step_for("vllm-v0")


@pytest.mark.slow
def test_calibrated_on_half_the_shared_runs_it_predicts_the_other_half():
    """The issue's bounds on the runs never fitted: median abs error <= 10%, >= 80% within +-15%.

    Fitted with shortened stages (a tenth during the iterations, a quarter for the last one) and
    checked at a quarter of each stage's length, to keep the test to minutes.
    """
    (rs,) = run_sets(["vllm-0.15.1-h100-runs"])
    start = load_hardware("h100-sxm").step_for("vllm-v0")  # vLLM 0.6's, far from today's
    assert start is not None
    fit = fit_runs(rs.select("fit"), rs.engine, start, iters=4, stage_scale=0.1, final_scale=0.25)
    raw = yaml.safe_load(shipped("hardware", "h100-sxm").read_text())
    raw["step_model"] = {"vllm-v1": {**fit.fixed, **fit.coef}}
    check = copy.copy(rs)
    check.runs = rs.select("check")
    rows = validate_set(check, hardware=raw, stage_scale=0.25)
    stages = next(s for s in summaries(rows) if s.label == "stages, check runs")
    assert stages.median_abs_error <= 0.10, stages
    assert stages.within >= 0.8 * stages.n, stages
