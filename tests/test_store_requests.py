"""Request scope of the CPU store: hooks called out of order are typed errors that change nothing."""

from __future__ import annotations

import pytest

from tiered_kv.errors import BlockStateError, InvalidArgumentError, RequestStateError, TieredKVError
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.policies import CACHE_POLICIES

B = 16


def snapshot(store: CPUStore) -> tuple:
    return (
        store.entries(),
        store.free_block_ids(),
        (store.num_used, store.num_pinned, store.num_pending, store.num_evictable),
        store.stats,
        store.policy.snapshot(),
        store.open_requests(),
        store.take_events(),  # drained by the first snapshot, so a refused call must queue nothing
    )


def populated(policy: str) -> tuple[CPUStore, RequestContext]:
    """A ready, a loaded b, a pending c of open request A; request B finished."""
    store = CPUStore(6, policy, enable_events=True)
    done = RequestContext("B")
    store.on_new_request(done)
    done.set_positions(["x"], B, B)
    store.prepare_store(["x"], done)
    store.complete_store(["x"], True, done)
    store.on_request_finished(done)
    a = RequestContext("A")
    a.set_positions(["a", "b", "c"], B, B)
    store.on_new_request(a)
    store.prepare_store(["a", "b"], a)
    store.complete_store(["a", "b"], True, a)
    store.prepare_load(["b"], a)
    store.prepare_store(["c"], a)
    store.take_events()
    return store, a


CASES = [
    ("finished before new", RequestStateError, "not open", lambda s, a: s.on_request_finished(RequestContext("N"))),
    (
        "finished twice",
        RequestStateError,
        "not open",
        lambda s, a: (s.on_request_finished(a), s.on_request_finished(a)),
    ),
    ("new twice", RequestStateError, "already open", lambda s, a: s.on_new_request(RequestContext("A"))),
    ("store before new", RequestStateError, "not open", lambda s, a: s.prepare_store(["y"], RequestContext("N"))),
    ("load before new", RequestStateError, "not open", lambda s, a: s.prepare_load(["a"], RequestContext("N"))),
    ("touch before new", RequestStateError, "not open", lambda s, a: s.touch(["a"], RequestContext("N"))),
    (
        "a second context under an open id",
        RequestStateError,
        "not open",
        lambda s, a: s.prepare_store(["y"], RequestContext("A")),
    ),
    ("store after finish", RequestStateError, "not open", lambda s, a: s.prepare_store(["y"], RequestContext("B"))),
    (
        "complete a store never prepared",
        BlockStateError,
        r"key 'zz' \(str\) \(keys\[1\]\).*never prepared it",
        lambda s, a: s.complete_store(["c", "zz"], True, a),
    ),
    ("not a context", InvalidArgumentError, "req must be", lambda s, a: s.prepare_store(["y"], "A")),
    ("hook with a str", InvalidArgumentError, "req must be", lambda s, a: s.on_new_request("A")),
    ("schedule end not ids", InvalidArgumentError, "new_req_ids", lambda s, a: s.on_schedule_end("AB")),
    (
        "schedule end unhashable",
        InvalidArgumentError,
        r"preempted_req_ids\[0\]",
        lambda s, a: s.on_schedule_end((), [[1]]),
    ),
    # A list of ids takes a one-pass set() check; a bad id after good ones is still named.
    (
        "schedule end None id",
        InvalidArgumentError,
        r"new_req_ids\[1\].*None",
        lambda s, a: s.on_schedule_end(["A", None]),
    ),
    (
        "schedule end unhashable after a good id",
        InvalidArgumentError,
        r"preempted_req_ids\[1\]",
        lambda s, a: s.on_schedule_end(("A",), ["A", {}]),
    ),
    ("reset with copies in flight", BlockStateError, "in flight", lambda s, a: s.reset_cache()),
]


@pytest.mark.parametrize("policy", sorted(CACHE_POLICIES))
@pytest.mark.parametrize(("what", "error", "message", "call"), CASES, ids=[c[0] for c in CASES])
def test_out_of_order_hooks_raise_and_change_nothing(policy, what, error, message, call):
    store, a = populated(policy)
    before = snapshot(store)
    if what == "finished twice":
        store.on_request_finished(a)  # the first finish is fine
        before = snapshot(store)
        with pytest.raises(error, match=message):
            store.on_request_finished(a)
    else:
        with pytest.raises(error, match=message):
            call(store, a)
    assert issubclass(error, TieredKVError)
    assert snapshot(store) == before
    store.check_invariants()


@pytest.mark.parametrize("policy", sorted(CACHE_POLICIES))
def test_a_key_offered_while_resident_may_be_completed_after_its_eviction_and_a_loaded_one_may_not(policy):
    store = CPUStore(3, policy, enable_events=True)
    b = RequestContext("B")
    b.set_positions(["x", "w"], B, B)
    store.on_new_request(b)
    store.prepare_store(["x", "w"], b)
    store.complete_store(["x", "w"], True, b)
    store.on_request_finished(b)
    a = RequestContext("A")
    a.set_positions(["x", "w"], B, B)
    store.on_new_request(a)
    assert store.prepare_store(["x"], a).keys_to_store == []  # offered while ready: nothing to store
    store.prepare_load(["w"], a)
    store.complete_load(["w"], a)
    c = RequestContext("C")
    c.set_positions(["p", "q"], B, B)
    store.on_new_request(c)
    assert sorted(store.prepare_store(["p", "q"], c).evicted_keys) == ["w", "x"]
    store.take_events()
    before = snapshot(store)
    store.complete_store(["x"], True, a)  # offered by A, now absent: ignored, as vLLM ignores it
    assert snapshot(store) == before
    with pytest.raises(BlockStateError, match=r"key 'w' \(str\) \(keys\[0\]\).*request 'A' never prepared it"):
        store.complete_store(["w"], True, a)  # A only loaded it
    assert snapshot(store) == before
    store.check_invariants()


def test_a_key_position_cannot_move_back_and_the_context_keeps_what_it_had():
    ctx = RequestContext("A")
    ctx.set_positions(["a", "b"], B, B)
    with pytest.raises(RequestStateError, match=r"key 'b' \(str\) already ends at token 32, cannot move it to 16"):
        ctx.set_position("b", B)
    with pytest.raises(RequestStateError, match=r"key 'a' \(str\) \(keys\[1\]\) already ends at token 16"):
        ctx.set_positions(["z", "a"], 2 * B, B)  # all or nothing: z is not recorded either
    assert (ctx.position("a"), ctx.position("b"), ctx.position("z")) == (B, 2 * B, None)
    ctx.set_position("a", B)  # the same position again is no move
    for bad, message in [((None, 16), "key must be"), (("c", 0), "end_token"), (("c", True), "end_token")]:
        with pytest.raises(InvalidArgumentError, match=message):
            ctx.set_position(*bad)
    assert ctx.position("c") is None


@pytest.mark.parametrize("policy", sorted(CACHE_POLICIES))
def test_copies_of_a_finished_request_still_complete(policy):
    store, a = populated(policy)
    store.on_request_finished(a)
    store.complete_load(["b"], a)
    store.complete_store(["c", "zz"], True, a)  # after the finish nothing is checked against the request: ignored
    assert [(e.key, e.ready, e.ref_cnt) for e in sorted(store.entries(), key=lambda e: e.key)] == [
        ("a", True, 0),
        ("b", True, 0),
        ("c", True, 0),
        ("x", True, 0),
    ]
    assert store.open_requests() == []


def test_reset_drops_every_entry_and_keeps_requests_open_with_nothing_observed():
    store = CPUStore(4, "arc", enable_events=True)
    a = RequestContext("A")
    store.on_new_request(a)
    store.prepare_store(["a", "b"], a)
    store.complete_store(["a", "b"], True, a)
    store.reset_cache()
    assert (store.entries(), store.free_block_ids(), store.open_requests()) == ([], [1, 2, 3], ["A"])
    assert store.policy.snapshot() == ((), (), (), (), 0.0)
    store.prepare_store(["a"], a)  # a is a fresh insertion of A now, not a reuse
    store.complete_store(["a"], True, a)
    store.on_request_finished(a)
    assert (store.policy.t1, store.policy.t2) == (("a",), ())


def test_get_stats_reports_vllms_gauges_and_clears_the_allocation_sizes():
    store, _ = populated("lru")  # capacity 5: a ready, b pinned, c pending, x ready
    s = store.get_stats()
    assert (s.usage, s.write_usage, s.read_usage) == (2 / 5, 1 / 5, pytest.approx(1 / 5))
    assert s.allocation_sizes == (1, 2, 1)
    assert store.get_stats().allocation_sizes == ()


@pytest.mark.parametrize("req_id", [["r"], {"r": 1}, {"r"}])
def test_a_request_context_with_an_unhashable_id_is_refused_by_name(req_id):
    with pytest.raises(InvalidArgumentError, match=r"req_id must be a hashable id, got"):
        RequestContext(req_id)
