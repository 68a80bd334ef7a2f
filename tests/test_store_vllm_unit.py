"""vLLM 0.33.0's own unit tests of ``CPUOffloadingManager`` and its LRU/ARC policies, run against our CPU store.

``tests/v1/kv_offload/cpu/test_manager.py`` from vLLM's source distribution is
imported with ``CPUOffloadingManager`` replaced by a thin adapter over
:class:`~tiered_kv.tiers.cpu_store.CPUStore` (``vllm_store_adapter.py``) and its
policy classes by ours, and each of its tests (each parametrization) runs here
as one case.  The tests left out are listed in :data:`NOT_CLAIMED`, each with
the reason: they cover a vLLM feature we do not claim, or they reach into
vLLM's private objects rather than the manager's behaviour.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import vllm_ref_offload
import vllm_store_adapter

from tiered_kv.tiers.policies import ARCPolicy, LRUPolicy

TESTS = "tests/v1/kv_offload/cpu/test_manager.py"

_INTERNALS = "reaches into vLLM's private objects (its policy's heap or ChunkStatus records, monkeypatched methods)"
_POLICY_ALONE = "calls the policy object alone, with vLLM's policy signatures (ours takes the store's predicates)"
_ARC_STATE = "sets ARC's target by hand (ours is changed only by ghost hits); the fallback it checks is covered here"
_GROUPS = "hybrid models' several KV cache groups per key are not claimed (our keys carry no group index)"
_THRESHOLD = "store_threshold (admission only after repeated offers) is a vLLM feature we do not claim"
NOT_CLAIMED = {
    "test_filter_reused_manager_reports_stores_skipped_counter": _THRESHOLD,
    "test_filter_reused_manager": _THRESHOLD,
    "test_filter_reused_manager_oversized_offer_makes_progress": _THRESHOLD,
    "test_store_threshold_does_not_hide_ready_reuse": _THRESHOLD,
    "test_cpu_manager_reports_no_config_info_without_info": "config_info (vLLM's Prometheus labels) is not claimed",
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": _INTERNALS,
    "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": _INTERNALS,
    "test_evictable_cache_chunk_count": _INTERNALS,
    "test_touch_forwards_req_context_to_policy": _INTERNALS,
    "test_request_finish_forwards_grouped_deduplicated_accesses": _INTERNALS,
    "test_failed_store_records_access_once_and_uses_store_miss_hook": _INTERNALS,
    "test_request_key_positions_order_tails_across_kv_groups": _GROUPS,
    "test_lru_batch_eviction_failure_is_atomic": _POLICY_ALONE,
    "test_arc_pending_chunk_is_not_a_frequency_hit": _INTERNALS,
    "test_lru_insert_orders_positioned_chunks_without_followup_access": _POLICY_ALONE,
    "test_lru_incremental_stores_do_not_rescan_the_prefix": (
        "counts calls of vLLM's ReqContext.get_offload_key_position (its own cost, not a decision)"
    ),
    "test_unfinished_lru_prefix_survives_pressure_across_store_batches": _GROUPS,
    "TestARCPolicy::test_batch_eviction_scans_t1_and_t2_once": _INTERNALS,
    "TestARCPolicy::test_t1_t2_eviction_policy": _ARC_STATE,
    "TestARCPolicy::test_batch_eviction_falls_back_after_t1_iterator_exhausted": _ARC_STATE,
    "TestARCPolicy::test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction": _INTERNALS,
    "TestARCPolicy::test_batch_eviction_failure_is_atomic": _POLICY_ALONE,
    "TestARCPolicy::test_ghost_list_bounds": _INTERNALS,
}


def _cases() -> list:
    """(id, function name, class name or None, kwargs) for every test and parametrization in vLLM's file."""
    v = vllm_ref_offload.load()
    mod = vllm_ref_offload.load_test_module(TESTS, "vllm_kv_offload_test_manager", {})
    out = []
    items = [(n, None, f) for n, f in vars(mod).items() if n.startswith("test_") and inspect.isfunction(f)]
    for cname, cls in vars(mod).items():
        if cname.startswith("Test") and inspect.isclass(cls):
            items += [(n, cname, f) for n, f in vars(cls).items() if n.startswith("test_")]
    for name, cname, fn in items:
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        grids = []
        for m in marks:
            argnames = m.args[0] if isinstance(m.args[0], list | tuple) else [a.strip() for a in m.args[0].split(",")]
            values = [vals if len(argnames) > 1 else (vals,) for vals in m.args[1]]
            grids.append([dict(zip(argnames, vals, strict=True)) for vals in values])
        for combo in itertools.product(*grids) if grids else [()]:
            kwargs = {k: val for part in combo for k, val in part.items()}
            full = f"{cname}::{name}" if cname else name
            cid = full + (f"[{'-'.join(str(x) for x in kwargs.values())}]" if kwargs else "")
            out.append(pytest.param(full, kwargs, id=cid))
    del v
    return out


try:
    CASES = _cases()
except BaseException as e:  # vLLM could not be fetched: one case that skips (or fails in CI) with the reason
    _error = e
    CASES = [pytest.param(None, {}, id="vllm-source")]


@pytest.mark.parametrize(("full", "kwargs"), CASES)
def test_vllm_unit_test_passes_against_our_store(full, kwargs):
    if full is None:
        vllm_ref_offload.load()  # skips, or fails under CI, with the reason
        raise _error
    if full in NOT_CLAIMED:
        pytest.skip(NOT_CLAIMED[full])  # the reason is in NOT_CLAIMED
    v = vllm_ref_offload.load()
    adapter = vllm_store_adapter.make_adapter(v)
    mod = vllm_ref_offload.load_test_module(
        TESTS,
        "vllm_kv_offload_test_manager",
        {"CPUOffloadingManager": adapter, "ARCCachePolicy": ARCPolicy, "LRUCachePolicy": LRUPolicy},
    )
    cname, _, name = full.rpartition("::")
    fn = getattr(getattr(mod, cname)(), name) if cname else getattr(mod, name)
    fn(**kwargs)


def test_every_test_left_out_exists_in_vllms_file():
    names = {c.values[0] for c in CASES}
    assert None in names or set(NOT_CLAIMED) <= names
