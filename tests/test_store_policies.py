"""One contract test for every store cache policy, then each policy's exact order."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.manager.store_policies import CACHE_POLICIES, ARCPolicy, LRUPolicy, make_cache_policy

NAMES = sorted(CACHE_POLICIES)


def ready(_key) -> bool:
    return True


def anything(_key) -> bool:
    return True


def filled(name: str, keys, capacity: int = 8):
    policy = make_cache_policy(name, capacity)
    for key in keys:
        policy.insert(key)
    return policy


# ------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", NAMES)
def test_insert_adds_most_recent_keys_and_refuses_a_resident_one(name):
    policy = filled(name, "abc")
    assert (len(policy), policy.order(), "b" in policy, "z" in policy) == (3, ["a", "b", "c"], True, False)
    before = policy.snapshot()
    with pytest.raises(BlockStateError, match=f"key 'b' \\(str\\): it is already in the {name} policy"):
        policy.insert("b")
    assert policy.snapshot() == before


@pytest.mark.parametrize("name", NAMES)
def test_remove_forgets_the_key_entirely(name):
    policy = filled(name, "abc")
    policy.touch(["a"], ready)
    policy.remove("a")
    policy.remove("b")
    assert ("a" in policy, "b" in policy, len(policy), policy.order()) == (False, False, 1, ["c"])
    before = policy.snapshot()
    policy.touch(["a", "b"], ready)  # no ghost was left behind to learn from
    assert policy.snapshot() == before
    with pytest.raises(BlockStateError, match="it is not in the"):
        policy.remove("a")
    assert policy.snapshot() == before
    policy.insert("a")
    assert policy.order()[-1] == "a"


@pytest.mark.parametrize("name", NAMES)
def test_touch_of_unknown_keys_is_harmless(name):
    policy = filled(name, "abc")
    before = policy.snapshot()
    policy.touch(["x", "y"], ready)
    policy.touch([], ready)
    assert policy.snapshot() == before


@pytest.mark.parametrize("name", NAMES)
def test_touch_never_adds_or_drops_a_key(name):
    policy = filled(name, "abcd")
    policy.touch(["d", "b"], ready)
    policy.touch(["b", "a"], lambda k: k != "a")
    assert sorted(policy.order()) == ["a", "b", "c", "d"] and len(policy) == 4


@pytest.mark.parametrize("name", NAMES)
def test_evict_zero_and_evict_from_empty(name):
    policy = make_cache_policy(name, 4)
    assert policy.evict(0, anything) == []
    assert policy.evict(1, anything) is None
    assert policy.snapshot() == make_cache_policy(name, 4).snapshot()


OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "touch", "evict", "remove"]), st.lists(st.integers(0, 9), max_size=4)),
    max_size=40,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(ops=OPS, allowed=st.sets(st.integers(0, 9)), n=st.integers(0, 6))
def test_evict_returns_exactly_n_allowed_keys_or_none_and_then_changes_nothing(name, ops, allowed, n):
    policy = make_cache_policy(name, 5)
    pending: set[int] = set()

    def is_ready(key) -> bool:
        return key not in pending

    for op, keys in ops:  # drive the policy into an arbitrary state through its public verbs
        keys = list(dict.fromkeys(keys))
        if op == "insert":
            for k in keys:
                if k not in policy and len(policy) < 5:
                    policy.insert(k)
                    pending.add(k)
        elif op == "touch":
            policy.touch(keys, is_ready)
            pending.difference_update(keys[:1])  # some stores complete
        elif op == "remove":
            for k in keys:
                if k in policy:
                    policy.remove(k)
        else:
            policy.evict(len(keys), is_ready)
    resident = policy.order()
    before = policy.snapshot()
    victims = policy.evict(n, lambda k: k in allowed)
    if victims is None:
        assert policy.snapshot() == before
        assert n > 0
    else:
        assert len(victims) == n == len(set(victims))
        assert set(victims) <= allowed & set(resident)
        assert policy.order() == [k for k in resident if k not in victims]
    if len(allowed & set(resident)) < n:
        assert victims is None


@pytest.mark.parametrize("name", NAMES)
def test_evict_never_picks_a_key_the_store_forbids(name):
    policy = filled(name, range(6))
    assert policy.evict(2, lambda k: k % 2 == 1) == [1, 3]
    assert policy.evict(2, lambda k: k == 5) is None
    assert sorted(policy.order()) == [0, 2, 4, 5]


BAD_CALLS = [
    ("evict bool", "n must be an int >= 0, got True", lambda p: p.evict(True, anything)),
    ("evict negative", "n must be an int >= 0, got -1", lambda p: p.evict(-1, anything)),
    ("evict float", "n must be an int >= 0, got 1.0", lambda p: p.evict(1.0, anything)),
    ("evict no predicate", "can_evict must be a callable", lambda p: p.evict(1, None)),
    ("touch a str", "keys must be a list or tuple", lambda p: p.touch("ab", ready)),
    ("touch None key", r"keys\[1\] must be a hashable id", lambda p: p.touch(["a", None], ready)),
    ("touch twice a key", "twice", lambda p: p.touch(["a", "a"], ready)),
    ("touch no predicate", "is_ready must be a callable", lambda p: p.touch(["a"], True)),
    ("insert None", "key must be a hashable id, got None", lambda p: p.insert(None)),
    ("insert unhashable", "key must be a hashable id", lambda p: p.insert(["x"])),
    ("remove bool", "not a bool", lambda p: p.remove(True)),
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("what", "message", "call"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(name, what, message, call):
    policy = filled(name, "abc")
    before = policy.snapshot()
    with pytest.raises(InvalidArgumentError, match=message):
        call(policy)
    assert policy.snapshot() == before


@pytest.mark.parametrize(
    ("name", "capacity", "message"),
    [
        ("fifo", 4, "policy must be one of"),
        ("lru", 0, "capacity must be an int > 0, got 0"),
        ("arc", True, "capacity must be an int > 0, got True"),
    ],
)
def test_bad_constructor_arguments(name, capacity, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_cache_policy(name, capacity)


# ------------------------------------------------------------------------ LRU
def test_lru_touch_puts_the_first_key_last_and_moves_pending_keys_too():
    policy = filled("lru", "abcd")
    policy.touch(["c", "a", "zz"], lambda k: k != "a")
    assert policy.order() == ["b", "d", "a", "c"]
    assert policy.evict(3, anything) == ["b", "d", "a"]


def test_lru_skipped_keys_keep_their_place():
    policy = filled("lru", "abcd")
    assert policy.evict(2, lambda k: k not in "ac") == ["b", "d"]
    assert policy.order() == ["a", "c"]
    assert isinstance(policy, LRUPolicy) and policy.snapshot() == (("a", "c"),)


# ------------------------------------------------------------------------ ARC
def arc(capacity: int = 5) -> ARCPolicy:
    policy = make_cache_policy("arc", capacity)
    assert isinstance(policy, ARCPolicy)
    return policy


def test_arc_touch_promotes_ready_keys_and_keeps_pending_ones_recent():
    policy = arc()
    for k in "abcd":
        policy.insert(k)
    policy.touch(["c", "a", "b"], lambda k: k != "b")  # walked b, a, c
    assert (policy.t1, policy.t2) == (("d", "b"), ("a", "c"))
    policy.touch(["a"], ready)
    assert policy.t2 == ("c", "a") and policy.order() == ["d", "b", "c", "a"]


def test_arc_evicts_from_t1_while_it_is_at_target_and_remembers_ghosts():
    policy = arc()
    for k in "abc":
        policy.insert(k)
    policy.touch(["a"], ready)  # T1 b, c; T2 a; target 0
    assert policy.evict(2, anything) == ["b", "c"]
    assert (policy.t1, policy.t2, policy.b1, policy.b2) == ((), ("a",), ("b", "c"), ())
    assert policy.evict(1, anything) == ["a"]  # T1 empty: from T2
    assert policy.b2 == ("a",)
    policy.insert("b")  # a re-stored key leaves its ghost list
    assert (policy.t1, policy.b1) == (("b",), ("c",))


def test_arc_ghost_hits_move_the_target_within_bounds():
    policy = arc(capacity=3)
    for k in "abc":
        policy.insert(k)
    policy.touch(["c"], ready)
    assert policy.evict(3, anything) == ["a", "b", "c"]  # B1 a, b; B2 c
    policy.touch(["a"], ready)  # + max(1, 1/2)
    assert policy.target_t1_size == 1.0 and policy.b1 == ("b", "a")
    policy.touch(["b", "a"], ready)  # + 1 twice, capped at the capacity
    assert policy.target_t1_size == 3.0
    policy.touch(["c"], ready)  # - max(1, 2/1)
    assert policy.target_t1_size == 1.0
    policy.touch(["c"], ready)
    policy.touch(["c"], ready)  # floored at 0
    assert policy.target_t1_size == 0.0


def test_arc_switches_to_t2_once_t1_is_below_target_and_never_falls_back():
    policy = arc()
    for k in ("g1", "g2"):
        policy.insert(k)
    policy.evict(2, anything)
    policy.touch(["g1"], ready)
    policy.touch(["g2"], ready)
    assert policy.target_t1_size == 2.0
    for k in "xyvzw":
        policy.insert(k)
    policy.touch(["z", "w"], ready)
    assert (policy.t1, policy.t2) == (("x", "y", "v"), ("w", "z"))
    # T1 counts 3, then 2 (both >= 2), then 1 < 2: the third victim comes from T2.
    assert policy.evict(3, anything) == ["x", "y", "w"]
    assert (policy.b1, policy.b2) == (("g1", "g2", "x", "y"), ("w",))
    # T1 (v) is below target and T2's only key (z) is forbidden: vLLM's ARC refuses.
    before = policy.snapshot()
    assert policy.evict(1, lambda k: k != "z") is None
    assert policy.snapshot() == before


def test_arc_ghost_lists_are_bounded_by_the_capacity():
    policy = arc(capacity=2)
    for k in range(5):
        policy.insert(k)
        if len(policy) == 2:
            policy.evict(1, anything)
    assert policy.b1 == (2, 3) and policy.t1 == (4,)
