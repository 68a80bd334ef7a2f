"""The vLLM environment is complete from its own files: no cache of an earlier run may stand in.

vLLM's config inspects a model's class in a subprocess that imports the model's module
(``vllm.model_executor.models.llama`` and what it imports), and caches what it learned
under ``$XDG_CACHE_HOME/vllm`` (``VLLM_CACHE_ROOT``).  On a machine that ran vLLM before,
that cache answers without importing anything, so a module missing from
``scripts/vllm-requirements.txt`` (``einops`` was) shows only on a new machine.  These
tests import and inspect in a fresh process whose caches are an empty directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_env import vllm_mark

pytestmark = vllm_mark()

MODEL = Path(__file__).parent / "data" / "tiny-llama"
# vLLM's own path: a ModelConfig of a local Llama config.json inspects LlamaForCausalLM.
INSPECT = f"""
import os
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.config import ModelConfig
m = ModelConfig(model={str(MODEL)!r}, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=1024)
print("inspected", m.architectures[0], m.is_multimodal_model)
"""


def _fresh_env(tmp: Path) -> dict[str, str]:
    cache = tmp / "xdg-cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(XDG_CACHE_HOME=str(cache), VLLM_CACHE_ROOT=str(cache / "vllm"), HF_HUB_OFFLINE="1")
    return env


def test_a_llama_model_is_inspected_with_empty_caches(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", INSPECT], env=_fresh_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, f"inspecting LlamaForCausalLM failed with empty caches:\n{r.stderr[-3000:]}"
    assert "inspected LlamaForCausalLM" in r.stdout


def test_every_pinned_requirement_is_installed() -> None:
    from importlib.metadata import PackageNotFoundError, version

    pins = {}
    req = Path(__file__).resolve().parent.parent / "scripts" / "vllm-requirements.txt"
    for line in req.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, want = line.partition("==")
            pins[name] = want
    assert "einops" in pins, "vLLM's model modules import einops"
    missing = {}
    for name, want in pins.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            missing[name] = (want, have)
    assert not missing, f"pinned (want, installed): {missing}"
