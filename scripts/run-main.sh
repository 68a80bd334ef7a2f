#!/usr/bin/env bash
# The main job: the default experiment (configs/oversubscribed-llama3-8b-h200.yaml),
# comparing recompute-only, always-swap and cost-aware + CPU prefix tier.
# Writes out/results.json and plots in out/plots/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/tiered-kv simulate --json out/results.json --plots out/plots "$@"
