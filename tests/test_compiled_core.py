"""The core is either wholly compiled by mypyc (the modules ``setup.py`` lists) or wholly pure Python.

``scripts/test.sh`` runs the core tests twice: on the editable checkout, which
must be pure, and on a build with ``TIERED_KV_MYPYC=1``, which must be compiled.
It says which it expects in ``TIERED_KV_EXPECT_COMPILED`` (``0`` or ``1``), so
that a build that silently fell back to pure Python cannot pass as compiled.
"""

import ast
import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import tiered_kv.core

ROOT = Path(__file__).resolve().parents[1]


def listed_modules() -> list[str]:
    """The module names in ``setup.py``'s ``COMPILED`` list."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILED" for t in node.targets):
            paths = ast.literal_eval(node.value)
            return [p.removesuffix(".py").replace("/", ".") for p in paths]
    raise AssertionError("setup.py has no COMPILED list")


def is_extension(module_name: str) -> bool:
    path = importlib.import_module(module_name).__file__
    return path is not None and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_every_listed_module_is_compiled_or_none_is():
    modules = listed_modules()
    assert "tiered_kv.core.block_pool" in modules and "tiered_kv.core.kv_cache_manager" in modules
    compiled = {m: is_extension(m) for m in modules}
    assert all(compiled.values()) or not any(compiled.values()), f"a partial build: {compiled}"
    assert tiered_kv.core.COMPILED == all(compiled.values())
    assert not is_extension("tiered_kv.core.hashing")  # hashing stays pure: see setup.py


@pytest.mark.skipif("TIERED_KV_EXPECT_COMPILED" not in os.environ, reason="the test script says what it expects")
def test_the_core_is_compiled_exactly_when_the_test_script_expects_it():
    assert tiered_kv.core.COMPILED == (os.environ["TIERED_KV_EXPECT_COMPILED"] == "1")


@pytest.mark.slow
def test_asked_to_compile_without_a_c_compiler_the_build_is_pure_python(tmp_path):
    """``TIERED_KV_MYPYC=1`` where no compiler works: a pure wheel and a warning, not a failed install."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so")
    shutil.copytree(ROOT / "tiered_kv", src / "tiered_kv", symlinks=True, ignore=ignore)
    shutil.copytree(ROOT / "configs", src / "configs", ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TIERED_KV_MYPYC="1", CC=str(tmp_path / "no-such-cc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    proc = subprocess.run([*cmd, str(src)], cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no working C compiler" in proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("tiered_kv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tiered_kv/core/block_pool.py" in names
    assert not [n for n in names if n.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
    assert wheel.name.endswith("-py3-none-any.whl")
