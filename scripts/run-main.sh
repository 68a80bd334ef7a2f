#!/usr/bin/env bash
# The main job on its embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
exec .venv/bin/tiered-kv demo "$@"
