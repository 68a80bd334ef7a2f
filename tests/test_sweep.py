"""Sweeps: cells run serially, in worker processes and as Ray tasks give the same bytes."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from simutil import KIB_IN_GIB, TINY

from tiered_kv.cli import main
from tiered_kv.cli.sweep import plan_cells, run_cell


def busy_raw():
    """40 requests on a few KiB of KV: every run preempts, and the cells differ."""
    raw = copy.deepcopy(TINY)
    raw["workload"] = {
        "num_requests": 40,
        "arrival": {"process": "poisson", "rate": 4.0},
        "prompt_len": {"dist": "uniform", "low": 4, "high": 24},
        "output_len": {"dist": "lognormal", "mean": 6, "sigma": 0.5, "min": 1, "max": 16},
        "system_prompts": {"count": 2, "length": 8, "zipf": 1.0, "share": 0.6},
        "multi_turn": {"prob": 0.4, "max_turns": 2},
    }
    raw["memory"] = {"block_size": 4, "gpu_kv_gib": 24 * KIB_IN_GIB, "cpu_kv_gib": 64 * KIB_IN_GIB}
    raw["memory"]["activation_reserve_gib"] = 0
    raw["compute"] = {"step_overhead_s": 0.01}
    raw["hardware"] = dict(
        TINY["hardware"],
        link={"h2d_gbps": 1.0e-4, "per_copy_overhead_s": 0.0},
        peak_bf16_flops=1.0e9,
        hbm_bytes_per_s=1.0e8,
    )
    raw["runs"] = [
        {"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "swap", "victim_policy": "largest", "mode": "swap"},
        {"name": "smart", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
    ]
    raw["sweep"] = {"gpu_kv_gib": [24 * KIB_IN_GIB, 32 * KIB_IN_GIB], "rate": [2.0, 4.0]}
    return raw


@pytest.fixture(scope="module")
def sweep_config(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    p = d / "busy.yaml"
    p.write_text(yaml.safe_dump(busy_raw()))
    return p


@pytest.fixture(scope="module")
def serial_bytes(sweep_config):
    out = sweep_config.parent / "serial.json"
    assert main(["sweep", str(sweep_config), "--json", str(out), "--no-progress"]) == 0
    return out.read_bytes()


def test_cells_are_nontrivial_and_independent(sweep_config, serial_bytes):
    import json

    rows = json.loads(serial_bytes)["rows"]
    assert len(rows) == 2 * 2 * 3
    assert sum(r["preemptions"] for r in rows) > 0
    assert len({r["throughput_rps"] for r in rows}) > 3  # the points differ
    _, cells, _, _ = plan_cells(sweep_config)
    assert run_cell(cells[7]) == rows[7]  # one cell alone gives its row


def test_worker_processes_give_the_serial_bytes(sweep_config, serial_bytes, tmp_path):
    out = tmp_path / "workers.json"
    assert main(["sweep", str(sweep_config), "--json", str(out), "--workers", "2", "--no-progress"]) == 0
    assert out.read_bytes() == serial_bytes


def test_ray_tasks_on_a_local_instance_give_the_serial_bytes(sweep_config, serial_bytes, tmp_path, monkeypatch):
    # Keep the instance on the loopback address (by default Ray binds the machine's network address).
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:")
        out = tmp_path / "ray.json"
        r = subprocess.run(
            [sys.executable, "-m", "tiered_kv.cli", "sweep", str(sweep_config), "--json", str(out), "--ray", address],
            capture_output=True,
            text=True,
            env=os.environ,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == serial_bytes
        assert "sweep: 480/480 requests (100%), done in" in r.stderr  # progress off a terminal, per cell
    finally:
        ray.shutdown()
