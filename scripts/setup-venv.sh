#!/usr/bin/env bash
# Create the virtual environment (if missing) and install tiered_kv with what one job needs.
#
#   bash scripts/setup-venv.sh sim    # the main job (run-main.sh): the [sim] extra only, no torch, no ray
#   bash scripts/setup-venv.sh        # the test suite (test.sh): torch, and the [test,sim,ray] extras
#   bash scripts/setup-venv.sh vllm   # the vLLM integration (.venv-vllm): torch, vllm==0.33.0 --no-deps,
#                                     # the [vllm] extra and the non-GPU modules vLLM's imports need
#   bash scripts/setup-venv.sh sglang # the SGLang integration (.venv-sglang): torch, sglang==0.5.23 --no-deps,
#                                     # the [redis] extra and the modules SGLang's storage interface imports
#   bash scripts/setup-venv.sh lmcache # the LMCache integration (.venv-lmcache): torch, lmcache==0.5.6
#                                     # --no-deps and the non-GPU modules its storage code imports
#
# The simulation imports neither torch nor ray (tests/test_setup_scripts.py runs it without them), so
# the main job does not pay for them.  torch: a CPU machine gets the pinned CPU wheel (torch==2.13.0);
# a GPU user who installed a CUDA torch into the environment first keeps it, since torch is installed
# only when none is importable there.  TIERED_KV_VENV names the environment (default: .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-test}
case "$what" in
    sim) extras="sim"; VENV=${TIERED_KV_VENV:-.venv} ;;
    test) extras="test,sim,ray"; VENV=${TIERED_KV_VENV:-.venv} ;;
    # Its own environment: vLLM's requirements would replace the pinned torch and pull CUDA.
    # Not the [vllm] extra: pip would resolve vLLM's full requirements (torch 2.14 with CUDA) for it.
    vllm) extras="redis"; VENV=${TIERED_KV_VENV:-.venv-vllm} ;;
    # Its own environment, like vllm: SGLang's requirements pull torch 2.14 with CUDA.
    sglang) extras="redis"; VENV=${TIERED_KV_VENV:-.venv-sglang} ;;
    # Its own environment too: LMCache's requirements pull cupy, cuda-python and a CUDA torch.
    lmcache) extras="redis"; VENV=${TIERED_KV_VENV:-.venv-lmcache} ;;
    *) echo "setup-venv.sh: unknown set '$what' (give sim, vllm, sglang, lmcache, or nothing for the test set)" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ "$what" != sim ] && ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
fi
if [ "$what" = vllm ]; then
    # --no-deps: vLLM 0.33.0 asks for torch 2.14 (a CUDA build) and GPU kernels; its offloading and
    # scheduler code runs on the CPU torch above with the modules listed in vllm-requirements.txt.
    # The wheel tests/vllm_source.py fetched and checked, if it is there; else the registry's.
    wheel="${TIERED_KV_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tiered_kv/vllm-0.33.0}/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    [ -f "$wheel" ] || wheel="vllm==0.33.0"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r scripts/vllm-requirements.txt pytest pytest-benchmark
fi
if [ "$what" = sglang ]; then
    # --no-deps: SGLang 0.5.23 asks for torch 2.14.1 (a CUDA build) and its GPU kernels; its HiCache
    # storage interface and backend loader run on the CPU torch above with sglang-requirements.txt.
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "sglang==0.5.23"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r scripts/sglang-requirements.txt pytest pytest-benchmark
fi
if [ "$what" = lmcache ]; then
    # --no-deps: LMCache 0.5.6 asks for CUDA packages (cupy-cuda13x, cuda-python, nvtx) and any
    # torch; its storage backends and plug-in loader run on the CPU torch above with the modules
    # listed in lmcache-requirements.txt.
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "lmcache==0.5.6"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r scripts/lmcache-requirements.txt pytest pytest-benchmark
fi
# sim: YAML configs, plots, progress bars; test: the suite's tools; ray: `sweep --ray` and its test.
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[$extras]"
