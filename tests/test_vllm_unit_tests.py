"""vLLM 0.33.0's own unit tests of the block pool, the free queue and the manager's events, run against ours.

Each test below is a function of vLLM's ``tests/v1/core/test_kv_cache_utils.py`` or
``test_prefix_caching.py`` (from the source distribution that ``vllm_source`` unpacks),
compiled from vLLM's text unchanged and run with the names it imports bound to our classes
through ``vllm_adapter_core`` (a calling-convention adapter; every answer is ours).

``RUN`` lists the tests that exercise behaviour tiered_kv claims: the free queue's order and
its operations, the pool's allocation, eviction, free order, events and reset, and the
manager's prefill/decode/evict flows.  ``NOT_CLAIMED`` lists the tests of those two files that
touch the pool or queue but cover something tiered_kv does not claim, each with the reason;
the rest of the two files tests other parts of vLLM (scheduler configs, hybrid and sliding-window
managers, HiSparse, multimodal hashing, KV cache planning) and is not listed.
"""

from __future__ import annotations

import ast
import copy
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import vllm_adapter_core
from vllm_source import vllm_source

from tiered_kv.core import KVCacheBlock

UTILS = "tests/v1/core/test_kv_cache_utils.py"
PREFIX = "tests/v1/core/test_prefix_caching.py"

# (file, test function, keyword arguments of the parametrized case)
RUN: list[tuple[str, str, dict[str, Any]]] = [
    (UTILS, "test_kv_cache_block_uses_slots", {}),
    (UTILS, "test_free_kv_cache_block_queue_initialization", {}),
    (UTILS, "test_free_kv_cache_block_queue_operations", {}),
    (UTILS, "test_free_kv_cache_block_queue_prepend_n", {}),
    (UTILS, "test_free_kv_cache_block_queue_popleft_n", {}),
    (UTILS, "test_free_kv_cache_block_queue_popleft_n_drain_and_refill", {"num_blocks": 1}),
    (UTILS, "test_free_kv_cache_block_queue_popleft_n_drain_and_refill", {"num_blocks": 2}),
    (UTILS, "test_free_kv_cache_block_queue_popleft_n_drain_and_refill", {"num_blocks": 16}),
    (UTILS, "test_free_kv_cache_block_queue_get_all_free_blocks", {}),
    (UTILS, "test_allocate_with_lookahead", {}),
    (PREFIX, "test_prefill", {"hash_fn": "sha256"}),
    (PREFIX, "test_decode", {}),
    (PREFIX, "test_evict", {}),
    (PREFIX, "test_hash_block_correct_reuse", {}),
    (PREFIX, "test_computed_blocks_not_evicted", {}),
    (PREFIX, "test_prefill_not_enough_free_blocks_with_computed_blocks", {}),
    (PREFIX, "test_reset_prefix_cache", {}),
    (PREFIX, "test_kv_cache_events", {"blocks_to_cache": 2}),
    (PREFIX, "test_kv_cache_events", {"blocks_to_cache": 3}),
    (PREFIX, "test_kv_cache_events", {"blocks_to_cache": 10}),
    (PREFIX, "test_null_parent_block_hash", {}),
    (PREFIX, "test_block_removed_event_group_idx", {"group_id": 0}),
    (PREFIX, "test_cache_blocks", {"hash_fn": "sha256"}),
    (PREFIX, "test_cache_blocks", {"hash_fn": "sha256_cbor"}),
]

NOT_CLAIMED: dict[str, str] = {
    "test_kv_cache_block": "sets hashes through set_block_hash/reset_hash with group-id keys; ours are plain fields",
    "test_free_kv_cache_block_queue_append_n": (
        "its second half cuts a sentinel link of vLLM's linked list by hand and expects an AssertionError; "
        "our queue is a deque with no links to corrupt (the first half is covered by the other queue tests)"
    ),
    "test_cache_blocks_multi_group": "several KV cache groups",
    "test_maybe_evict_cached_block": "group-id hash keys and vLLM's private _maybe_evict_cached_block",
    "test_kv_cache_events_with_lora": "LoRA adapter ids (lora_id); tiered_kv knows LoRA names only",
    "test_block_stored_event_group_idx": "several KV cache groups (sliding window, Mamba)",
    "test_block_stored_event_group_idx_multiple_groups": "several KV cache groups",
    "test_block_stored_event_group_idx_out_of_bounds": "several KV cache groups",
    "test_block_stored_event_session_id": "session ids",
    "test_block_removed_event_group_idx[1], [2]": "group ids other than 0",
    "test_emit_cached_block_events": "emit_cached_block_events (events for reused blocks) is not built",
    "test_emit_cached_block_events_disabled": "emit_cached_block_events is not built",
    "test_emit_cached_block_events_zero_cached": "emit_cached_block_events is not built",
    "test_kv_events_reconstruct_lookahead_block_hashes": "lookahead hashing",
}


@cache
def _functions(rel: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse((vllm_source() / rel).read_text(), filename=rel)
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _compile(rel: str, name: str) -> Any:
    node = _functions(rel).get(name)
    assert node is not None, f"{name} is not in vLLM's {rel}"
    node = copy.copy(node)
    node.decorator_list = []  # parametrize marks: the case's arguments are given here
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    ns = vllm_adapter_core.namespace()
    # A property of the block record itself, and blocks built by hand for the pool to cache: ours, unwrapped.
    if name in ("test_kv_cache_block_uses_slots", "test_cache_blocks"):
        ns["KVCacheBlock"] = KVCacheBlock
    exec(compile(module, str(Path(vllm_source(), rel)), "exec"), ns)
    return ns[name]


@pytest.mark.parametrize(
    ("rel", "name", "kwargs"),
    RUN,
    ids=[f"{n}[{','.join(map(str, kw.values()))}]" if kw else n for _, n, kw in RUN],
)
def test_vllm_unit_test_passes_on_ours(rel: str, name: str, kwargs: dict[str, Any]) -> None:
    _compile(rel, name)(**kwargs)


def test_every_listed_vllm_test_exists() -> None:
    """The lists name vLLM 0.33.0's tests as they are, so a renamed or removed one is noticed."""
    names = set(_functions(UTILS)) | set(_functions(PREFIX))
    listed = {n for _, n, _ in RUN} | {k.split("[")[0] for k in NOT_CLAIMED}
    assert listed <= names, sorted(listed - names)
