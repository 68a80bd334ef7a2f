"""The remote store on an in-process fake server: publication, sharing, claims, TTL, faults, bad input.

The fake (``fakeredis``) speaks the same protocol to the same client; the test
that two processes share blocks through a real server is in
``test_redis_store_server.py``.
"""

from __future__ import annotations

import pytest
from tierutil import NS, OTHER_NS, block_bytes, host, key, plan

from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.redis_health import RedisHealth
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore
from tiered_kv.tiers.store import LookupResult, StoreStats

fakeredis = pytest.importorskip("fakeredis")  # in the test extra; absent on bare GPU machines

OK, PRESENT, BUSY, MISSING, CORRUPT, ERROR = (
    BlockOutcome.OK,
    BlockOutcome.PRESENT,
    BlockOutcome.BUSY,
    BlockOutcome.MISSING,
    BlockOutcome.CORRUPT,
    BlockOutcome.ERROR,
)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server():
    return fakeredis.FakeServer()


def manager(server, ns=NS, seed=0, **kw):
    """One manager's view: a client, a store, a CPU tier and an I/O engine."""
    store = RedisStore(fakeredis.FakeRedis(server=server), ns, **kw)
    st = host(seed=seed)
    return store, st, RedisIO(st, store, batch_blocks=2)


def store_blocks(store, io, keys, host_ids, plan_id=1):
    out = store.prepare_store(list(keys))
    h = io.submit(plan(plan_id, "CPU", "REMOTE", host_ids, out.store_spec.block_ids))
    h.wait(10)
    store.complete_store(h.landed_keys(), True)
    store.complete_store(list(out.keys_to_store), False)
    return h


def load_blocks(store, io, keys, host_ids, plan_id=2):
    spec = store.prepare_load(list(keys))
    h = io.submit(plan(plan_id, "REMOTE", "CPU", spec.block_ids, host_ids))
    h.wait(10)
    store.complete_load(list(keys))
    store.forget(h.keys_with(MISSING, CORRUPT))
    return h


def test_a_block_stored_by_one_manager_is_found_and_loaded_by_another(server):
    a, a_host, a_io = manager(server, seed=1)
    b, b_host, b_io = manager(server, seed=2)
    keys = [key(i) for i in range(5)]
    h = store_blocks(a, a_io, keys, [1, 2, 3, 4, 5])
    assert h.ok and h.outcomes == [OK] * 5
    assert b.lookup_prefix([*keys, key(9)]) == 5 and b.remote_stats.learned == 5
    h = load_blocks(b, b_io, keys, [8, 7, 6, 5, 4])
    assert h.ok
    assert [block_bytes(b_host, 8 - i) for i in range(5)] == [block_bytes(a_host, 1 + i) for i in range(5)]
    assert b.stats == StoreStats(queries=6, hits=5, pending_hits=0, evictions=0)
    # b stores the same prefix again: every block is there already, nothing is sent.
    b_out = b.prepare_store(keys)
    assert b_out.keys_to_store == []  # b knows them (learned on lookup)
    c, _, c_io = manager(server, seed=3)
    h = store_blocks(c, c_io, keys, [1, 2, 3, 4, 5])
    assert h.ok and h.outcomes == [PRESENT] * 5 and c_io.stats.blocks_stored == 5
    for s in (a, b, c):
        s.check_invariants()


def test_a_claimed_block_is_busy_for_a_second_writer_and_nothing_is_sent_twice(server):
    a, _, a_io = manager(server, seed=1)
    b, _, b_io = manager(server, seed=2)
    raw = fakeredis.FakeRedis(server=server)
    raw.set(a.claim_key(key(1)), "someone", px=60_000)  # another writer is storing key 1 now
    h = store_blocks(a, a_io, [key(0), key(1)], [1, 2])
    assert h.outcomes == [OK, BUSY] and not h.ok
    assert a.is_ready(key(0)) and not a.contains(key(1))  # BUSY: not loadable here yet, nothing lost
    assert raw.get(a.data_key(key(1))) is None and raw.get(a.claim_key(key(0))) is None  # claims are released
    raw.delete(a.claim_key(key(1)))
    assert [store_blocks(s, io, [key(1)], [3]).outcomes for s, io in ((a, a_io), (b, b_io))] == [[OK], [PRESENT]]
    assert raw.get(a.data_key(key(1)))[44 + 32 :] == block_bytes(host(seed=1), 3)  # the first writer's bytes


def test_namespaces_never_see_each_other(server):
    a, _, a_io = manager(server)
    other, _, _ = manager(server, ns=OTHER_NS)
    store_blocks(a, a_io, [key(1)], [1])
    assert other.lookup(key(1)) is LookupResult.MISS
    raw = fakeredis.FakeRedis(server=server)
    raw.set(other.data_key(key(1)), raw.get(a.data_key(key(1))))  # a's block copied under the other prefix
    assert other.lookup(key(1)) is LookupResult.HIT  # the key exists there...
    _, o_host, _ = manager(server, ns=OTHER_NS)
    o_io = RedisIO(o_host, other)
    h = load_blocks(other, o_io, [key(1)], [4])
    assert h.outcomes == [CORRUPT] and not other.contains(key(1))  # ...but its header names a's namespace


def test_ttl_is_set_on_store_and_refreshed_on_load(server):
    a, _, a_io = manager(server, ttl_s=30)
    store_blocks(a, a_io, [key(1)], [1])
    raw = fakeredis.FakeRedis(server=server)
    assert 0 < raw.pttl(a.data_key(key(1))) <= 30_000
    raw.pexpire(a.data_key(key(1)), 5_000)
    load_blocks(a, a_io, [key(1)], [5])
    assert raw.pttl(a.data_key(key(1))) > 5_000
    b, _, _ = manager(server)
    assert raw.pttl(b.data_key(key(2))) == -2  # (absent) and no TTL is set by a store without one
    with pytest.raises(InvalidArgumentError, match="ttl_s must be a number of seconds"):
        manager(server, ttl_s=0)


def test_an_expired_block_is_forgotten_by_lookup_and_fails_a_load_cleanly(server):
    a, _, a_io = manager(server)
    store_blocks(a, a_io, [key(1), key(2)], [1, 2])
    raw = fakeredis.FakeRedis(server=server)
    raw.delete(a.data_key(key(2)))
    assert a.lookup_prefix([key(1), key(2)]) == 1 and not a.contains(key(2)) and a.remote_stats.stale == 1
    spec = a.prepare_load([key(1)])
    raw.delete(a.data_key(key(1)))  # expires while the load is queued
    h = a_io.submit(plan(7, "REMOTE", "CPU", spec.block_ids, [6]))
    h.wait(10)
    assert h.outcomes == [MISSING]
    a.complete_load([key(1)])
    assert a.forget([key(1)]) == [key(1)] and a.num_used == 0


def test_remove_deletes_on_the_server_and_index_eviction_does_not(server):
    a, _, a_io = manager(server, index_blocks=2)
    store_blocks(a, a_io, [key(1), key(2)], [1, 2])
    raw = fakeredis.FakeRedis(server=server)
    store_blocks(a, a_io, [key(3)], [3])  # the index forgets key 1 (least recent); the server keeps it
    assert not a.contains(key(1)) and raw.exists(a.data_key(key(1))) and a.stats.evictions == 1
    a.remove([key(2)])
    assert not raw.exists(a.data_key(key(2))) and a.lookup(key(2)) is LookupResult.MISS
    assert a.lookup(key(1)) is LookupResult.HIT  # learned again
    a.check_invariants()


def test_a_server_that_is_down_is_a_counted_miss_and_fails_io_without_losing_anything(server):
    clock = Clock()
    health = RedisHealth(backoff_s=1.0, max_backoff_s=4.0, clock=clock)
    a, a_host, a_io = manager(server, health=health)
    store_blocks(a, a_io, [key(1)], [1])
    before = block_bytes(a_host, 2)
    server.connected = False
    assert a.lookup(key(1)) is LookupResult.MISS and a.lookup_prefix([key(1)]) == 0  # second one: skipped
    s = a.remote_stats.health
    assert (s.errors, s.skipped, s.down) == (1, 1, True) and "ConnectionError" in s.last_error
    assert a.is_ready(key(1))  # the index is not changed by a failed call
    h = store_blocks(a, a_io, [key(2)], [2])
    assert h.outcomes == [ERROR] and not a.contains(key(2)) and block_bytes(a_host, 2) == before
    clock.t = 1.0  # the back-off is over, the server is still down: the next back-off is twice as long
    h = load_blocks(a, a_io, [key(1)], [6])
    assert h.outcomes == [ERROR] and a.is_ready(key(1)) and a.remote_stats.health.errors == 2
    clock.t = 2.5
    assert a.lookup(key(1)) is LookupResult.MISS and a.remote_stats.health.errors == 2  # still in back-off
    server.connected = True
    clock.t = 3.0
    assert a.lookup(key(1)) is LookupResult.HIT and not a.remote_stats.health.down
    assert load_blocks(a, a_io, [key(1)], [6]).ok
    a.check_invariants()


def test_a_foreign_value_under_a_block_key_is_never_loaded(server):
    a, a_host, a_io = manager(server)
    raw = fakeredis.FakeRedis(server=server)
    raw.set(a.data_key(key(1)), b"\x00" * 600)
    before = block_bytes(a_host, 3)
    assert a.lookup(key(1)) is LookupResult.HIT
    h = load_blocks(a, a_io, [key(1)], [3])
    assert h.outcomes == [CORRUPT] and block_bytes(a_host, 3) == before  # checked before a byte is copied


def test_bad_arguments_are_refused_and_change_nothing(server):
    a, _, a_io = manager(server)
    store_blocks(a, a_io, [key(1)], [1])
    before = (a.entries(), a.stats, a.free_block_ids())
    with pytest.raises(InvalidArgumentError, match=r"keys\[0\] = \('req', 3\) \(tuple\) cannot be stored"):
        a.prepare_store([("req", 3)])
    with pytest.raises(BlockStateError, match="it is not stored"):
        a.prepare_load([key(2)])
    assert (a.entries(), a.stats, a.free_block_ids()) == before
    assert a.lookup(("req", 3)) is LookupResult.MISS  # a private key is simply not there
    with pytest.raises(InvalidArgumentError, match="client must be a redis client"):
        RedisStore(object(), NS)
    with pytest.raises(InvalidArgumentError, match="index_blocks must be an int > 0"):
        RedisStore(fakeredis.FakeRedis(server=server), NS, index_blocks=0)
    with pytest.raises(InvalidArgumentError, match="max_backoff_s"):
        RedisHealth(backoff_s=2, max_backoff_s=1)
