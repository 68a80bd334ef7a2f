"""vLLM 0.33.0's own source, fetched once, for the differential tests.

The reference for the GPU pool's and the CPU tier's behaviour is vLLM's code, not a reading of
it. This helper brings vLLM 0.33.0's wheel (``pip download --no-deps``) and its source
distribution (which holds vLLM's unit tests) into a cache directory, checks both against
pinned SHA-256 digests, and unpacks the parts the tests read. Nothing is installed: the
loaders beside this file (``vllm_ref_*.py``) import single modules from the unpacked tree with
stubs for what those modules import.

Cache: ``$TIERED_KV_VLLM_CACHE``, else ``$XDG_CACHE_HOME/tiered_kv/vllm-0.33.0`` (``XDG_CACHE_HOME``
defaulting to ``~/.cache``, as pip's and vLLM's own caches do, so one variable moves them all). Where vLLM cannot be
fetched (no network) the tests that need it skip with the reason, except under CI (``CI`` set
to a true value), where they fail: CI must run them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

import pytest

VLLM_VERSION = "0.33.0"
WHEEL_NAME = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
SDIST_NAME = "vllm-0.33.0.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
SIMPLE_INDEX = "https://pypi.org/simple/vllm/"

# What the tests read: the pure-Python modules under test and the unit tests for them.
WHEEL_PARTS = ("vllm/",)
SDIST_PARTS = ("tests/v1/core/", "tests/v1/kv_offload/", "tests/utils.py", "tests/conftest.py")


def cache_dir() -> Path:
    root = os.environ.get("TIERED_KV_VLLM_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tiered_kv" / f"vllm-{VLLM_VERSION}"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _unavailable(reason: str) -> None:
    msg = f"vLLM {VLLM_VERSION}'s source is not available: {reason}"
    if _in_ci():
        pytest.fail(msg + " (CI must run the differential tests against vLLM's own code)", pytrace=False)
    pytest.skip(msg)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sdist_url() -> str:
    html = urllib.request.urlopen(SIMPLE_INDEX, timeout=60).read().decode()
    m = re.search(r'href="([^"#]*/' + re.escape(SDIST_NAME) + r')#sha256=([0-9a-f]{64})"', html)
    if m is None:
        raise RuntimeError(f"{SDIST_NAME} is not listed in {SIMPLE_INDEX}")
    if m.group(2) != SDIST_SHA256:
        raise RuntimeError(f"the index lists {SDIST_NAME} with sha256 {m.group(2)}, expected {SDIST_SHA256}")
    return m.group(1)


def _fetch(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / WHEEL_NAME
    if not wheel.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             f"vllm=={VLLM_VERSION}", "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64",
             "--python-version", "3.11", "-d", str(dest)],
            check=True, timeout=900,
        )  # fmt: skip
        if _sha256(wheel) != WHEEL_SHA256:
            wheel.unlink()
            raise RuntimeError(f"{WHEEL_NAME}: checksum mismatch")
    sdist = dest / SDIST_NAME
    if not sdist.exists():
        tmp = dest / (SDIST_NAME + ".part")
        with urllib.request.urlopen(_sdist_url(), timeout=300) as r, tmp.open("wb") as f:
            shutil.copyfileobj(r, f)
        if _sha256(tmp) != SDIST_SHA256:
            tmp.unlink()
            raise RuntimeError(f"{SDIST_NAME}: checksum mismatch")
        tmp.rename(sdist)


def _unpack(dest: Path) -> Path:
    src = dest / "src"
    done = src / ".complete"
    if done.exists():
        return src
    tmp = dest / "src.part"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with zipfile.ZipFile(dest / WHEEL_NAME) as z:
        for name in z.namelist():
            if name.startswith(WHEEL_PARTS) and name.endswith((".py", ".json", ".typed")):
                z.extract(name, tmp)
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(dest / SDIST_NAME) as t:
        for m in t.getmembers():
            rel = m.name[len(prefix) :] if m.name.startswith(prefix) else None
            if rel and rel.startswith(SDIST_PARTS) and m.isfile():
                m.name = rel
                t.extract(m, tmp, filter="data")
    (tmp / ".complete").write_text(VLLM_VERSION)
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return src


def vllm_source() -> Path:
    """The unpacked tree: ``vllm/`` from the wheel and ``tests/`` from the source distribution.

    Fetches and unpacks on first use; skips (or fails under CI) where that cannot be done.
    """
    dest = cache_dir()
    try:
        if not (dest / "src" / ".complete").exists():
            _fetch(dest)
        return _unpack(dest)
    except Exception as e:  # no network, no pip, a bad digest: all mean "not available"
        _unavailable(f"{type(e).__name__}: {e}")
        raise AssertionError("unreachable") from e


if __name__ == "__main__":  # .ci/run warms the cache: python tests/vllm_source.py
    print(vllm_source())
