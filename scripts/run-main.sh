#!/usr/bin/env bash
# The main job: the default experiment (configs/oversubscribed-llama3-8b-h200.yaml): five runs
# that separate recompute, a CPU prefix tier, vLLM v0's swapping and cost-aware swap-or-recompute,
# below capacity and overloaded; the runs are simulated in two processes.
# Writes out/results.json and plots in out/plots/.  Installs only the [sim] extra (no torch, no ray:
# the simulation needs neither); scripts/test.sh installs the rest into the same environment.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh sim
VENV=${TIERED_KV_VENV:-.venv}
exec "$VENV/bin/tiered-kv" simulate --workers 2 --json out/results.json --plots out/plots "$@"
