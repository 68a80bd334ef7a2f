"""The disk tier's I/O: exact bytes in both layouts, per-block faults that lose nothing, plan checks, cancel."""

from __future__ import annotations

import errno
import threading

import pytest
from tierutil import NS, block_bytes, host, key, plan

from tiered_kv.errors import PlanError, StorageError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.transfer.plan import TransferStatus

OK, NO_SPACE, ERROR, CORRUPT, MISSING = (
    BlockOutcome.OK,
    BlockOutcome.NO_SPACE,
    BlockOutcome.ERROR,
    BlockOutcome.CORRUPT,
    BlockOutcome.MISSING,
)
CAP = 16 * 4096


def all_files(store: DiskStore) -> list[str]:
    return sorted(p.name for p in store.directory.rglob("*") if p.is_file() and p.name != ".lock")


def store_blocks(store: DiskStore, io: DiskIO, keys, host_ids, plan_id=1):
    out = store.prepare_store(list(keys))
    h = io.submit(plan(plan_id, "CPU", "DISK", host_ids, out.store_spec.block_ids))
    h.wait(10)
    store.complete_store(h.landed_keys(), True)
    store.complete_store(list(out.keys_to_store), False)
    return h


def load_blocks(store: DiskStore, io: DiskIO, keys, host_ids, plan_id=2):
    spec = store.prepare_load(list(keys))
    h = io.submit(plan(plan_id, "DISK", "CPU", spec.block_ids, host_ids))
    h.wait(10)
    store.complete_load(list(keys))
    return h


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
@pytest.mark.parametrize("fsync", ["none", "data", "full"])
def test_blocks_come_back_byte_for_byte_in_either_layout(tmp_path, layout, fsync):
    src = host(layout=layout, seed=1)
    keys = [key(i) for i in range(6)]
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store, fsync=fsync, batch_blocks=4) as io:
        h = store_blocks(store, io, keys, [1, 2, 3, 6, 7, 8])
        assert (h.status, h.outcomes) == (TransferStatus.DONE, [OK] * 6)
        assert all_files(store) == sorted(k.hex() + ".kv" for k in keys)  # no temporary file is left
        payload = store.path_of(keys[3]).read_bytes()[44 + 32 :]
        assert payload == block_bytes(src, 6)  # files hold the canonical order, whatever the layout
        dst = host(layout="layer_first" if layout == "block_contiguous" else "block_contiguous", seed=2)
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(dst, store) as io:
        h = load_blocks(store, io, keys[::-1], [8, 7, 6, 5, 4, 3])
        assert h.ok and h.keys == tuple(keys[::-1])
        for k, s in zip(range(6), [1, 2, 3, 6, 7, 8], strict=True):
            assert block_bytes(dst, 3 + k) == block_bytes(src, s)  # key k went to slot 3 + k
        stats = io.stats
        assert (stats.blocks_loaded, stats.bytes_loaded, stats.outcomes) == (6, 6 * 512, {"ok": 6})
        store.check_invariants()


def fault_on(victim, op_name: str, err: int):
    def hook(op, k):
        if op == op_name and k == victim:
            raise OSError(err, f"injected {errno.errorcode[err]}")

    return hook


@pytest.mark.parametrize("err,outcome", [(errno.ENOSPC, NO_SPACE), (errno.EDQUOT, NO_SPACE), (errno.EACCES, ERROR)])
def test_a_store_that_fails_midway_fails_that_block_only_and_leaves_no_file(tmp_path, err, outcome):
    src = host()
    keys = [key(i) for i in range(3)]
    before = block_bytes(src, 2)
    cpu = CPUStore(9)
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store, fault_hook=fault_on(key(1), "store", err)) as io:
        h = store_blocks(store, io, keys, [1, 2, 3])
        assert h.status is TransferStatus.FAILED and h.outcomes == [OK, outcome, OK]
        assert "1 of 3 blocks failed" in str(h.error)
        assert all_files(store) == sorted([key(0).hex() + ".kv", key(2).hex() + ".kv"])  # the temp file is gone
        assert [e.key for e in store.entries()] == [key(0), key(2)] and store.num_pending == 0
        assert block_bytes(src, 2) == before and cpu.num_used == 0  # the CPU copy is untouched: nothing lost
        h = store_blocks(store, DiskIO(src, store), [key(1)], [2], plan_id=3)  # and the store can be retried
        assert h.ok and store.is_ready(key(1))


def test_a_corrupt_file_is_never_loaded_and_is_forgotten(tmp_path):
    src, dst = host(seed=1), host(seed=2)
    keys = [key(i) for i in range(3)]
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store) as io:
        store_blocks(store, io, keys, [1, 2, 3])
        path = store.path_of(key(1))
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x40  # one flipped bit in the payload
        path.write_bytes(bytes(data))
        store.path_of(key(2)).write_bytes(store.path_of(key(0)).read_bytes())  # a whole block, wrong key
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(dst, store) as io:
        assert store.num_used == 2  # the renamed file fails the header check at start-up
        store.path_of(key(0)).unlink()  # vanishes underneath the store
        spec = store.prepare_load([key(0), key(1)])
        h = io.submit(plan(5, "DISK", "CPU", spec.block_ids, [4, 5]))
        assert not h.wait(10) and h.outcomes == [MISSING, CORRUPT]
        assert h.keys_with(MISSING, CORRUPT) == [key(0), key(1)] and h.landed_keys() == []
        assert store.forget([key(0), key(1)]) == []  # still pinned: dropped when the load completes
        store.complete_load([key(0), key(1)])
        assert store.num_used == 0 and not store.path_of(key(1)).exists()
        assert io.stats.outcomes == {"missing": 1, "corrupt": 1}
        store.check_invariants()


def test_a_block_truncated_after_the_scan_is_caught_at_load(tmp_path):
    src = host()
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store) as io:
        store_blocks(store, io, [key(1)], [1])
        path = store.path_of(key(1))
        path.write_bytes(path.read_bytes()[:200])
        h = load_blocks(store, io, [key(1)], [5])
        assert h.outcomes == [CORRUPT]


def test_plans_are_checked_before_anything_is_queued(tmp_path):
    src = host()
    with DiskStore(tmp_path, NS, CAP) as store, DiskIO(src, store) as io:
        store_blocks(store, io, [key(1)], [1])
        out = store.prepare_store([key(2)])
        slot_ready, slot_pending = store.prepare_load([key(1)]).block_ids[0], out.store_spec.block_ids[0]
        cases = [
            (plan(9, "CPU", "GPU", [1], [1]), "moves CPU <-> DISK, not CPU -> GPU"),
            (plan(9, "CPU", "DISK", [1], [slot_ready]), "is not pending"),
            (plan(9, "DISK", "CPU", [slot_pending], [1]), "is not ready"),
            (plan(9, "CPU", "DISK", [1], [7]), "slot 7 of the DISK store holds no entry"),
            (plan(9, "CPU", "DISK", [99], [slot_pending]), "out of range"),
            (plan(9, "DISK", "CPU", [slot_ready], [0]), "null block"),
        ]
        for bad, match in cases:
            with pytest.raises(PlanError, match=match):
                io.submit(bad)
        with pytest.raises(PlanError, match="takes a TransferPlan"):
            io.submit("plan")  # type: ignore[arg-type]
        assert io.num_in_flight == 0 and io.stats.outcomes == {"ok": 1}


def test_an_engine_needs_a_cpu_tier_of_the_store_geometry(tmp_path):
    with DiskStore(tmp_path, NS, CAP) as store:
        other = KVStorage(KVSpec(2, 2, 8, "float16", 8), 4, "CPU", device="cpu", pin=False)
        with pytest.raises(StorageError, match="is not the disk store's"):
            DiskIO(other, store)
        with pytest.raises(Exception, match="fsync must be one of"):
            DiskIO(host(), store, fsync="always")


def test_cancel_stops_the_batches_that_have_not_started_and_keeps_what_landed(tmp_path):
    gate, entered = threading.Event(), threading.Event()

    def hook(op, k):
        if k == key(0):
            entered.set()
            assert gate.wait(10)

    src = host()
    keys = [key(i) for i in range(4)]
    with (
        DiskStore(tmp_path, NS, CAP) as store,
        DiskIO(src, store, store_workers=1, batch_blocks=2, fault_hook=hook) as io,
    ):
        out = store.prepare_store(keys)
        h = io.submit(plan(1, "CPU", "DISK", [1, 2, 3, 4], out.store_spec.block_ids))
        assert entered.wait(10)  # the first batch is running, the second is queued
        assert io.cancel(h) is True
        gate.set()
        h.wait(10)
        cancelled = BlockOutcome.CANCELLED
        assert h.status is TransferStatus.CANCELLED and h.outcomes == [OK, OK, cancelled, cancelled]
        assert io.cancel(h) is False  # final already
        store.complete_store(h.landed_keys())
        store.complete_store(keys, success=False)
        assert [e.key for e in store.entries()] == keys[:2] and all_files(store) == sorted(
            k.hex() + ".kv" for k in keys[:2]
        )
        store.check_invariants()
