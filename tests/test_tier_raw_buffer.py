"""The disk and Redis I/O engines staging through a raw buffer of chunk bytes (a memoryview or a CPU tensor).

A host that owns its CPU memory (vLLM's CPU offloading tier) hands the tiers
rows of opaque bytes and a :class:`ChunkGeometry` instead of a ``KVStorage`` and
a ``KVSpec``.  The stores' promises must hold on that path too: exact bytes back,
atomic checksummed files, torn files ignored at restart, a Redis that is down is
a counted miss and never a hang.
"""

from __future__ import annotations

import errno
import time

import pytest
import torch
from tierutil import RedisServer, free_port, key, plan

from tiered_kv.errors import InvalidArgumentError, StorageError
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.namespace import ChunkGeometry, KVNamespace
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore, connect
from tiered_kv.tiers.store import LookupResult
from tiered_kv.transfer.plan import TransferStatus

CHUNK = 640  # not a KVSpec's block size: the geometry is opaque
GEOM = ChunkGeometry(CHUNK, "test-layout/v1")
NS = KVNamespace("tiny-llama", GEOM, "sha256/v1")
CAP = 16 * 4096
OK, NO_SPACE, ERROR, CORRUPT, MISSING = (
    BlockOutcome.OK,
    BlockOutcome.NO_SPACE,
    BlockOutcome.ERROR,
    BlockOutcome.CORRUPT,
    BlockOutcome.MISSING,
)


def region(rows: int = 6, seed: int = 0) -> memoryview:
    """A two-dimensional writable memoryview of random bytes, shaped as vLLM's primary view is."""
    data = torch.randint(0, 256, (rows, CHUNK), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return memoryview(data.numpy())


def rows_bytes(view: memoryview, rows) -> list[bytes]:
    flat = view.cast("B")
    return [bytes(flat[r * CHUNK : (r + 1) * CHUNK]) for r in rows]


def store_rows(store, io, keys, rows, plan_id=1, medium="DISK"):
    out = store.prepare_store(list(keys))
    h = io.submit(plan(plan_id, "CPU", medium, [ChunkBuffer.slot(r) for r in rows], out.store_spec.block_ids))
    h.wait(10)
    assert h.done()
    store.complete_store(h.landed_keys(), True)
    store.complete_store([k for k in out.keys_to_store if k not in set(h.landed_keys())], False)
    return h


def load_rows(store, io, keys, rows, plan_id=2, medium="DISK"):
    spec = store.prepare_load(list(keys))
    h = io.submit(plan(plan_id, medium, "CPU", spec.block_ids, [ChunkBuffer.slot(r) for r in rows]))
    h.wait(10)
    assert h.done()
    store.complete_load(list(keys))
    return h


def test_namespace_of_a_chunk_geometry_is_its_own_and_keeps_the_kvspec_digest():
    assert NS.block_bytes == CHUNK
    assert NS.text == "model=tiny-llama;chunk_bytes=640;layout=test-layout/v1;hash=sha256/v1"
    assert KVNamespace("tiny-llama", ChunkGeometry(CHUNK, "other-layout"), "sha256/v1").digest != NS.digest
    with pytest.raises(InvalidArgumentError):
        ChunkGeometry(0, "x")
    with pytest.raises(InvalidArgumentError):
        ChunkGeometry(CHUNK, "")


@pytest.mark.parametrize("kind", ["memoryview", "tensor"])
def test_disk_round_trip_through_a_raw_buffer_is_byte_identical(tmp_path, kind):
    src = region(seed=1)
    keys = [key(i) for i in range(4)]
    expected = rows_bytes(src, [0, 1, 2, 5])
    with DiskStore(tmp_path, NS, CAP) as store:
        with DiskIO(src, store, batch_blocks=3) as io:
            h = store_rows(store, io, keys, [0, 1, 2, 5])
            assert (h.status, h.outcomes) == (TransferStatus.DONE, [OK] * 4)
        files = sorted(p.name for p in store.directory.rglob("*") if p.is_file() and p.name != ".lock")
        assert files == sorted(k.hex() + ".kv" for k in keys)  # no temporary file is left
        dst_t = torch.zeros((6, CHUNK), dtype=torch.uint8)
        dst = memoryview(dst_t.numpy()) if kind == "memoryview" else dst_t
        with DiskIO(dst, store) as io:
            h = load_rows(store, io, keys, [3, 2, 1, 0])
        assert (h.status, h.outcomes) == (TransferStatus.DONE, [OK] * 4)
        assert rows_bytes(memoryview(dst_t.numpy()), [3, 2, 1, 0]) == expected
        assert rows_bytes(memoryview(dst_t.numpy()), [4, 5]) == [bytes(CHUNK)] * 2  # nothing else was written


def test_a_full_disk_leaves_no_file_and_keeps_the_buffer(tmp_path):
    src = region(seed=2)
    before = rows_bytes(src, range(6))

    def full(op, k):
        if op == "store" and k == key(1):
            raise OSError(errno.ENOSPC, "No space left on device")

    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store, fault_hook=full) as io:
        h = store_rows(store, io, [key(0), key(1)], [0, 1])
        assert (h.status, h.outcomes) == (TransferStatus.FAILED, [OK, NO_SPACE])
        assert store.lookup(key(1)) is LookupResult.MISS
        assert not store.path_of(key(1)).exists()
        assert not [p for p in store.directory.rglob("*.tmp")]
    assert rows_bytes(src, range(6)) == before


def test_a_corrupt_file_is_reported_and_forgotten_and_a_torn_file_is_ignored_at_restart(tmp_path):
    src = region(seed=3)
    with DiskStore(tmp_path, NS, CAP) as store:
        with DiskIO(src, store) as io:
            store_rows(store, io, [key(0), key(1), key(2)], [0, 1, 2])
        path = store.path_of(key(1))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # bit rot in the payload: the header still checks, the CRC does not
        path.write_bytes(bytes(raw))
        dst = region(rows=3, seed=9)
        with DiskIO(dst, store) as io:
            h = load_rows(store, io, [key(0), key(1)], [0, 1])
        assert h.outcomes == [OK, CORRUPT]
        assert store.forget(h.keys_with(CORRUPT)) == [key(1)]
        assert store.lookup(key(1)) is LookupResult.MISS
        torn = store.path_of(key(2))
        torn.write_bytes(torn.read_bytes()[:-100])  # a write cut short (outside the atomic rename)
    with DiskStore(tmp_path, NS, CAP) as again:
        assert again.disk_stats.recovered == 1
        assert again.disk_stats.invalid_files == 1
        assert [again.lookup(k) for k in (key(0), key(1), key(2))] == [
            LookupResult.HIT,
            LookupResult.MISS,
            LookupResult.MISS,
        ]


def test_bad_buffers_are_refused_and_nothing_is_built(tmp_path):
    with DiskStore(tmp_path, NS, CAP) as store:
        with pytest.raises(StorageError, match="read-only"):
            DiskIO(memoryview(bytes(6 * CHUNK)).cast("B", (6, CHUNK)), store)
        with pytest.raises(StorageError, match="640"):
            DiskIO(memoryview(bytearray(6 * 512)).cast("B", (6, 512)), store)
        with pytest.raises(StorageError, match="needs chunk_bytes"):
            ChunkBuffer(memoryview(bytearray(CHUNK)))
        with pytest.raises(StorageError, match="whole number"):
            ChunkBuffer(bytearray(CHUNK + 1), chunk_bytes=CHUNK)
        with pytest.raises(StorageError, match="C-contiguous"):
            ChunkBuffer(memoryview(torch.zeros((4, CHUNK), dtype=torch.uint8).numpy())[::2])
        with pytest.raises(StorageError, match="memoryview or a CPU tensor"):
            ChunkBuffer(42)
        assert (store.num_used, store.num_pending) == (0, 0)
    buf = ChunkBuffer(bytearray(3 * CHUNK), chunk_bytes=CHUNK)
    assert (buf.num_chunks, buf.num_blocks, buf.block_bytes) == (3, 4, CHUNK)
    with pytest.raises(InvalidArgumentError):
        buf.row(3)


def test_redis_round_trip_through_a_raw_buffer(tmp_path):
    server = RedisServer()
    try:
        src = region(seed=4)
        keys = [key(i) for i in range(3)]
        store = RedisStore(connect(server.url, timeout_s=2.0), NS)
        with RedisIO(src, store, batch_blocks=2) as io:
            h = store_rows(store, io, keys, [4, 0, 2], medium="REMOTE")
        assert h.outcomes == [OK] * 3
        other = RedisStore(connect(server.url, timeout_s=2.0), NS)  # another manager learns them from the server
        assert other.lookup_prefix(keys) == 3
        dst_t = torch.zeros((3, CHUNK), dtype=torch.uint8)
        with RedisIO(dst_t, other) as io:
            h = load_rows(other, io, keys, [0, 1, 2], medium="REMOTE")
        assert h.outcomes == [OK] * 3
        assert rows_bytes(memoryview(dst_t.numpy()), [0, 1, 2]) == rows_bytes(src, [4, 0, 2])
    finally:
        server.stop()


def test_a_redis_that_is_down_is_a_counted_miss_and_a_failed_load_within_the_timeout():
    store = RedisStore(connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2), NS)
    dst = region(rows=2, seed=5)
    before = rows_bytes(dst, [0, 1])
    started = time.monotonic()
    assert store.lookup(key(0)) is LookupResult.MISS
    assert store.lookup_prefix([key(0), key(1)]) == 0
    assert store.remote_stats.health.errors >= 1
    out = store.prepare_store([key(0)])
    with RedisIO(region(rows=2, seed=6), store) as io:
        h = io.submit(plan(1, "CPU", "REMOTE", [1], out.store_spec.block_ids))
        h.wait(5)
        assert h.done()
    assert h.outcomes == [ERROR]
    store.complete_store([key(0)], False)
    assert time.monotonic() - started < 5  # bounded by the socket timeout and the breaker, never a hang
    assert store.lookup(key(0)) is LookupResult.MISS
    assert rows_bytes(dst, [0, 1]) == before
    assert (store.num_used, store.num_pending) == (0, 0)
