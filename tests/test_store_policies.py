"""The store's cache policies: one contract for all, each policy's exact decisions, and request scope.

The exact decisions are vLLM 0.33.0's (``kv_offload/cpu/policies/lru.py`` and
``arc.py``); ``test_store_vllm_parity.py`` replays long traces against vLLM's
own classes, these are the small cases, each with exact keys, slots and order.
"""

from __future__ import annotations

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.policies import CACHE_POLICIES, get_cache_policy_cls, register_cache_policy
from tiered_kv.tiers.store import LoadStoreSpec, PrepareStoreOutput

NAMES = sorted(CACHE_POLICIES)
B = 16  # tokens per block


def out(keys, ids, evicted=()) -> PrepareStoreOutput:
    return PrepareStoreOutput(list(keys), LoadStoreSpec("CPU", tuple(ids)), list(evicted))


def snapshot(store: CPUStore) -> tuple:
    """Everything the store's public queries say, to check that a refused call changed nothing."""
    return (
        store.entries(),
        store.free_block_ids(),
        (store.num_used, store.num_pinned, store.num_pending, store.num_evictable),
        store.stats,
        store.policy.snapshot(),
        store.open_requests(),
    )


def request(store: CPUStore, rid: str, keys=(), start: int = 1) -> RequestContext:
    """Open request ``rid`` whose ``keys`` are its blocks from block ``start`` on (positions end tokens)."""
    ctx = RequestContext(rid)
    if keys:
        ctx.set_positions(list(keys), start * B, B)
    store.on_new_request(ctx)
    return ctx


def serve(store: CPUStore, rid: str, keys, load: int = 0) -> list:
    """One whole request: load its first ``load`` keys, store the rest, finish; returns what was evicted."""
    keys = list(keys)
    ctx = request(store, rid, keys)
    if load:
        store.prepare_load(keys[:load], ctx)
    prep = store.prepare_store(keys[load:], ctx)
    assert prep is not None
    store.complete_store(keys[load:], True, ctx)
    if load:
        store.complete_load(keys[:load], ctx)
    store.on_request_finished(ctx)
    return prep.evicted_keys


# ------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", NAMES)
def test_eviction_takes_exactly_what_is_needed_and_never_a_busy_or_given_key(name):
    store = CPUStore(7, name)
    serve(store, "A", "abcdef")  # finished: ranked head last, so f (the tail) is the first victim
    store.prepare_load(["a", "b"])  # pinned
    assert store.prepare_store(["x"]) == out("x", [6], evicted="f")
    store.complete_store(["x"])
    # Two to evict; a, b pinned, c given (protected), x the most recent: e and d go, in that order.
    assert store.prepare_store(["c", "y", "z"]) == out("yz", [4, 5], evicted="ed")
    assert sorted(e.key for e in store.entries()) == ["a", "b", "c", "x", "y", "z"]
    store.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_a_store_that_cannot_make_room_changes_no_entry(name):
    store = CPUStore(4, name, enable_events=True)
    serve(store, "A", "abc")
    store.take_events()
    store.prepare_load(["a"])
    before = snapshot(store)
    assert store.prepare_store(["b", "c", "x"]) is None  # b, c given, a pinned: nothing to evict
    assert snapshot(store) == before and store.take_events() == []
    store.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_a_failed_store_frees_its_slots_and_leaves_no_trace_in_the_order(name):
    store = CPUStore(4, name, enable_events=True)
    ctx = request(store, "A", "ab")
    assert store.prepare_store(["a", "b"], ctx) == out("ab", [1, 2])
    offer = {"a", "b"}  # vLLM's connector passes a set: slots are freed in its iteration order
    store.complete_store(offer, False, ctx)
    first, second = ({"a": 1, "b": 2}[k] for k in offer)
    assert store.entries() == [] and store.free_block_ids() == [3, second, first]
    assert [(sorted(e.keys), e.removed, e.metadata_only) for e in store.take_events()] == [(["a", "b"], True, True)]
    store.on_request_finished(ctx)
    assert store.policy.order() == []


# ------------------------------------------------------------------------ LRU
def test_lru_evicts_a_requests_tail_before_its_head():
    # The reproduction: [a0, a1] from A, then c0 for C evicts a1 (vLLM 0.33), not a0.
    store = CPUStore(3, "lru")
    serve(store, "A", ["a0", "a1"])
    assert serve(store, "C", ["c0"]) == ["a1"]
    assert store.policy.order() == ["a0", "c0"]


def test_lru_ranks_an_unfinished_requests_stores_by_position_even_out_of_order():
    store = CPUStore(4, "lru")
    ctx = request(store, "A", ["a0", "a1", "a2"])
    for key in ("a2", "a0", "a1"):  # a backfill: stores arrive out of prefix order
        store.prepare_store([key], ctx)
        store.complete_store([key], True, ctx)
    assert store.policy.order() == ["a2", "a1", "a0"]  # the tail goes first, the head last
    assert store.prepare_store(["x", "y"]) == out("xy", [3, 1], evicted=["a2", "a1"])


def test_lru_prepare_load_is_a_use_and_finishing_refreshes_the_request():
    store = CPUStore(5, "lru")
    serve(store, "A", ["a0", "a1"])
    serve(store, "B", ["b0", "b1"])
    assert store.policy.order() == ["a1", "a0", "b1", "b0"]
    ctx = request(store, "C", ["a0", "c1"])
    store.prepare_load(["a0"], ctx)  # a hit, read by C: no touch is needed (vLLM's connector sends none)
    store.complete_load(["a0"], ctx)
    store.on_request_finished(ctx)
    assert store.policy.order() == ["a1", "b1", "b0", "a0"]
    assert store.prepare_store(["x", "y"]) == out("xy", [4, 2], evicted=["a1", "b1"])


def test_lru_without_a_request_is_plain_lru():
    store = CPUStore(4, "lru")
    store.prepare_store(["a", "b", "c"])
    store.complete_store(["a", "b", "c"])
    store.touch(["b", "a"])  # reversed: the first key ends most recent
    assert store.policy.order() == ["c", "a", "b"]
    assert store.prepare_store(["x"]) == out("x", [3], evicted=["c"])


def test_lru_a_newer_requests_use_is_not_undone_by_an_older_one():
    store = CPUStore(4, "lru")
    old = request(store, "old", ["s0"])
    new = request(store, "new", ["s0"])
    store.prepare_store(["s0"], new)
    store.complete_store(["s0"], True, new)
    store.prepare_store(["s0"], old)  # the older request sees s0 later: s0 keeps the newer rank
    assert store.policy.rank("s0") == (2, -B)


# ------------------------------------------------------------------------ ARC
def test_arc_reuse_promotes_to_t2_only_when_the_request_finishes():
    store = CPUStore(5, "arc")
    serve(store, "A", ["a0", "a1"])
    assert (store.policy.t1, store.policy.t2) == (("a1", "a0"), ())  # finish walks tail to head
    ctx = request(store, "C", ["a0", "c1"])
    store.prepare_load(["a0"], ctx)
    assert (store.policy.t1, store.policy.t2) == (("a1", "a0"), ())  # not yet: the request may still fail
    store.complete_load(["a0"], ctx)
    store.on_request_finished(ctx)
    assert (store.policy.t1, store.policy.t2) == (("a1",), ("a0",))


def test_arc_keeps_a_requests_own_insertions_in_t1():
    store = CPUStore(5, "arc")
    ctx = request(store, "A", ["a0", "a1"])
    store.prepare_store(["a0"], ctx)
    store.complete_store(["a0"], True, ctx)
    store.prepare_store(["a0", "a1"], ctx)  # a0 offered again by the request that inserted it: no reuse
    store.complete_store(["a0", "a1"], True, ctx)
    store.on_request_finished(ctx)
    assert (store.policy.t1, store.policy.t2) == (("a1", "a0"), ())


def test_arc_a_pending_key_is_no_frequency_hit():
    store = CPUStore(5, "arc")
    store.prepare_store(["a"])
    store.touch(["a"])  # still being written: stays in T1, most recent
    assert (store.policy.t1, store.policy.t2) == (("a",), ())
    store.complete_store(["a"])
    store.touch(["a"])
    assert (store.policy.t1, store.policy.t2) == ((), ("a",))


def test_arc_a_stored_ghost_adapts_the_target_once_per_request():
    store = CPUStore(3, "arc")  # two slots
    serve(store, "A", ["a0", "a1"])
    serve(store, "B", ["b0", "b1"])  # a0, a1 evicted from T1: ghosts in B1
    assert store.policy.b1 == ("a1", "a0") and store.policy.target_t1_size == 0
    ctx = request(store, "C", ["a0"])
    store.prepare_store(["a0"], ctx)  # a B1 ghost offered again: recency was undervalued
    assert store.policy.target_t1_size == 1
    store.complete_store(["a0"], False, ctx)
    store.prepare_store(["a0"], ctx)  # the same request offering it again learns nothing more
    assert store.policy.target_t1_size == 1


def test_arc_falls_back_to_t1_when_t2_has_nothing_evictable():
    # vLLM 0.33's ARC: with T1 below its target and T2's only key pinned, it evicts from T1 (it does not refuse).
    store = CPUStore(4, "arc")
    for rid, key in (("A", "a0"), ("B", "b0"), ("C", "c0")):
        serve(store, rid, [key])
    for rid in ("D", "E"):
        serve(store, rid, ["a0"], load=1)  # a0 reused: promoted to T2
    assert serve(store, "F", ["x"]) == ["b0"]  # T1 at target (0): from T1, into B1
    for rid, ghost in (("G", "b0"), ("H", "c0")):  # two ghosts offered again (their stores fail): target 2
        ctx = request(store, rid, [ghost])
        store.prepare_store([ghost], ctx)
        store.complete_store([ghost], False, ctx)
        store.on_request_finished(ctx)
    policy = store.policy
    assert (policy.target_t1_size, policy.t1, policy.t2, policy.b1) == (2, ("x",), ("a0",), ())
    store.prepare_load(["a0"])  # T2's only key is pinned
    assert store.prepare_store(["y", "z"]) == out("yz", [2, 3], evicted="x")
    assert (policy.t1, policy.t2, policy.b1) == (("y", "z"), ("a0",), ("x",))


def test_arc_ghost_lists_are_bounded_by_the_capacity():
    store = CPUStore(3, "arc")
    for i in range(6):
        serve(store, f"r{i}", [f"k{i}"])
    assert store.policy.b1 == ("k2", "k3") and store.capacity == 2


# -------------------------------------------------------------------- factory
def test_an_unknown_policy_names_the_known_ones():
    with pytest.raises(InvalidArgumentError, match=r"policy must be one of \['arc', 'lru'\], got 'fifo'"):
        CPUStore(4, "fifo")
    with pytest.raises(InvalidArgumentError, match=r"cannot import cache policy module 'no_such_module'"):
        CPUStore(4, "fifo", policy_module_path="no_such_module")
    with pytest.raises(InvalidArgumentError, match=r"store_policy_fifo.nothing is not a CachePolicy subclass"):
        CPUStore(4, "nothing", policy_module_path="store_policy_fifo")


def test_a_users_policy_loads_by_module_path_without_registering():
    store = CPUStore(3, "FIFOPolicy", policy_module_path="store_policy_fifo")  # defined outside the package
    serve(store, "A", ["a0", "a1"])
    assert serve(store, "B", ["b0"]) == ["a0"]  # first in, first out: no request ranking
    assert "FIFOPolicy" not in CACHE_POLICIES


def test_a_users_policy_registers_by_name_once(monkeypatch):
    import store_policy_fifo

    monkeypatch.setattr("tiered_kv.tiers.policies.factory.CACHE_POLICIES", dict(CACHE_POLICIES))
    register_cache_policy("fifo", store_policy_fifo.FIFOPolicy)
    assert get_cache_policy_cls("fifo") is store_policy_fifo.FIFOPolicy
    assert CPUStore(4, "fifo").policy.name == "fifo"
    with pytest.raises(InvalidArgumentError, match="cache policy 'fifo' is already registered"):
        register_cache_policy("fifo", store_policy_fifo.FIFOPolicy)
    with pytest.raises(InvalidArgumentError, match="cls must be a CachePolicy subclass"):
        register_cache_policy("dict", dict)


def test_a_users_per_key_hooks_see_each_key_in_order_through_the_batched_calls(monkeypatch):
    """The store calls ``insert_all`` / ``mark_*_all`` once per call; a policy with per-key hooks only gets each key."""
    import store_policy_fifo

    seen: list[tuple[str, object]] = []

    class Recording(store_policy_fifo.FIFOPolicy):
        def insert(self, key, req):
            seen.append(("insert", key))
            super().insert(key, req)

        def mark_evictable(self, key):
            seen.append(("evictable", key))

        def mark_non_evictable(self, key):
            seen.append(("pinned", key))

    monkeypatch.setattr("tiered_kv.tiers.policies.factory.CACHE_POLICIES", dict(CACHE_POLICIES))
    register_cache_policy("recording", Recording)
    store = CPUStore(5, "recording")
    store.prepare_store(["a", "b", "c"])
    store.complete_store(["c", "a", "b"])
    store.prepare_load(["b", "a"])
    store.prepare_load(["a", "c"])  # a is pinned already: only c changes evictability
    store.complete_load(["a", "b"])  # a keeps one load: only b becomes evictable
    assert seen == [
        *(("insert", k) for k in "abc"),
        *(("evictable", k) for k in "cab"),
        ("pinned", "b"),
        ("pinned", "a"),
        ("pinned", "c"),
        ("evictable", "b"),
    ]
