"""The CPU block store: exact victims, slot ids and events on tiny stores; bad input changes nothing."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import pytest

import tiered_kv
from tiered_kv.errors import BlockStateError, InvalidArgumentError, TieredKVError
from tiered_kv.tiers.cpu_store import CPUStore, key_set, make_prepare_output, make_spec
from tiered_kv.tiers.store import LoadStoreSpec, LookupResult, PrepareStoreOutput, StoreEntry, StoreEvent, StoreStats

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def stored(num_blocks: int, keys, policy: str = "lru") -> CPUStore:
    """A store with ``keys`` stored and ready, events drained."""
    store = CPUStore(num_blocks, policy=policy, enable_events=True)
    assert store.prepare_store(list(keys)) is not None
    store.complete_store(list(keys))
    store.take_events()
    return store


def snapshot(store: CPUStore) -> tuple:
    return (
        store.entries(),
        store.free_block_ids(),
        (store.num_used, store.num_free, store.num_pinned, store.num_pending, store.num_evictable, store.usage),
        store.stats,
        store.policy.snapshot(),
    )


def keys_of(store: CPUStore) -> list:
    return [e.key for e in store.entries()]


def out(keys, ids, evicted=()) -> PrepareStoreOutput:
    return PrepareStoreOutput(list(keys), LoadStoreSpec("CPU", tuple(ids)), list(evicted))


# ---------------------------------------------------------------- exact order
def test_fresh_slots_ascend_from_one_then_the_last_freed_is_reused_first():
    store = CPUStore(5, enable_events=True)
    assert store.capacity == 4 and store.free_block_ids() == [1, 2, 3, 4]
    assert store.prepare_store(["a", "b", "c"]) == out("abc", [1, 2, 3])
    store.complete_store(["a", "b", "c"])
    store.touch(["a"])  # order now b, c, a
    # One fresh id (4) is handed out before any freed one; then b's and c's slots, c's (freed last) first.
    assert store.prepare_store(["d", "e", "f"]) == out("def", [4, 3, 2], evicted="bc")
    assert store.free_block_ids() == []
    assert keys_of(store) == ["a", "d", "e", "f"]
    assert store.take_events() == [
        StoreEvent(["a", "b", "c"], "CPU", False),
        StoreEvent(["b", "c"], "CPU", True),
    ]
    store.check_invariants()


def test_touch_walks_keys_in_reverse_so_the_first_ends_most_recent():
    store = stored(5, "abcd")
    store.touch(["b", "a", "zz"])  # unknown keys are ignored
    assert keys_of(store) == ["c", "d", "a", "b"]
    assert store.prepare_store(["x", "y"]) == out("xy", [4, 3], evicted="cd")
    assert store.prepare_store(["z"]) == out("z", [1], evicted="a")


def test_given_keys_already_present_are_skipped_and_never_evicted():
    store = stored(4, "abc")
    # a is least recent, but it is one of the given keys: b goes instead.
    assert store.prepare_store(["a", "x"]) == out("x", [2], evicted="b")
    assert store.prepare_store(["x", "a"]) == out([], [])  # x pending, a ready: nothing to do
    assert keys_of(store) == ["a", "c", "x"]


def test_pending_entries_are_neither_loadable_nor_evictable():
    store = CPUStore(3, enable_events=True)
    assert store.prepare_store(["a", "b"]) == out("ab", [1, 2])
    assert store.lookup("a") is PENDING and store.lookup_prefix(["a"]) == 0
    before = snapshot(store)
    assert store.prepare_store(["c"]) is None
    assert snapshot(store) == before
    with pytest.raises(BlockStateError, match="store is still in flight"):
        store.prepare_load(["a"])
    store.complete_store(["a"])
    assert store.lookup("a") is HIT and store.lookup("b") is PENDING
    assert store.prepare_store(["c"]) == out("c", [1], evicted="a")
    assert store.take_events() == [StoreEvent(["a"], "CPU", False), StoreEvent(["a"], "CPU", True)]


def test_pinned_entries_are_skipped_by_eviction_and_keep_their_age():
    store = stored(4, "abc")
    assert store.prepare_load(["a", "c"]) == LoadStoreSpec("CPU", (1, 3))
    assert store.prepare_load(["a"]) == LoadStoreSpec("CPU", (1,))
    assert (store.num_pinned, store.num_evictable) == (2, 1)
    assert [(e.key, e.ref_cnt) for e in store.entries()] == [("a", 2), ("b", 0), ("c", 1)]
    assert store.prepare_store(["x"]) == out("x", [2], evicted="b")
    assert store.prepare_store(["y"]) is None  # a, c pinned and x pending
    store.complete_load(["a", "c"])
    assert store.prepare_store(["y"]) == out("y", [3], evicted="c")  # a still pinned once
    store.complete_load(["a"])
    store.complete_store(["x", "y"])
    assert store.prepare_store(["z"]) == out("z", [1], evicted="a")  # a kept its age: least recent
    store.check_invariants()


def test_a_refused_store_evicts_nothing_even_when_some_room_could_be_made():
    store = stored(4, "abc")
    store.prepare_load(["c"])
    before = snapshot(store)
    # Needs 2 evictions; a and b are evictable but a is protected, so only b qualifies.
    assert store.prepare_store(["a", "x", "y"]) is None
    assert store.prepare_store(["w", "x", "y", "z"]) is None  # more than the capacity
    assert snapshot(store) == before and store.take_events() == []


def test_complete_store_success_false_frees_slots_in_key_order_with_a_metadata_only_event():
    store = CPUStore(5, enable_events=True)
    store.prepare_store(["a", "b", "c"])
    store.complete_store(["a"])
    store.complete_store(["c", "b", "a", "zz"], success=False)  # a is ready and zz unknown: ignored
    assert keys_of(store) == ["a"] and store.free_block_ids() == [4, 2, 3]
    # vLLM 0.33: a failed store releases its slots with a removed, metadata-only event (no public eviction).
    assert store.take_events() == [StoreEvent(["a"], "CPU", False), StoreEvent(["c", "b"], "CPU", True, True)]
    assert store.prepare_store(["d", "e", "f"]) == out("def", [4, 2, 3])


def test_a_failed_store_event_drops_keys_stored_again_before_the_events_are_taken():
    store = CPUStore(5, enable_events=True)
    store.prepare_store(["a", "b"])
    store.complete_store(["a", "b"], success=False)
    store.prepare_store(["b"])  # a retry of b before anyone drained the events
    assert store.take_events() == [StoreEvent(["a"], "CPU", True, True)]
    store.complete_store(["b"], success=False)
    store.prepare_store(["b"])
    assert store.take_events() == []  # the only key of the cleanup event is resident again
    assert store.take_events() == []


def test_complete_store_ignores_keys_that_are_not_pending():
    store = stored(4, "ab")
    store.prepare_store(["a", "c"])
    before = snapshot(store)
    store.complete_store(["a", "b", "zz"])
    store.complete_store(["b", "zz"], success=False)
    assert snapshot(store) == before and store.take_events() == []
    store.complete_store(["a", "c"])
    assert store.take_events() == [StoreEvent(["c"], "CPU", False)]


def test_lookup_prefix_stops_at_the_first_key_that_is_not_ready():
    store = stored(6, "abc")
    store.prepare_store(["d"])
    assert store.lookup_prefix(["a", "b", "c", "d", "e"]) == 3
    assert store.lookup_prefix(["b", "x", "c"]) == 1
    assert store.lookup_prefix([]) == 0
    assert [store.lookup(k) for k in "adx"] == [HIT, PENDING, MISS]
    assert store.stats == StoreStats(queries=11, hits=5, pending_hits=1, evictions=0)


def test_remove_drops_ready_unpinned_entries_and_refuses_the_rest():
    store = stored(5, "abc")
    store.prepare_load(["b"])
    store.prepare_store(["d"])
    for bad, why in (("b", "load"), ("d", "in flight"), ("zz", "not stored")):
        before = snapshot(store)
        with pytest.raises(BlockStateError, match=why):
            store.remove(["a", bad])
        assert snapshot(store) == before
    store.remove(["c", "a"])
    assert keys_of(store) == ["b", "d"] and store.free_block_ids() == [1, 3]
    assert store.take_events() == [StoreEvent(["c", "a"], "CPU", True)]
    assert store.stats.evictions == 0
    assert store.prepare_store(["e", "f"]) == out("ef", [1, 3])


def test_gauges_follow_every_state():
    store = CPUStore(5)
    assert (store.num_blocks, store.capacity, store.num_used, store.num_free, store.usage) == (5, 4, 0, 4, 0.0)
    store.prepare_store(["a", "b", "c"])
    store.complete_store(["a", "b"])
    store.prepare_load(["a"])
    assert (store.num_used, store.num_free, store.num_pending, store.num_pinned, store.num_evictable) == (3, 1, 1, 1, 1)
    assert store.usage == 0.75
    assert store.entries() == [
        StoreEntry("a", 1, True, 1),
        StoreEntry("b", 2, True, 0),
        StoreEntry("c", 3, False, 0),
    ]
    assert store.take_events() == []  # events are off unless asked for
    assert repr(store) == "CPUStore(num_blocks=5, policy='lru', used=3, pending=1, pinned=1)"


def test_prepare_store_with_nothing_new_changes_nothing():
    store = stored(3, "ab")
    before = snapshot(store)
    assert store.prepare_store(["b", "a"]) == out([], [])
    assert store.prepare_store([]) == out([], [])
    assert snapshot(store) == before


def test_arc_store_promotes_on_touch_and_evicts_recent_first():
    store = stored(4, "abc", policy="arc")
    store.touch(["a"])  # a is ready: promoted to T2
    assert (store.policy.t1, store.policy.t2) == (("b", "c"), ("a",))
    assert store.prepare_store(["x", "y"]) == out("xy", [3, 2], evicted="bc")
    assert store.policy.b1 == ("b", "c")
    store.touch(["x"])  # pending: stays in T1, as most recent
    assert store.policy.t1 == ("y", "x")
    store.check_invariants()


# ------------------------------------------------- what eviction passes over
def test_eviction_passes_over_busy_keys_and_still_takes_the_least_recent_evictable():
    store = stored(9, "abcdefgh")  # full: slots 1..8
    store.prepare_load(["a", "b", "c"])  # the three oldest are pinned
    assert store.prepare_store(["x"]) == out("x", [4], evicted="d")
    assert keys_of(store) == list("abcefghx")  # a, b, c keep their age: recency is logical
    store.complete_load(["b"])  # b can go again, and it is still older than e
    assert store.prepare_store(["y"]) == out("y", [2], evicted="b")
    store.touch(["a"])  # a used: most recent, wherever it was kept
    assert keys_of(store) == list("cefghxya")
    store.complete_load(["a", "c"])
    assert store.prepare_store(["z"]) == out("z", [3], evicted="c")
    assert store.prepare_store(["w"]) == out("w", [5], evicted="e")
    store.check_invariants()


def test_protected_keys_are_skipped_and_then_evicted_in_their_turn():
    store = stored(5, "abcd")
    store.prepare_load(["a"])
    # a pinned, b protected by this very call: both passed over, c goes.
    assert store.prepare_store(["b", "x"]) == out("x", [3], evicted="c")
    assert store.prepare_store(["y"]) == out("y", [2], evicted="b")  # b is now the oldest evictable key
    store.complete_load(["a"])
    store.complete_store(["x", "y"])
    assert store.prepare_store(["z"]) == out("z", [1], evicted="a")
    store.check_invariants()


def test_a_refused_eviction_over_set_aside_keys_changes_nothing():
    store = stored(5, "abcd")
    store.prepare_load(["a"])
    assert store.prepare_store(["x"]) == out("x", [2], evicted="b")  # a set aside; x pending
    store.complete_load(["a"])  # a evictable again, still set aside
    before = snapshot(store)
    # Two to evict; a can go, but c and d are protected and x is pending: refused whole.
    assert store.prepare_store(["c", "d", "y", "z"]) is None
    assert snapshot(store) == before
    store.check_invariants()
    assert store.prepare_store(["c", "y", "z"]) == out("yz", [4, 1], evicted="ad")  # the last freed first


# ------------------------------------------------------ queries and helpers
def test_missing_names_the_absent_keys_in_order_and_counts_no_query():
    store = populated()
    stats = store.stats
    assert store.missing(["a", "x", "c", "d", "y"]) == [1, 4]  # pinned and pending keys are resident
    assert store.missing(()) == [] and store.missing([0, 1]) == [0, 1]  # 0 and 1 are keys, not bools
    assert store.stats == stats


def test_contains_is_ready_and_room_for_count_no_query():
    store = populated()  # a, b ready and evictable; c pinned; d pending; one free slot
    before = store.stats
    assert [store.contains(k) for k in "abcdz"] == [True, True, True, True, False]
    assert [store.is_ready(k) for k in "abcdz"] == [True, True, True, False, False]
    assert store.room_for([]) == 3  # the free slot, a and b
    assert store.room_for(["a"]) == 2
    assert store.room_for(("b", "x", "a")) == 1
    assert store.room_for(["c", "d", "z"]) == 3  # pinned, pending and absent keys protect nothing evictable
    assert store.stats == before


@pytest.mark.parametrize("keys", [["x"], ["x", "y"], ["x", "y", "z"], ["a", "x"], ["a", "x", "y"], ["b", "a", "x"]])
def test_room_for_is_how_many_absent_keys_prepare_store_takes(keys):
    store = populated()
    absent = [k for k in keys if not store.contains(k)]
    fits = len(absent) <= store.room_for(keys)
    got = store.prepare_store(keys)
    assert (got is not None) == fits
    if got is not None:
        assert got.keys_to_store == absent


def test_key_set_is_the_set_of_keys_once_they_pass_the_checks():
    assert key_set("keys", ["a", 1, b"x", ("t", 2)]) == {"a", 1, b"x", ("t", 2)}
    assert key_set("keys", (0, 1)) == {0, 1}  # 0 and 1 are keys; False and True are not
    assert key_set("keys", []) == set()
    for bad, message in [
        ([0, False], r"keys\[1\].*not a bool"),
        ([True], r"keys\[0\].*not a bool"),
        (["a", None], r"keys\[1\] must be a hashable id"),
        ([["a"]], r"keys\[0\] must be a hashable id"),
        ([1, "a", 1], r"twice \(positions 0 and 2\)"),
        ("ab", "must be a collection of keys"),
        ({"a": 1}, "must be a collection of keys"),
        (iter(["a"]), "must be a collection of keys"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            key_set("keys", bad)
    # vLLM 0.33's connector completes stores with a set: any collection of keys is accepted.
    assert key_set("keys", {"a", 1}) == {"a", 1} and key_set("keys", frozenset([b"x"])) == {b"x"}


def test_fast_built_results_are_the_same_frozen_records():
    built = make_prepare_output(["a"], "CPU", (1,), ["b"])
    made = PrepareStoreOutput(["a"], LoadStoreSpec("CPU", (1,)), ["b"])
    assert built == made and repr(built) == repr(made)
    assert make_spec("CPU", (1, 2)) == LoadStoreSpec("CPU", (1, 2))
    assert hash(make_spec("CPU", (1, 2))) == hash(LoadStoreSpec("CPU", (1, 2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.keys_to_store = []  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.store_spec.block_ids = ()  # type: ignore[misc]


def test_store_modules_import_only_the_standard_library():
    root = pathlib.Path(tiered_kv.__file__).parent / "tiers"
    policies = ("base", "lru", "arc", "factory")
    allowed = {"tiered_kv.checks", "tiered_kv.errors", "tiered_kv.tiers.store", "tiered_kv.tiers.cpu_store"}
    allowed |= {f"tiered_kv.tiers.policies.{name}" for name in policies}
    for name in ("store.py", "cpu_store.py", *(f"policies/{p}.py" for p in policies)):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
                if node.module == "tiered_kv":
                    mods = [f"tiered_kv.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for mod in mods:
                ok = mod in allowed or mod.split(".")[0] in sys.stdlib_module_names
                assert ok, f"{name} imports {mod}"


# ------------------------------------------------------------------ bad input
def populated() -> CPUStore:
    """Ready+evictable a, b; pinned c; pending d; one free slot."""
    store = stored(6, "abc")
    store.prepare_load(["c"])
    store.prepare_store(["d"])
    store.take_events()
    return store


CASES = [
    ("lookup None", InvalidArgumentError, "key must be a hashable id, got None", lambda s: s.lookup(None)),
    ("lookup unhashable", InvalidArgumentError, r"key must be a hashable id, got \['a'\]", lambda s: s.lookup(["a"])),
    ("lookup bool", InvalidArgumentError, "key must be a hashable key that is not a bool", lambda s: s.lookup(True)),
    ("contains None", InvalidArgumentError, "key must be a hashable id, got None", lambda s: s.contains(None)),
    ("contains unhashable", InvalidArgumentError, "key must be a hashable id", lambda s: s.contains({})),
    ("is_ready bool", InvalidArgumentError, "not a bool", lambda s: s.is_ready(False)),
    ("is_ready unhashable", InvalidArgumentError, "key must be a hashable id", lambda s: s.is_ready(["a"])),
    ("room_for twice a key", InvalidArgumentError, "twice", lambda s: s.room_for(["a", "a"])),
    ("room_for None key", InvalidArgumentError, r"keys\[0\]", lambda s: s.room_for([None])),
    ("missing in a str", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.missing("ab")),
    ("missing None key", InvalidArgumentError, r"keys\[1\]", lambda s: s.missing(["a", None])),
    ("missing unhashable", InvalidArgumentError, r"keys\[0\] must be a hashable", lambda s: s.missing([{}])),
    ("store one unhashable", InvalidArgumentError, r"keys\[0\] must be a hashable", lambda s: s.prepare_store([{}])),
    ("store one None", InvalidArgumentError, r"keys\[0\]", lambda s: s.prepare_store((None,))),
    ("store one True", InvalidArgumentError, "not a bool", lambda s: s.prepare_store([True])),
    ("prefix of a str", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.lookup_prefix("ab")),
    ("prefix of bytes", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.lookup_prefix(b"ab")),
    ("prefix of an int", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.lookup_prefix(3)),
    (
        "prefix with None",
        InvalidArgumentError,
        r"keys\[1\] must be a hashable id",
        lambda s: s.lookup_prefix(["a", None]),
    ),
    (
        "prefix twice a key",
        InvalidArgumentError,
        r"names key 'a' \(str\) twice \(positions 0 and 2\)",
        lambda s: s.lookup_prefix(["a", "b", "a"]),
    ),
    (
        "load absent",
        BlockStateError,
        r"cannot load key 'zz' \(str\) \(keys\[1\]\).*not stored",
        lambda s: s.prepare_load(["a", "zz"]),
    ),
    ("load pending", BlockStateError, r"keys\[2\].*still in flight", lambda s: s.prepare_load(["a", "b", "d"])),
    (
        "load a generator",
        InvalidArgumentError,
        "keys must be a collection of keys",
        lambda s: s.prepare_load(k for k in "ab"),
    ),
    ("load twice a key", InvalidArgumentError, "twice", lambda s: s.prepare_load(["a", "a"])),
    ("load unhashable", InvalidArgumentError, r"keys\[0\] must be a hashable", lambda s: s.prepare_load([{}])),
    ("touch a str", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.touch("ab")),
    ("touch None", InvalidArgumentError, r"keys\[0\]", lambda s: s.touch([None])),
    ("touch twice a key", InvalidArgumentError, "twice", lambda s: s.touch(["b", "a", "b"])),
    ("unload unpinned", BlockStateError, r"key 'a'.*not being loaded", lambda s: s.complete_load(["c", "a"])),
    ("unload absent", BlockStateError, "not stored", lambda s: s.complete_load(["c", "zz"])),
    ("unload pending", BlockStateError, "in flight", lambda s: s.complete_load(["d"])),
    ("unload twice a key", InvalidArgumentError, "twice", lambda s: s.complete_load(["c", "c"])),
    ("unload None", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.complete_load(None)),
    ("store None", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.prepare_store(None)),
    ("store None key", InvalidArgumentError, r"keys\[1\]", lambda s: s.prepare_store(["x", None])),
    ("store bool key", InvalidArgumentError, "not a bool", lambda s: s.prepare_store([False])),
    ("store bool after 1", InvalidArgumentError, r"keys\[1\].*not a bool", lambda s: s.prepare_store([1, True])),
    ("store twice a key", InvalidArgumentError, "twice", lambda s: s.prepare_store(["x", "y", "x"])),
    ("store unhashable", InvalidArgumentError, r"keys\[0\]", lambda s: s.prepare_store([["x"]])),
    (
        "complete success int",
        InvalidArgumentError,
        "success must be True or False, got 1",
        lambda s: s.complete_store(["d"], 1),
    ),
    (
        "complete success None",
        InvalidArgumentError,
        "success must be True or False",
        lambda s: s.complete_store(["d"], success=None),
    ),
    ("complete twice a key", InvalidArgumentError, "twice", lambda s: s.complete_store(["d", "d"])),
    ("complete None key", InvalidArgumentError, r"keys\[0\]", lambda s: s.complete_store([None], False)),
    ("remove pinned", BlockStateError, r"1 load\(s\) in flight", lambda s: s.remove(["a", "c"])),
    ("remove pending", BlockStateError, "in flight", lambda s: s.remove(["b", "d"])),
    ("remove absent", BlockStateError, "not stored", lambda s: s.remove(["a", "zz"])),
    ("remove twice a key", InvalidArgumentError, "twice", lambda s: s.remove(["a", "a"])),
    ("remove a dict", InvalidArgumentError, "keys must be a collection of keys", lambda s: s.remove({"a": 1})),
]


@pytest.mark.parametrize(("what", "error", "message", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(what, error, message, call):
    store = populated()
    before = snapshot(store)
    with pytest.raises(error, match=message) as info:
        call(store)
    assert isinstance(info.value, TieredKVError)
    assert snapshot(store) == before
    assert store.take_events() == []
    store.check_invariants()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, r"num_blocks must be an int >= 1 \(slot 0 is reserved: 1 holds nothing\), got 0"),
        ({"num_blocks": True}, "num_blocks must be an int >= 1"),
        ({"num_blocks": 4.0}, "num_blocks must be an int >= 1"),
        ({"num_blocks": "4"}, "num_blocks must be an int >= 1"),
        ({"num_blocks": 4, "policy": "fifo"}, r"policy must be one of \['arc', 'lru'\], got 'fifo'"),
        ({"num_blocks": 4, "policy": None}, "policy must be one of"),
        ({"num_blocks": 4, "policy": ["lru"]}, "policy must be one of"),
        ({"num_blocks": 4, "enable_events": 1}, "enable_events must be True or False"),
    ],
)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        CPUStore(**kwargs)
