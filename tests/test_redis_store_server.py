"""The remote tier against a real ``redis-server`` on a localhost port.

Two managers in two processes share a prefix; two writers racing on one prefix
store each block exactly once; a server that dies in the middle of a store or a
load, or stops answering, costs a counted miss and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tierutil import NS, RedisServer, block_bytes, host, key, need_redis_server, plan

from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.redis_health import RedisHealth
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore, connect
from tiered_kv.tiers.store import LookupResult

PEER = os.path.join(os.path.dirname(__file__), "redis_peer.py")
OK, PRESENT, BUSY, ERROR = BlockOutcome.OK, BlockOutcome.PRESENT, BlockOutcome.BUSY, BlockOutcome.ERROR


@pytest.fixture
def server():
    need_redis_server()
    srv = RedisServer()
    yield srv
    srv.stop()


def peer(url: str, mode: str, seed: int, n: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, PEER, url, mode, str(seed), str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_prefix_computed_in_one_process_is_loaded_by_another(server):
    a = result(peer(server.url, "store", seed=11, n=12))
    assert a["outcomes"] == ["ok"] * 12
    b = result(peer(server.url, "load", seed=22, n=12))  # its own CPU tier starts with other bytes
    assert b["outcomes"] == ["ok"] * 12
    assert b["digests"] == a["digests"] and a["pid"] != b["pid"]


def test_two_processes_racing_on_one_prefix_store_each_block_once_and_never_tear(server):
    n = 24
    procs = [peer(server.url, "race", seed=s, n=n) for s in (1, 2)]
    client = connect(server.url, timeout_s=2.0)
    deadline = time.monotonic() + 60
    while len(client.client_list()) < 3 and time.monotonic() < deadline:  # both peers wait on BLPOP
        time.sleep(0.05)
    client.rpush("go", 1, 1)
    a, b = (result(p) for p in procs)
    for i in range(n):
        pair = sorted([a["outcomes"][i], b["outcomes"][i]])
        # Exactly one writer sent the block; the other found it claimed or already there.
        assert pair in (["busy", "ok"], ["ok", "present"]), (i, pair)
    # What is on the server is, per block, one writer's whole block.
    c = result(peer(server.url, "load", seed=3, n=n))
    for i in range(n):
        writer = a if a["outcomes"][i] == "ok" else b
        assert c["digests"][i] == writer["digests"][i]


def kill_at(server: RedisServer, victim):
    def hook(op, k):
        if k == victim:
            server.stop()

    return hook


def test_the_server_dying_mid_store_fails_the_rest_and_loses_nothing(server):
    st = host(seed=5)
    before = [block_bytes(st, i) for i in range(1, 7)]
    store = RedisStore(connect(server.url, timeout_s=0.5), NS, health=RedisHealth(backoff_s=30, max_backoff_s=30))
    keys = [key(i) for i in range(6)]
    with RedisIO(st, store, store_workers=1, batch_blocks=2, fault_hook=kill_at(server, key(2))) as io:
        out = store.prepare_store(keys)
        h = io.submit(plan(1, "CPU", "REMOTE", range(1, 7), out.store_spec.block_ids))
        assert not h.wait(30)
    assert h.outcomes == [OK, OK, ERROR, ERROR, ERROR, ERROR]
    store.complete_store(h.landed_keys())
    store.complete_store(keys, success=False)
    assert [e.key for e in store.entries()] == keys[:2] and store.num_pending == 0
    assert [block_bytes(st, i) for i in range(1, 7)] == before  # every block is still in the CPU tier
    health = store.remote_stats.health
    assert health.errors == 1 and health.skipped == 1 and health.down  # the third batch did not wait
    assert store.lookup_prefix(keys) == 0  # down: a miss, counted
    store.check_invariants()


def test_the_server_dying_mid_load_fails_the_rest_cleanly(server):
    st = host(seed=5)
    store = RedisStore(connect(server.url, timeout_s=0.5), NS, health=RedisHealth(backoff_s=30, max_backoff_s=30))
    keys = [key(i) for i in range(6)]
    with RedisIO(st, store, batch_blocks=2) as io:
        out = store.prepare_store(keys)
        assert io.submit(plan(1, "CPU", "REMOTE", range(1, 7), out.store_spec.block_ids)).wait(30)
    store.complete_store(keys)
    dst = host(seed=6)
    before = [block_bytes(dst, i) for i in range(1, 7)]
    with RedisIO(dst, store, load_workers=1, batch_blocks=2, fault_hook=kill_at(server, key(4))) as io:
        spec = store.prepare_load(keys)
        h = io.submit(plan(2, "REMOTE", "CPU", spec.block_ids, range(1, 7)))
        assert not h.wait(30)
    assert h.outcomes == [OK, OK, OK, OK, ERROR, ERROR]
    store.complete_load(keys)
    assert [block_bytes(dst, i) for i in (1, 2, 3, 4)] == [block_bytes(st, i) for i in (1, 2, 3, 4)]
    assert [block_bytes(dst, i) for i in (5, 6)] == before[4:]  # the failed slots were not written
    assert store.num_pinned == 0 and store.num_used == 6  # the index keeps them: the server may come back
    store.check_invariants()


def test_a_server_that_stops_answering_times_out_into_a_miss(server):
    st = host()
    store = RedisStore(connect(server.url, timeout_s=0.2), NS, health=RedisHealth(backoff_s=30, max_backoff_s=30))
    with RedisIO(st, store) as io:
        out = store.prepare_store([key(1)])
        assert io.submit(plan(1, "CPU", "REMOTE", [1], out.store_spec.block_ids)).wait(30)
    store.complete_store([key(1)])
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        assert store.lookup(key(1)) is LookupResult.MISS
        health = store.remote_stats.health
        assert health.errors == 1 and "Timeout" in health.last_error
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert store.is_ready(key(1))  # nothing was forgotten because of a timeout
