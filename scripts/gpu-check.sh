#!/usr/bin/env bash
# Run `tiered-kv gpu-check` from a bare checkout: no virtual environment, no network needed.
#
#   bash scripts/gpu-check.sh --out DIR          # on a machine with a GPU (about 8 minutes)
#   bash scripts/gpu-check.sh --cpu --out DIR    # the CPU form, anywhere (under a minute)
#
# It uses the first Python whose torch sees a CUDA device: $PYTHON, then python3, then .venv/bin/python.
# Such a machine keeps its own CUDA build of torch; nothing is installed into it (the CPU pin,
# torch==2.13.0, is for CPU machines only).  With --cpu and no such Python it sets up .venv
# (scripts/setup-venv.sh).  The package runs from this checkout (PYTHONPATH), so no install is needed.
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=0
for a in "$@"; do [ "$a" = "--cpu" ] && cpu=1; done
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=""
for cand in ${PYTHON:-} python3 .venv/bin/python; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    if [ "$cpu" = 0 ]; then
        echo "gpu-check: no Python here has a torch that sees a CUDA device; for the CPU form: $0 --cpu --out DIR" >&2
        exit 2
    fi
    if ! .venv/bin/python -c 'import torch, yaml, pytest' >/dev/null 2>&1; then
        bash scripts/setup-venv.sh || exit 2
    fi
    PY=.venv/bin/python
fi
missing=$("$PY" -c '
import importlib.util as u
print(" ".join(m for m in ("torch", "yaml", "pytest") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "gpu-check: $PY lacks: $missing (pip install them, or set PYTHON to a Python that has them)" >&2
    exit 2
fi
echo "gpu-check: using $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m tiered_kv.cli gpu-check "$@"
