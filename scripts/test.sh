#!/usr/bin/env bash
# The whole test suite: lint, then every test (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check . || { echo "run: .venv/bin/ruff format ."; exit 1; }
exec .venv/bin/python -m pytest -q "$@"
