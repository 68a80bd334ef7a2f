#!/usr/bin/env bash
# The whole test suite: lint, then every test (GPU tests skip without a GPU).
# With no arguments it then type-checks the compiled modules and runs their tests a second
# time against the build compiled by mypyc (scripts/build-compiled-core.sh); with arguments,
# only pytest's pass over them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check . || { echo "run: .venv/bin/ruff format ."; exit 1; }
TIERED_KV_EXPECT_COMPILED=0 .venv/bin/python -m pytest -q "$@"
[ $# -eq 0 ] || exit 0

# The compiled build (setup.py's COMPILED: the core, the scheduler, the tier manager and the
# simulator's hot path): the tests of the core, of the scheduler and manager, and of the simulator.
.venv/bin/mypy
compiled=$(bash scripts/build-compiled-core.sh)
if [ -z "$compiled" ]; then
    echo "test.sh: no C compiler could build the compiled core; its test pass is skipped" >&2
    exit 0
fi
echo "--- again, on the core compiled by mypyc ($compiled)"
# .venv/bin/pytest, not python -m: the checkout's directory must not come before the build on sys.path.
TIERED_KV_EXPECT_COMPILED=1 PYTHONPATH="$PWD/$compiled" .venv/bin/pytest -q -p no:cacheprovider \
    tests/test_compiled_core.py tests/test_block_pool.py tests/test_free_queue.py tests/test_walkthrough.py \
    tests/test_core_bad_input.py tests/test_core_types.py tests/test_core_stateful.py tests/test_core_import.py \
    tests/test_hashing.py tests/test_prefix_hashes.py tests/test_tier_scenarios.py tests/test_tier_faults.py tests/test_tier_misuse.py \
    tests/test_tier_stateful.py tests/test_scheduler.py tests/test_victim_policy.py tests/test_quiet_allocations.py \
    tests/test_hot_paths_random.py tests/test_cost_aware_exact.py tests/test_vllm_pool_diff.py tests/test_vllm_unit_tests.py \
    tests/test_cost_model.py tests/test_layerwise.py tests/test_manager_contracts.py tests/test_manager_engine.py \
    tests/test_preemption_progress.py tests/test_tier_chain.py tests/test_tier_manager_chain.py tests/test_tier_request_scope.py \
    tests/test_sim.py tests/test_sim_link.py tests/test_sim_modes.py tests/test_sim_resume_stall.py tests/test_sim_tiers.py \
    tests/test_sim_outputs.py tests/test_sim_shared_workload.py
