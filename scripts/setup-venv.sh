#!/usr/bin/env bash
# Create the virtual environment (if missing) and install tiered_kv with what one job needs.
#
#   bash scripts/setup-venv.sh sim    # the main job (run-main.sh): the [sim] extra only, no torch, no ray
#   bash scripts/setup-venv.sh        # the test suite (test.sh): torch, and the [test,sim,ray] extras
#
# The simulation imports neither torch nor ray (tests/test_setup_scripts.py runs it without them), so
# the main job does not pay for them.  torch: a CPU machine gets the pinned CPU wheel (torch==2.13.0);
# a GPU user who installed a CUDA torch into the environment first keeps it, since torch is installed
# only when none is importable there.  TIERED_KV_VENV names the environment (default: .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TIERED_KV_VENV:-.venv}
what=${1:-test}
case "$what" in
    sim) extras="sim" ;;
    test) extras="test,sim,ray" ;;
    *) echo "setup-venv.sh: unknown set '$what' (give sim, or nothing for the test set)" >&2; exit 2 ;;
esac
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ "$what" = test ] && ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
fi
# sim: YAML configs, plots, progress bars; test: the suite's tools; ray: `sweep --ray` and its test.
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[$extras]"
