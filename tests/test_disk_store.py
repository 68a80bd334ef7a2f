"""The disk store's bookkeeping: capacity in bytes, files follow entries, restart by scanning, bad input."""

from __future__ import annotations

import os

import pytest
from tierutil import NS, OTHER_NS, SPEC, host, key, plan

from tiered_kv.errors import BlockStateError, InvalidArgumentError, StorageError
from tiered_kv.tiers.block_format import MAX_HEADER_BYTES, BlockHeader
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.store import LookupResult, StoreEvent

SLOT = 4096  # a 512-byte block plus the largest header, rounded up to the allocation unit


def snapshot(store: DiskStore) -> tuple:
    files = sorted(p.name for p in store.directory.rglob("*") if p.is_file())
    return (
        store.entries(),
        store.free_block_ids(),
        (store.num_used, store.num_pending, store.num_pinned, store.num_evictable),
        store.stats,
        store.disk_stats,
        files,
    )


def files(store: DiskStore) -> set:
    return {p.name for p in store.directory.rglob("*.kv")}


def fill(store: DiskStore, keys, host_ids=None, plan_id=1) -> None:
    """Store ``keys`` for real (bytes from the CPU tier's blocks 1, 2, ...)."""
    st = host()
    with DiskIO(st, store) as io:
        out = store.prepare_store(list(keys))
        assert out is not None
        ids = host_ids or range(1, 1 + len(out.keys_to_store))
        h = io.submit(plan(plan_id, "CPU", "DISK", ids, out.store_spec.block_ids))
        assert h.wait(10)
    store.complete_store(h.landed_keys())


def test_capacity_in_bytes_counts_whole_allocation_units_per_block(tmp_path):
    assert SPEC.bytes_per_block + MAX_HEADER_BYTES <= SLOT
    with DiskStore(tmp_path, NS, 3 * SLOT + SLOT - 1) as store:
        assert (store.slot_bytes, store.capacity, store.capacity_bytes) == (SLOT, 3, 3 * SLOT)
        assert store.directory == tmp_path / NS.dirname and store.medium == "DISK"
    with pytest.raises(InvalidArgumentError, match=r"capacity_bytes must hold at least one block file \(4096 bytes\)"):
        DiskStore(tmp_path, NS, SLOT - 1)


def test_files_follow_entries_eviction_and_remove_delete_them(tmp_path):
    with DiskStore(tmp_path, NS, 3 * SLOT, enable_events=True) as store:
        fill(store, [key(1), key(2), key(3)])
        assert files(store) == {key(i).hex() + ".kv" for i in (1, 2, 3)}
        assert store.path_of(key(2)).is_file() and store.path_of(key(2)).parent.parent == store.directory
        store.touch([key(1)])
        out = store.prepare_store([key(4)])  # key 2 is least recent now
        assert out.evicted_keys == [key(2)] and not store.path_of(key(2)).exists()
        store.complete_store([key(4)], success=False)  # nothing was written: nothing to delete, no entry
        store.remove([key(3)])
        assert files(store) == {key(1).hex() + ".kv"} and [e.key for e in store.entries()] == [key(1)]
        assert store.take_events() == [
            StoreEvent([key(1), key(2), key(3)], "DISK", False),
            StoreEvent([key(2)], "DISK", True),
            StoreEvent([key(4)], "DISK", True, True),  # the failed store: its slot released, metadata only
            StoreEvent([key(3)], "DISK", True),
        ]
        store.check_invariants()


def test_restart_finds_the_blocks_again_oldest_first_and_loads_them(tmp_path):
    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        fill(store, [key(1), key(2), key(3)])
        for age, i in enumerate((2, 3, 1)):  # modification times decide the order after a restart
            os.utime(store.path_of(key(i)), (1_000_000 + age, 1_000_000 + age))
    with DiskStore(tmp_path, NS, 4 * SLOT, enable_events=True) as store:
        assert store.disk_stats.recovered == 3
        assert [e.key for e in store.entries()] == [key(2), key(3), key(1)]
        assert all(e.ready and e.ref_cnt == 0 for e in store.entries())
        assert store.lookup_prefix([key(2), key(3), key(1), key(4)]) == 3
        assert store.take_events() == [StoreEvent([k], "DISK", False) for k in (key(2), key(3), key(1))]
        st = host(seed=7)
        spec = store.prepare_load([key(1)])
        with DiskIO(st, store) as io:
            assert io.submit(plan(1, "DISK", "CPU", spec.block_ids, [5])).wait(10)
        store.complete_load([key(1)])
        assert st.block(5).equal(host().block(1))  # key 1 was stored from block 1 of the seed-0 tier
        store.check_invariants()


def test_restart_over_capacity_keeps_the_newest_and_deletes_the_oldest(tmp_path):
    with DiskStore(tmp_path, NS, 3 * SLOT) as store:
        fill(store, [key(1), key(2), key(3)])
        for age, i in enumerate((1, 2, 3)):
            os.utime(store.path_of(key(i)), (1_000_000 + age, 1_000_000 + age))
    with DiskStore(tmp_path, NS, 2 * SLOT) as store:
        assert [e.key for e in store.entries()] == [key(2), key(3)]
        assert store.stats.evictions == 1 and not store.path_of(key(1)).exists()


def test_restart_ignores_and_counts_torn_foreign_and_misnamed_files_and_removes_temporaries(tmp_path):
    with DiskStore(tmp_path, NS, 8 * SLOT) as store:
        fill(store, [key(1), key(2), key(3), key(4)])
        good = store.path_of(key(1)).read_bytes()
        torn = store.path_of(key(2))
        torn.write_bytes(torn.read_bytes()[:-1])  # a block cut short
        store.path_of(key(3)).write_bytes(b"not a block at all")
        renamed = store.path_of(key(5))  # a valid block under another key's name
        renamed.write_bytes(good)
        (store.directory / "00" / "notes.txt").write_text("hello")
        tmp = store.path_of(key(6)).with_name(f".{key(6).hex()}.kv.123.0.tmp")
        tmp.write_bytes(good[:100])  # an interrupted write
        directory = store.directory
    with DiskStore(tmp_path, NS, 8 * SLOT) as store:
        assert [e.key for e in store.entries()] == [key(1), key(4)]
        s = store.disk_stats
        assert (s.recovered, s.invalid_files, s.foreign_files, s.temp_files_removed) == (2, 3, 1, 1)
        assert store.lookup(key(2)) is LookupResult.MISS and store.lookup(key(5)) is LookupResult.MISS
        assert not tmp.exists() and torn.exists()  # ignored files stay for inspection
    assert directory.is_dir()


def test_a_foreign_namespace_is_a_separate_directory_and_its_blocks_are_refused(tmp_path):
    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        fill(store, [key(1)])
        data = store.path_of(key(1)).read_bytes()
    with DiskStore(tmp_path, OTHER_NS, 4 * SLOT) as other:
        assert other.directory != store.directory and other.num_used == 0
        other.path_of(key(1)).write_bytes(data)  # the right name, the wrong namespace in the header
    with DiskStore(tmp_path, OTHER_NS, 4 * SLOT) as other:
        assert other.num_used == 0 and other.disk_stats.invalid_files == 1
    header = BlockHeader.decode(data, NS.digest, key(1), SPEC.bytes_per_block)
    assert (header.key, header.payload_bytes, header.size) == (key(1), 512, 44 + 32)


def test_one_store_per_directory(tmp_path):
    with DiskStore(tmp_path, NS, 4 * SLOT):
        with pytest.raises(StorageError, match="is in use by another store"):
            DiskStore(tmp_path, NS, 4 * SLOT)
    DiskStore(tmp_path, NS, 4 * SLOT).close()  # released


def test_an_unusable_root_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="cannot use directory"):
        DiskStore(tmp_path / "file", NS, 4 * SLOT)


def test_private_keys_and_bad_arguments_are_refused_and_change_nothing(tmp_path):
    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        fill(store, [key(1)])
        before = snapshot(store)
        with pytest.raises(InvalidArgumentError, match=r"keys\[1\] = \('req-7', 0\) \(tuple\) cannot be stored"):
            store.prepare_store([key(2), ("req-7", 0)])
        with pytest.raises(InvalidArgumentError, match=r"keys\[0\] = b'' \(bytes\) cannot be stored"):
            store.prepare_store([b""])
        with pytest.raises(InvalidArgumentError, match="must be a hashable key that is not a bool"):
            store.prepare_store([True])
        with pytest.raises(BlockStateError, match="slot 3 of the DISK store holds no entry"):
            store.key_at(3)
        with pytest.raises(InvalidArgumentError, match="slot must be an int > 0"):
            store.key_at(0)
        assert snapshot(store) == before
    for bad, match in [
        (dict(capacity_bytes=4096.0), "capacity_bytes must be an int"),
        (dict(capacity_bytes=True), "capacity_bytes must be an int"),
        (dict(namespace="tiny"), "namespace must be a KVNamespace"),
        (dict(root=3), "root must be a str or PathLike"),
        (dict(policy="fifo"), "policy must be one of"),
    ]:
        args = dict(root=tmp_path / "x", namespace=NS, capacity_bytes=4 * SLOT) | bad
        with pytest.raises(InvalidArgumentError, match=match):
            DiskStore(**args)


def test_int_keys_have_names_too(tmp_path):
    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        fill(store, [-(2**63), 12345])
        assert store.path_of(12345).name == "i12345.kv" and store.path_of(-(2**63)).is_file()
    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        assert {e.key for e in store.entries()} == {-(2**63), 12345}


def test_key_names_round_trip_and_nothing_else_parses():
    from tiered_kv.tiers.namespace import key_name, parse_key_name

    for k in (key(3), b"\x00", b"\xff" * 64, 0, -1, 2**64):
        assert parse_key_name(key_name(k)) == k and type(parse_key_name(key_name(k))) is type(k)
    for name in ("i007", "i+7", "i", "", "abc", "ABCD", "zz", "00" * 65, "i1.5"):
        assert parse_key_name(name) is None, name
    with pytest.raises(InvalidArgumentError, match="must be a block hash"):
        key_name(b"\x00" * 65)


def test_an_empty_plan_finishes_at_once_and_a_closed_engine_takes_no_more(tmp_path):
    from tiered_kv.errors import PlanError

    with DiskStore(tmp_path, NS, 4 * SLOT) as store:
        io = DiskIO(host(), store)
        h = io.submit(plan(1, "CPU", "DISK", [], []))
        assert h.done() and h.ok and h.outcomes == []
        io.close()
        with pytest.raises(PlanError, match="engine is closed"):
            io.submit(plan(2, "CPU", "DISK", [], []))
