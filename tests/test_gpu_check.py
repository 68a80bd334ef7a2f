"""``tiered-kv gpu-check``: the CPU form runs every part for real; partial runs leave valid JSON.

The whole command runs in a child process (as CI and a GPU machine run it),
because its hard time limit ends the process it runs in.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from simutil import TINY

from tiered_kv.bench.gpu_check import CPU_FORM, PARTS, parse
from tiered_kv.bench.overlap import SyncCounter, trace_syncs
from tiered_kv.bench.report import Deadline, Report
from tiered_kv.sim.calibration import load_calibration
from tiered_kv.sim.config import setup, validate_config
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


# CI machines are shared and slow: a budget large enough that no part stops early here.  Stopping
# at a budget is tested on its own, with a clock that the test drives.
BUDGET_S = 300.0
SCALE = BUDGET_S / CPU_FORM.total_s


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = run_cli("gpu-check", "--cpu", "--out", str(out), "--budget-s", str(BUDGET_S), timeout=BUDGET_S + 60)
    return proc, out, json.loads((out / "gpu-check.json").read_text())


@pytest.mark.slow
def test_cpu_form_runs_every_part_to_the_end(cpu_run):
    proc, out, doc = cpu_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert doc["schema"] == "tiered-kv gpu-check 1" and doc["form"] == "cpu" and doc["complete"] is True
    assert list(doc["parts"]) == list(PARTS)
    for name, part in doc["parts"].items():
        assert part["status"] == "done", (name, part)
        assert part["elapsed_s"] > 0 and part["budget_s"] == pytest.approx(CPU_FORM.budgets[name] * SCALE), name
    assert doc["hardware"].startswith("no GPU") and doc["torch_threads"] == 1
    assert set(doc["files"]) == {"log", "pytest_log", "trace", "crossover_rows", "calibration"}
    for name in doc["files"].values():
        assert (out / name).stat().st_size > 0
    assert "gpu-check (cpu form)" in proc.stdout


@pytest.mark.slow
def test_cpu_form_device_and_tests_parts(cpu_run):
    _, _, doc = cpu_run
    dev = doc["parts"]["device"]["result"]
    assert dev["gpu"] is None and dev["torch"]["cuda_available"] is False and dev["host"]["cores"] >= 1
    t = doc["parts"]["tests"]["result"]
    assert t["ran"] and t["passed"] and t["stopped"] is None and t["summary"]
    # No CUDA here: every gpu-marked test was selected, and each one skipped, saying why.
    assert t["counts"].get("skipped", 0) >= 20 and set(t["counts"]) == {"skipped"}
    assert sum(t["skip_reasons"].values()) == t["counts"]["skipped"]


@pytest.mark.slow
def test_cpu_form_bandwidth_rows_are_real_and_complete(cpu_run):
    _, _, doc = cpu_run
    b = doc["parts"]["bandwidth"]["result"]
    rows = b["rows"]
    f = CPU_FORM
    # Per layout and block size: the CPU engine's 2 patterns x 3 directions, and the loop's 2 x 2.
    assert len(rows) == len(f.layouts) * len(f.block_tokens) * (6 + 4)
    keys = {(r["engine"], r["layout"], r["block_tokens"], r["pattern"], r["direction"]) for r in rows}
    assert len(keys) == len(rows)
    for r in rows:
        s = r["seconds"]
        assert s["n"] == f.repeats and 0 < s["min"] <= s["median"] <= s["max"]
        assert r["gbps"] > 0 and r["peak_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["peak_seconds"]["median"] / s["median"])
        assert r["bytes"] == (2 if r["direction"] == "duplex" else 1) * (f.mib_per_case << 20)
    assert {g["applies"] for g in b["goals"]} == {False}


@pytest.mark.slow
def test_cpu_form_overlap_counts_no_syncs_and_writes_a_trace(cpu_run):
    _, out, doc = cpu_run
    o = doc["parts"]["overlap"]["result"]
    (d,) = o["duplex"]
    assert d["engine"] == "cpu" and d["slowdown"] > 0 and 0 <= d["hidden"] <= 1
    assert d["syncs_python"] == 0 and d["syncs_debug_mode"] == 0
    lw = o["layerwise"]
    assert lw["serial_s"] > 0 and lw["pipelined_reference_s"] > 0
    assert lw["engine_layerwise_s"] > 0 and 0 <= lw["hidden_engine_layerwise"] <= 1 and lw["layerwise_gain"] > 0
    assert lw["variants"]["engine_layerwise"]["syncs_python"] == 0
    assert o["trace"]["file"] == doc["files"]["trace"] == "gpu-check-trace.json"  # small here: not gzipped
    events = json.loads((out / "gpu-check-trace.json").read_text())["traceEvents"]
    for name, counted in o["trace"]["regions"].items():
        again = trace_syncs(events, f"gpu_check/{name}")
        assert again == counted and counted["regions"] >= 1 and counted["total"] == 0
    assert o["trace"]["control"]["can_see"] is None  # nothing on a CPU can synchronise with a device


@pytest.mark.slow
def test_cpu_form_crossover_rows_and_calibration_drive_the_simulator(cpu_run):
    _, out, doc = cpu_run
    c = doc["parts"]["crossover"]["result"]
    lines = [json.loads(x) for x in (out / "crossover.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in lines] == list(CPU_FORM.lengths) == [r["tokens"] for r in c["rows"]]
    for r in lines:
        assert r["recompute"]["n"] == CPU_FORM.repeats and r["recompute_s"] == r["recompute"]["median"]
        assert r["winner"] == ("swap" if r["swap_out_s"] + r["swap_in_s"] < r["recompute_s"] else "recompute")
    assert len(c["decode"]) == len(CPU_FORM.decode_points)
    cal = load_calibration(out / "calibration.json")
    assert cal.block_size == CPU_FORM.block_size and cal.model["num_layers"] == CPU_FORM.model.num_layers
    raw = dict(TINY, memory={"block_size": 16, "gpu_blocks": 12, "cpu_blocks": 64, "activation_reserve_gib": 0})
    raw["runs"] = [{"name": "swap", "mode": "swap"}]
    cfg = validate_config(raw)
    res = Simulator(setup(cfg, 0, cal), generate(cfg["workload"], 0)).run()
    assert res["requests_finished"] == 2


def test_refuses_the_gpu_form_without_cuda(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from tiered_kv.cli import main

    assert main(["gpu-check", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device" in err and "--cpu" in err
    assert not (tmp_path / "o").exists()


def test_a_part_out_of_time_stops_cleanly_and_the_file_stays_valid(tmp_path):
    """The bandwidth part with a budget that runs out after a few checks: partial rows, valid JSON."""
    from tiered_kv.bench.bandwidth import run_bandwidth

    ticks = itertools.count()
    deadline = Deadline(6, clock=lambda: float(next(ticks)))  # one second per look at the clock
    report = Report(tmp_path / "r.json", {"form": "test"}, ["bandwidth"])
    snapshots = []

    def save(result):
        report.update("bandwidth", status="running", result=result)
        snapshots.append(json.loads((tmp_path / "r.json").read_text()))

    res = run_bandwidth(CPU_FORM.kv, (16, 32), ("block_contiguous",), 1, 1, "cpu", deadline, lambda s: None, save)
    assert res["stopped"] and "time budget of 6 s" in res["stopped"]
    full = 2 * (6 + 4)
    assert 0 < len(res["rows"]) < full
    assert snapshots and len(snapshots[-1]["parts"]["bandwidth"]["result"]["rows"]) == len(res["rows"])


def test_the_hard_limit_ends_a_hung_run_and_records_why(tmp_path):
    code = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from tiered_kv.bench.report import Report
        r = Report(Path({str(tmp_path / "r.json")!r}), {{"form": "test"}}, ["tests", "crossover"])
        r.update("tests", status="done", result={{"n": 1}})
        r.update("crossover", status="running", result={{"rows": [1, 2]}})
        r.arm(0.5)
        time.sleep(30)  # a measurement that never ends
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 124
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["parts"]["tests"]["status"] == "done"
    assert doc["parts"]["crossover"]["status"] == "partial" and doc["parts"]["crossover"]["result"]["rows"] == [1, 2]
    assert "hard limit" in doc["hard_stop"] and doc["finished"]


def test_results_file_is_strict_json(tmp_path):
    r = Report(tmp_path / "r.json", {"form": "test"}, ["bandwidth"])
    r.update("bandwidth", result={"ratio": float("nan"), "gbps": float("inf"), "rows": [1.5]})
    doc = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert doc["parts"]["bandwidth"]["result"] == {"ratio": None, "gbps": None, "rows": [1.5]}
    with pytest.raises(ValueError, match="unknown status"):
        r.update("bandwidth", status="fine")


def test_sync_counter_counts_only_inside_an_open_region():
    torch = pytest.importorskip("torch")
    calls = []
    original = torch.cuda.synchronize
    counter = SyncCounter()
    try:
        torch.cuda.synchronize = lambda *a, **k: calls.append(1)  # a stand-in that records the real call
        counter.install()
        torch.cuda.synchronize()
        with counter:
            torch.cuda.synchronize()
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        assert counter.counts == {"torch.cuda.synchronize": 2} and len(calls) == 4
    finally:
        counter.uninstall()
        torch.cuda.synchronize = original
    assert torch.cuda.synchronize is original


def test_trace_syncs_counts_blocking_calls_inside_the_region_on_its_thread():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "gpu_check/r", "pid": 1, "tid": 7, "ts": 100, "dur": 50},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "gpu_check/r", "pid": 0, "tid": 3, "ts": 100, "dur": 90},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 7, "ts": 110, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "pid": 1, "tid": 7, "ts": 120, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpy", "pid": 1, "tid": 7, "ts": 130, "dur": 1},
        {"ph": "X", "cat": "cuda_driver", "name": "cuEventSynchronize", "pid": 1, "tid": 7, "ts": 140, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 8, "ts": 120, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": 7, "ts": 200, "dur": 1},
    ]
    got = trace_syncs(ev, "gpu_check/r")
    assert got == {
        "regions": 1,
        "calls": {"cudaStreamSynchronize": 1, "cudaMemcpy": 1, "cuEventSynchronize": 1},
        "total": 3,
        "cuda_api_events": 4,
    }


def test_pytest_log_parsing_keeps_ids_with_spaces_and_skip_reasons():
    log = textwrap.dedent(
        """
        tests/a.py::test_x[src0-2 source ids but 1-cuda] PASSED [ 25%]
        tests/a.py::test_y[cupy] FAILED [ 50%]
        tests/b.py::test_z SKIPPED [ 75%]
        tests/b.py::test_w ERROR [100%]
        ____________ ERROR collecting tests/c.py ____________
        SKIPPED [1] tests/b.py:3: needs CUDA
        ======= 1 failed, 1 passed, 1 skipped, 1 error in 2.50s =======
        """
    )
    got = parse(log)
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert got["problems"] == [
        {"test": "tests/a.py::test_y[cupy]", "outcome": "failed"},
        {"test": "tests/b.py::test_w", "outcome": "error"},
    ]
    assert got["skip_reasons"] == {"needs CUDA": 1} and got["collection_errors"] == ["tests/c.py"]
    assert got["summary"] == "1 failed, 1 passed, 1 skipped, 1 error in 2.50s"
