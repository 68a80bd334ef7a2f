#!/usr/bin/env bash
# Create .venv (if missing) and install tiered_kv with what the commands need.
# torch: a CPU machine gets the pinned CPU wheel (torch==2.13.0).  A GPU user
# who installed a CUDA torch into .venv first keeps it: we only install torch
# when none is importable there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
# sim: YAML configs, plots, progress bars; ray: `sweep --ray` and its test.
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,sim,ray]"
