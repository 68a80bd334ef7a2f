"""The main job's set-up installs what the simulation needs and nothing more; the test set-up installs the rest.

``run-main.sh`` used to install torch and ray (about 1.5 GB) for a simulation
that imports neither.  ``setup-venv.sh sim`` builds a fresh environment with
the ``[sim]`` extra alone, and the simulation of the synthetic experiment's runs
(in worker processes, with plots and JSON, as ``run-main.sh`` runs it)
succeeds there, where torch and ray cannot be imported.
"""

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from simutil import TINY

ROOT = Path(__file__).resolve().parent.parent


def sh(*argv, env=None, cwd=ROOT, check=True):
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"{argv}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def test_run_main_sets_up_the_sim_extra_only():
    text = (ROOT / "scripts" / "run-main.sh").read_text()
    assert "bash scripts/setup-venv.sh sim\n" in text
    assert "bash scripts/setup-venv.sh\n" in (ROOT / "scripts" / "test.sh").read_text()


def test_an_unknown_set_is_refused():
    r = sh("bash", "scripts/setup-venv.sh", "everything", check=False)
    want = "setup-venv.sh: unknown set 'everything' (give sim, vllm, sglang, lmcache, or nothing for the test set)\n"
    assert r.returncode == 2 and r.stderr == want


@pytest.mark.slow
def test_the_sim_set_runs_the_main_jobs_simulation_without_torch_or_ray(tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "TIERED_KV_VENV": str(venv)}
    sh("bash", "scripts/setup-venv.sh", "sim", env=env)
    py = venv / "bin" / "python"
    for absent in ("torch", "ray"):
        r = sh(py, "-c", f"import {absent}", check=False)
        assert r.returncode == 1 and f"No module named '{absent}'" in r.stderr
    sh(py, "-c", "import yaml, matplotlib, tqdm")
    raw = {k: v for k, v in copy.deepcopy(TINY).items() if k != "runs"}  # the synthetic experiment's five runs
    work = tmp_path / "work"
    work.mkdir()
    (work / "c.yaml").write_text(yaml.safe_dump(raw))
    argv = [venv / "bin" / "tiered-kv", "simulate", "c.yaml", "--workers", "2", "--no-progress"]
    sh(*argv, "--json", "out/results.json", "--plots", "out/plots", cwd=work)
    doc = json.loads((work / "out" / "results.json").read_text())
    assert [r["run"] for r in doc["runs"]] == [
        "recompute-only",
        "recompute+cpu-tier",
        "always-swap",
        "cost-aware",
        "cost-aware+cpu-tier",
    ]
    assert sorted(p.name for p in (work / "out" / "plots").iterdir()) == [
        "latency_cdf.png",
        "policies.png",
        "usage_over_time.png",
    ]
