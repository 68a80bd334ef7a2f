"""Installed like a real tool: build the wheel, install it in a fresh venv outside the checkout, run it.

A base install (no extras) must answer --version and --help and name the extra
a command needs; with the sim extra, ``simulate`` runs a shipped example config,
whose hardware and model profiles come from inside the wheel.  torch is never
installed: the simulator does not need it.
"""

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import tiered_kv

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(cmd, cwd, check=True):
    unset = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TIERED_KV_MYPYC")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build from a copy of what the build reads, so the checkout gets no build/ or egg-info."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "tiered_kv", src / "tiered_kv", symlinks=True, ignore=ignore)
    shutil.copytree(ROOT / "configs", src / "configs", ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], cwd=src)
    (whl,) = dist.glob("tiered_kv-*.whl")
    return whl


def test_the_wheel_carries_the_configs_the_code_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"tiered_kv/configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*.yaml")}
    assert configs and configs <= names
    assert "tiered_kv/configs/hardware/l40s.yaml" in names
    # The Mooncake trace of the main experiment, with its attribution and license beside it.
    trace = "tiered_kv/configs/traces/mooncake/"
    assert {f"{trace}conversation_trace.jsonl", f"{trace}LICENSE-APACHE", f"{trace}README.md"} <= names
    shipped = zipfile.ZipFile(wheel).read(f"{trace}conversation_trace.jsonl")
    assert shipped == (ROOT / "configs" / "traces" / "mooncake" / "conversation_trace.jsonl").read_bytes()
    code = {str(p.relative_to(ROOT)) for p in (ROOT / "tiered_kv").rglob("*.py") if "configs" not in p.parts}
    assert code <= names
    assert "tiered_kv/py.typed" in names
    assert not [n for n in names if n.endswith(".so")]  # compiling the core is opt-in (TIERED_KV_MYPYC=1)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert f"Version: {tiered_kv.__version__}" in text
    for extra in ("sim", "ray", "torch"):
        assert f"Provides-Extra: {extra}" in text


def test_a_fresh_venv_runs_the_installed_tool(wheel, tmp_path_factory):
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    work = tmp_path_factory.mktemp("work")  # outside the checkout: nothing can come from the source tree
    pip = [bin_dir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, wheel], cwd=work)
    tool = bin_dir / "tiered-kv"

    # A base install: no third-party package at all.
    where = run([bin_dir / "python", "-c", "import tiered_kv; print(tiered_kv.__file__)"], cwd=work).stdout
    assert str(env_dir) in where and str(ROOT) not in where
    assert run([tool, "--version"], cwd=work).stdout.strip() == f"tiered-kv {tiered_kv.__version__}"
    assert "simulate" in run([tool, "--help"], cwd=work).stdout
    base = run([tool, "simulate"], cwd=work, check=False)
    assert base.returncode == 2
    assert base.stderr == (
        "tiered-kv simulate: this command needs PyYAML, which is not installed: pip install 'tiered-kv[sim]'\n"
    )
    no_torch = run([tool, "crossover"], cwd=work, check=False)
    assert no_torch.returncode == 2 and "pip install 'tiered-kv[torch]'" in no_torch.stderr
    assert no_torch.stderr.count("\n") == 1

    # With the sim extra: a shipped example config, its profiles read from inside the wheel.
    run([*pip, f"{wheel}[sim]"], cwd=work)
    r = run([tool, "simulate", "quickstart-l40s", "--json", "out/results.json"], cwd=work)
    assert "L40S" in r.stdout
    doc = json.loads((work / "out" / "results.json").read_text())
    assert doc["hardware"] == "L40S" and [x["run"] for x in doc["runs"]] == [
        "recompute-only",
        "always-swap",
        "cost-aware+cpu-tier",
    ]
    assert all(x["requests_finished"] == x["requests"] for x in doc["runs"])
    default = run(
        [bin_dir / "python", "-c", "from tiered_kv.sim.config import load_config; print(load_config(None)['name'])"],
        cwd=work,
    )
    assert default.stdout.strip() == "oversubscribed-llama3-8b-h200"
    # The main experiment's config resolves its trace inside the installed package, and the trace replays.
    code = (
        "from tiered_kv.sim.config import load_config; from tiered_kv.sim.workload import generate; "
        "w = load_config('mooncake-llama3-8b-h200')['workload']; print(w['trace']); print(len(generate(w, 0)))"
    )
    trace_path, n = run([bin_dir / "python", "-c", code], cwd=work).stdout.split()
    assert trace_path.startswith(str(env_dir)) and trace_path.endswith("traces/mooncake/conversation_trace.jsonl")
    assert int(n) > 0
    inspect = run([tool, "trace", "inspect", trace_path, "--format", "mooncake"], cwd=work).stdout
    assert "12031 requests" in inspect
    assert run([bin_dir / "python", "-c", "import torch"], cwd=work, check=False).returncode != 0  # never needed
