"""tiered_kv's disk and Redis tiers as vLLM 0.33 secondary tiers, inside vLLM's own TieringOffloadingManager.

vLLM's ``OffloadingSpecFactory`` builds ``TieringOffloadingSpec`` from a
``kv_connector_extra_config``, and its ``SecondaryTierFactory`` builds our tiers
from ``"secondary_tiers": [{"type": ..., "module_path": ...}]``.  The primary
(CPU) region is vLLM's real shared-memory region; this test writes chunks into
it as vLLM's GPU->CPU worker would, and reads them back after a promotion.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
from tierutil import free_port
from vllm_env import PROBLEM, offloading_config, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from tiered_kv.integrations.vllm import DiskTier, RedisTier
    from tiered_kv.tiers.store import LookupResult as StoreLookup

CHUNK = 4096
PRIMARY_CHUNKS = 4
MODULE = "tiered_kv.integrations.vllm"


def keys(start: int, n: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(4, "big") * 8, 0) for i in range(start, start + n)]


def chunk_bytes(seed: int) -> bytes:
    return bytes((seed * 131 + i * 7) % 256 for i in range(CHUNK))


class Rig:
    """vLLM's tiering manager over a 4-chunk primary region and the given secondary tiers."""

    def __init__(self, tiers: list[dict]) -> None:
        extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK}
        extra["secondary_tiers"] = tiers
        self.spec = OffloadingSpecFactory.create_spec(offloading_config(extra, kv_bytes_per_block=CHUNK))
        self.manager = self.spec.get_manager()
        assert isinstance(self.manager, TieringOffloadingManager)
        self.view = self.manager.primary_tier.get_kv_memoryview()
        assert self.view.shape == (PRIMARY_CHUNKS, CHUNK)
        self.tiers = self.manager.secondary_tiers
        self.ctx = ReqContext(req_id="r0")
        self.manager.on_new_request(self.ctx)

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        list(self.manager.take_events())

    def settle(self, timeout_s: float = 10.0) -> None:
        """Step until no tier has I/O in flight (vLLM steps while a tier has pending work)."""
        deadline = time.monotonic() + timeout_s
        self.step()
        while any(t.has_pending_work() for t in self.tiers):
            assert time.monotonic() < deadline, "a tier's I/O did not finish"
            time.sleep(0.005)
            self.step()
        self.step()

    def write(self, ks: list[bytes], seeds: list[int]) -> None:
        """Store chunks into the primary tier as vLLM's GPU->CPU worker does: reserve, fill the rows, complete."""
        out = self.manager.prepare_store(ks, self.ctx)
        assert out is not None and list(out.keys_to_store) == ks
        flat = self.view.cast("B")
        for chunk_id, seed in zip(out.store_spec.block_ids, seeds, strict=True):
            flat[int(chunk_id) * CHUNK : (int(chunk_id) + 1) * CHUNK] = chunk_bytes(seed)
        self.manager.complete_store(ks, self.ctx, success=True)

    def read(self, ks: list[bytes]) -> list[bytes]:
        spec = self.manager.prepare_load(ks, self.ctx)
        flat = self.view.cast("B")
        out = [bytes(flat[int(c) * CHUNK : (int(c) + 1) * CHUNK]) for c in spec.block_ids]
        self.manager.complete_load(ks, self.ctx)
        return out

    def close(self) -> None:
        self.manager.shutdown()


def disk_tier(root, **extra) -> dict:
    return {"type": "DiskTier", "module_path": MODULE, "root": str(root), "capacity_bytes": 64 * 8192, **extra}


def redis_tier(url, **extra) -> dict:
    return {"type": "RedisTier", "module_path": MODULE, "url": url, "timeout_s": 0.3, **extra}


def evict_from_primary(rig: Rig) -> None:
    """Fill the primary with other chunks, so the first ones live only in the secondary tiers."""
    rig.write(keys(100, PRIMARY_CHUNKS), list(range(100, 100 + PRIMARY_CHUNKS)))
    rig.settle()


def test_vllm_factories_build_our_tiers_from_module_path(tmp_path, redis_server):
    rig = Rig([disk_tier(tmp_path), redis_tier(redis_server.url)])
    try:
        disk, remote = rig.tiers
        assert (type(disk), type(remote)) == (DiskTier, RedisTier)
        assert (disk.tier_type, remote.tier_type) == ("DiskTier", "RedisTier")
        assert disk.namespace.model == "tiny-llama"
        assert disk.namespace.block_bytes == CHUNK
        assert "dtype=float16" in disk.namespace.spec.layout
        assert (disk.locality.value, remote.locality.value) == ("LOCAL", "REMOTE")
    finally:
        rig.close()


@pytest.mark.parametrize("which", ["disk", "redis"])
def test_round_trip_down_to_our_tier_and_back_is_byte_identical(tmp_path, redis_server, which):
    tier = disk_tier(tmp_path) if which == "disk" else redis_tier(redis_server.url)
    rig = Rig([tier])
    try:
        ks = keys(0, 3)
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.MISS] * 3
        rig.write(ks, [1, 2, 3])
        rig.settle()
        ours = rig.tiers[0]
        assert [ours.store.lookup(k) for k in ks] == [StoreLookup.HIT] * 3  # cascaded down
        evict_from_primary(rig)
        assert [rig.manager.primary_tier.lookup(k, rig.ctx) for k in ks] == [LookupResult.MISS] * 3
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 3  # promotion
        rig.settle()
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.HIT] * 3
        assert rig.read(ks) == [chunk_bytes(s) for s in (1, 2, 3)]
        assert ours.io.stats.blocks_loaded == 3
    finally:
        rig.close()


def test_redis_chunks_are_shared_by_a_second_instance(redis_server):
    first = Rig([redis_tier(redis_server.url)])
    try:
        first.write(keys(0, 2), [5, 6])
        first.settle()
    finally:
        first.close()
    second = Rig([redis_tier(redis_server.url)])
    try:
        ks = keys(0, 2)
        assert [second.manager.lookup(k, second.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        second.settle()
        assert second.read(ks) == [chunk_bytes(5), chunk_bytes(6)]
    finally:
        second.close()


def test_a_disk_tier_restarted_over_its_files_serves_them(tmp_path):
    first = Rig([disk_tier(tmp_path)])
    try:
        first.write(keys(0, 2), [7, 8])
        first.settle()
    finally:
        first.close()
    second = Rig([disk_tier(tmp_path)])
    try:
        assert second.tiers[0].store.disk_stats.recovered == 2
        ks = keys(0, 2)
        assert [second.manager.lookup(k, second.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        second.settle()
        assert second.read(ks) == [chunk_bytes(7), chunk_bytes(8)]
    finally:
        second.close()


def assert_lost_and_nothing_loaded(rig: Rig, ks: list[bytes]) -> None:
    """Every key ends as a miss and none is in the primary tier: nothing wrong can be loaded."""
    for _ in range(3):
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.MISS] * len(ks)
        rig.settle()
    assert [rig.manager.primary_tier.lookup(k, rig.ctx) for k in ks] == [LookupResult.MISS] * len(ks)


def test_a_full_disk_ends_as_a_miss(tmp_path):
    def full(op, key):
        if op == "store":
            raise OSError(errno.ENOSPC, "No space left on device")

    rig = Rig([disk_tier(tmp_path, fault_hook=full)])
    try:
        ks = keys(0, 2)
        rig.write(ks, [1, 2])
        rig.settle()
        ours = rig.tiers[0]
        assert [ours.store.lookup(k) for k in ks] == [StoreLookup.MISS] * 2
        assert ours.io.stats.outcomes == {"no_space": 2}
        assert not [p for p in ours.store.directory.rglob("*") if p.is_file() and p.name != ".lock"]
        evict_from_primary(rig)
        assert_lost_and_nothing_loaded(rig, ks)
    finally:
        rig.close()


def test_a_corrupt_file_ends_as_a_miss_and_is_never_loaded(tmp_path):
    rig = Rig([disk_tier(tmp_path)])
    try:
        ks = keys(0, 2)
        rig.write(ks, [1, 2])
        rig.settle()
        ours = rig.tiers[0]
        path = ours.store.path_of(ks[1])
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0x5A
        path.write_bytes(bytes(raw))
        evict_from_primary(rig)
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        rig.settle()
        assert rig.manager.lookup(ks[0], rig.ctx) is LookupResult.HIT  # its neighbour arrived whole
        assert ours.io.stats.outcomes.get("corrupt") == 1
        assert ours.store.lookup(ks[1]) is StoreLookup.MISS  # forgotten, its file deleted
        assert not path.exists()
        assert_lost_and_nothing_loaded(rig, ks[1:])
        assert rig.read(ks[:1]) == [chunk_bytes(1)]
    finally:
        rig.close()


def test_redis_killed_mid_store_ends_as_a_miss_without_a_hang(redis_server):
    def kill(op, key):
        if op == "store":
            redis_server.stop()

    rig = Rig([redis_tier(redis_server.url, fault_hook=kill)])
    try:
        ks = keys(0, 2)
        started = time.monotonic()
        rig.write(ks, [1, 2])
        rig.settle()
        ours = rig.tiers[0]
        assert ours.io.stats.outcomes == {"error": 2}
        evict_from_primary(rig)
        assert_lost_and_nothing_loaded(rig, ks)
        assert ours.store.remote_stats.health.errors >= 1
        assert time.monotonic() - started < 10  # each call waits at most its 0.3 s timeout
    finally:
        rig.close()


def test_redis_killed_mid_load_ends_as_a_miss_and_nothing_is_loaded(redis_server):
    state = {"armed": False}

    def kill(op, key):
        if op == "load" and state["armed"]:
            redis_server.stop()

    rig = Rig([redis_tier(redis_server.url, fault_hook=kill)])
    try:
        ks = keys(0, 2)
        rig.write(ks, [1, 2])
        rig.settle()
        evict_from_primary(rig)
        state["armed"] = True
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.HIT_PENDING] * 2
        rig.settle()
        ours = rig.tiers[0]
        assert ours.io.stats.outcomes.get("error") == 2
        assert_lost_and_nothing_loaded(rig, ks)
    finally:
        rig.close()


def test_a_redis_that_is_down_from_the_start_is_a_counted_miss():
    rig = Rig([redis_tier(f"redis://127.0.0.1:{free_port()}/0")])
    try:
        ks = keys(0, 2)
        started = time.monotonic()
        assert [rig.manager.lookup(k, rig.ctx) for k in ks] == [LookupResult.MISS] * 2
        assert rig.tiers[0].store.remote_stats.health.errors + rig.tiers[0].store.remote_stats.health.skipped >= 2
        assert time.monotonic() - started < 5
    finally:
        rig.close()


def test_bad_tier_config_is_a_clear_error(tmp_path):
    from tiered_kv.errors import TieredKVError

    with pytest.raises(TieredKVError, match="locality"):
        Rig([disk_tier(tmp_path, locality="MARS")])
    with pytest.raises(TieredKVError, match="capacity_bytes"):
        Rig([disk_tier(tmp_path, capacity_bytes=10)])
    assert os.listdir(tmp_path) == []  # refused before the tier made its directory
