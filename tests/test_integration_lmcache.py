"""tiered_kv's disk and Redis stores as an LMCache 0.5.6 storage plug-in, inside LMCache's own StorageManager.

LMCache's ``StorageManager`` builds its backends with ``CreateStorageBackends``: its own
local CPU backend (here only the allocator: ``local_cpu`` is off), then every entry of
``storage_plugins`` through ``storage_plugin_launcher``, from
``extra_config["storage_plugin.tiered_kv.module_path" / ".class_name"]``.  The tests put
LMCache ``MemoryObj``s allocated by that CPU backend, through the manager
(``batched_put``, ``get``, ``contains``) and through the plug-in's own interface, against
real media: files under a temporary directory and a real ``redis-server``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from lmcache_env import PLUGIN, PROBLEM, engine_config, engine_metadata, lmcache_mark
from tierutil import RedisServer, free_port

from tiered_kv.errors import ConfigError, InvalidArgumentError, TieredKVError
from tiered_kv.integrations.lmcache.page_format import HEADER_BYTES
from tiered_kv.integrations.page_store import open_page_store, page_key

pytestmark = lmcache_mark()

if PROBLEM is None:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    from tiered_kv.integrations.lmcache import TieredKVStorage

FULL = 2 * 2 * 16 * 16  # values in a full chunk of the test model
PAGE_FILE = 4096  # a disk page file (our 256-byte frame + a full fp16 chunk + the store's header, rounded to 4 KiB)


def key(i: int, dtype: torch.dtype = torch.float16, worker: int = 0) -> CacheEngineKey:
    return CacheEngineKey("tiny-llama", 1, worker, 0xC0FFEE00 + i, dtype)


def disk(root: Path, pages: int = 64, **extra) -> dict:
    return {"type": "disk", "root": str(root), "capacity_bytes": pages * PAGE_FILE, **extra}


def redis(url: str, **extra) -> dict:
    return {"type": "redis", "url": url, "timeout_s": 0.3, **extra}


def page_files(root: Path) -> list[str]:
    return sorted(f.name for f in root.rglob("*.kv"))


def file_names(keys) -> list[str]:
    """The disk page files of ``keys``: each key string's BLAKE2b-256, in hex."""
    return sorted(page_key(k.to_string()).hex() + ".kv" for k in keys)


class Rig:
    """LMCache's StorageManager with our plug-in loaded from its configuration."""

    def __init__(self, tiers: list[dict] | None, kv_dtype: torch.dtype = torch.float16, **ours) -> None:
        self.config = engine_config(tiers, **ours)
        self.metadata = engine_metadata(kv_dtype)
        self.manager = StorageManager(self.config, self.metadata, EventManager())
        self.plugin = self.manager.storage_backends.get(PLUGIN)

    def obj(self, seed: int, tokens: int = 16, dtype: torch.dtype | None = None):
        """An object of LMCache's CPU allocator for ``tokens`` tokens, filled with seeded bytes."""
        shape = self.metadata.get_shapes(tokens)[0]
        o = self.manager.allocate(shape, dtype or self.metadata.kv_dtype, fmt=MemoryFormat.KV_2LTD, busy_loop=False)
        assert o is not None
        g = torch.Generator().manual_seed(seed)
        raw = o.raw_data.view(torch.uint8)[: o.get_size()]
        raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=g))
        return o

    def settle(self, keys, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.plugin.exists_in_put_tasks(k) for k in keys):
            assert time.monotonic() < deadline, "a put task did not end"
            time.sleep(0.005)

    def put(self, keys, objs) -> None:
        """Put through LMCache's manager (as its cache engine stores), then wait for the writes."""
        self.manager.batched_put(keys, objs)
        self.settle(keys)

    def close(self) -> None:
        self.manager.close()


def image(o) -> tuple:
    """What an object is: its bytes, shape(s), dtype(s), format and used size."""
    m = o.metadata
    return (
        bytes(o.byte_array),
        tuple(m.shape),
        m.dtype,
        tuple(map(tuple, m.shapes)),
        tuple(m.dtypes),
        m.fmt,
        o.get_size(),
    )


@pytest.fixture(params=["disk", "redis", "chain"])
def tiers(request, tmp_path):
    if request.param == "disk":
        yield [disk(tmp_path)]
        return
    server = RedisServer()
    try:
        yield [redis(server.url)] if request.param == "redis" else [disk(tmp_path), redis(server.url)]
    finally:
        server.stop()


def test_lmcaches_loader_builds_our_plugin_from_its_configuration(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        assert list(rig.manager.storage_backends) == ["LocalCPUBackend", PLUGIN]
        assert isinstance(rig.plugin, TieredKVStorage)
        assert rig.plugin.get_allocator_backend() is rig.manager.storage_backends["LocalCPUBackend"]
        assert rig.plugin.page_bytes == HEADER_BYTES + FULL * 2
        assert rig.plugin.store.kind == "disk"
        assert rig.plugin.store_stats()[0].capacity_pages == 64
    finally:
        rig.close()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
def test_a_put_and_get_through_lmcaches_manager_is_byte_identical(tiers, kv_dtype):
    rig = Rig(tiers, kv_dtype=kv_dtype)
    try:
        ks = [key(i, kv_dtype) for i in range(3)]
        objs = [rig.obj(1), rig.obj(2), rig.obj(3, tokens=5)]  # the last chunk of a prompt is short
        want = [image(o) for o in objs]
        rig.put(ks, objs)
        assert [rig.manager.contains(k) for k in ks] == [PLUGIN] * 3
        got = [rig.plugin.get_blocking(k) for k in ks]
        assert [image(o) for o in got] == want
        assert got[2].get_num_tokens() == 5 and got[2].tensor.shape == (2, 2, 5, 16)
        first = rig.manager.get(ks[0])  # LMCache's own get: tries its CPU backend, then ours
        assert image(first) == want[0]
        assert rig.plugin.stats().written == 3
    finally:
        rig.close()


def test_an_object_of_several_groups_and_a_narrowed_one_come_back_exactly(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        cpu = rig.manager.storage_backends["LocalCPUBackend"]
        two = cpu.allocate([torch.Size([2, 2, 4, 16]), torch.Size([1, 2, 4, 16])], [torch.float16, torch.float32])
        two.raw_data.view(torch.uint8)[: two.get_size()].copy_(torch.arange(two.get_size()) % 251)
        narrow = rig.obj(7)
        narrow.set_used_size(1000)
        want = [image(two), image(narrow)]
        rig.plugin.batched_submit_put_task([key(0), key(1)], [two, narrow])
        rig.settle([key(0), key(1)])
        got = rig.plugin.batched_get_blocking([key(0), key(1)])
        assert [image(o) for o in got] == want
        assert got[1].get_size() == 1000 and got[0].get_tensor(1).dtype == torch.float32
    finally:
        rig.close()


def test_layerwise_keys_and_objects_are_pages_of_their_own(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        cpu = rig.manager.storage_backends["LocalCPUBackend"]
        layers = key(0).split_layers(2)  # LMCache's layer-wise keys: one object per layer
        objs = []
        for i in range(2):
            o = cpu.allocate(torch.Size([5, 2, 16]), torch.float16, fmt=MemoryFormat.KV_T2D)
            o.raw_data.view(torch.uint8)[: o.get_size()].fill_(i + 1)
            objs.append(o)
        want = [image(o) for o in objs]
        rig.plugin.batched_submit_put_task(layers, objs)
        rig.settle(layers)
        assert rig.plugin.batched_contains(layers) == 2 and not rig.plugin.contains(key(0))
        got = rig.plugin.batched_get_blocking(layers)
        assert [image(o) for o in got] == want and got[0].metadata.fmt == MemoryFormat.KV_T2D
    finally:
        rig.close()


def test_put_tasks_are_asynchronous_and_hold_the_object_until_written(tmp_path):
    gate = {"open": False}

    def slow(op, _key):
        while op == "store" and not gate["open"]:
            time.sleep(0.005)

    rig = Rig([disk(tmp_path)], fault_hook=slow)
    try:
        o = rig.obj(1)
        want = image(o)
        done = []
        futures = rig.plugin.batched_submit_put_task([key(0)], [o], on_complete_callback=done.append)
        assert len(futures) == 1
        assert rig.plugin.exists_in_put_tasks(key(0)) and not rig.plugin.contains(key(0))
        assert o.get_ref_count() == 2  # ours until the write ends
        rig.plugin.batched_submit_put_task([key(0)], [o])  # already in flight: not queued twice
        o.ref_count_down()  # LMCache drops its own reference after the submit
        gate["open"] = True
        assert futures[0].result(10) == [True]
        assert not rig.plugin.exists_in_put_tasks(key(0)) and rig.plugin.contains(key(0))
        assert done == [key(0)]
        assert image(rig.plugin.get_blocking(key(0))) == want
        assert rig.plugin.stats().written == 1 and rig.plugin.stats().submitted == 2
    finally:
        gate["open"] = True  # close() waits for the write
        rig.close()


def test_contains_and_eviction_agree_with_what_was_stored(tmp_path):
    rig = Rig([disk(tmp_path, pages=3)])
    try:
        assert rig.plugin.store_stats()[0].capacity_pages == 3
        rig.put([key(0), key(1), key(2)], [rig.obj(0), rig.obj(1), rig.obj(2)])
        assert [rig.plugin.contains(key(i)) for i in range(4)] == [True, True, True, False]
        assert rig.plugin.get_blocking(key(0)) is not None  # key 0 is now the most recent
        rig.put([key(3)], [rig.obj(3)])
        assert [rig.plugin.contains(key(i)) for i in range(4)] == [True, False, True, True]
        assert rig.plugin.get_blocking(key(1)) is None
        assert rig.plugin.batched_contains([key(0), key(2), key(1), key(3)]) == 2
        assert rig.plugin.store_stats()[0].evicted == 1
        assert page_files(tmp_path) == file_names([key(0), key(2), key(3)])
    finally:
        rig.close()


def test_keys_of_other_ranks_and_dtypes_are_other_pages(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        rig.put([key(0)], [rig.obj(0)])
        assert rig.plugin.contains(key(0))
        assert not rig.plugin.contains(key(0, worker=1))
        assert not rig.plugin.contains(key(0, dtype=torch.bfloat16))
    finally:
        rig.close()


def test_pin_unpin_and_remove_have_lmcaches_meaning(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        p = rig.plugin
        rig.put([key(0), key(1)], [rig.obj(0), rig.obj(1)])
        assert p.contains(key(0), pin=True) and p.is_pinned(key(0)) == 1
        assert p.pin(key(0)) and p.is_pinned(key(0)) == 2
        assert not p.pin(key(9)) and p.is_pinned(key(9)) == 0
        assert p.remove(key(0), force=False) is False and p.contains(key(0))  # LMCache's eviction skips a held key
        assert p.unpin(key(0)) and p.unpin(key(0)) and not p.unpin(key(0))
        assert p.remove(key(0), force=False) is True and not p.contains(key(0))
        assert p.contains(key(1), pin=True)
        assert p.remove(key(1)) is True and p.is_pinned(key(1)) == 0 and not p.contains(key(1))
        assert p.remove(key(1)) is False
        assert page_files(tmp_path) == []
    finally:
        rig.close()


def test_a_pinned_chunk_survives_puts_that_fill_the_store_until_it_is_unpinned(tmp_path):
    rig = Rig([disk(tmp_path, pages=2)])
    try:
        p = rig.plugin
        rig.put([key(0), key(1)], [rig.obj(0), rig.obj(1)])
        want = image(rig.obj(0))
        assert p.contains(key(0), pin=True)  # a lookup promised key 0 to a coming retrieve
        rig.put([key(2)], [rig.obj(2)])  # evicts key 1, the only chunk not held
        rig.put([key(3)], [rig.obj(3)])  # evicts key 2: key 0 is still held
        assert [p.contains(key(i)) for i in range(4)] == [True, False, False, True]
        assert image(p.get_blocking(key(0))) == want
        assert p.unpin(key(0))
        p.get_blocking(key(3))
        rig.put([key(4)], [rig.obj(4)])  # key 0 is evictable again, and the least recent
        assert [p.contains(key(i)) for i in (0, 3, 4)] == [False, True, True]
    finally:
        rig.close()


def test_async_lookup_and_prefetch_return_the_present_prefix_and_release_the_holds(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        p = rig.plugin
        objs = [rig.obj(i) for i in range(3)]
        want = [image(o) for o in objs]
        rig.put([key(0), key(1), key(3)], objs)
        loop = asyncio.new_event_loop()
        try:
            ks = [key(0), key(1), key(2), key(3)]
            assert loop.run_until_complete(p.batched_async_contains("L1", ks, pin=True)) == 2
            assert [p.is_pinned(k) for k in ks] == [1, 1, 0, 0]
            got = loop.run_until_complete(p.batched_get_non_blocking("L1", ks[:2]))
            assert [image(o) for o in got] == want[:2]
            assert [p.is_pinned(k) for k in ks] == [0, 0, 0, 0]
        finally:
            loop.close()
        fut = p.get_non_blocking(key(3))
        assert image(fut.result(10)) == want[2]
        assert p.get_non_blocking(key(2)) is None
    finally:
        rig.close()


def test_a_corrupt_disk_file_is_a_miss_and_is_forgotten(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        rig.put([key(0), key(1)], [rig.obj(0), rig.obj(1)])
        files = sorted(tmp_path.rglob("*.kv"))
        assert [f.name for f in files] == file_names([key(0), key(1)])
        for f in files:
            data = bytearray(f.read_bytes())
            data[-100] ^= 0xFF  # inside the payload
            f.write_bytes(bytes(data))
        assert rig.plugin.get_blocking(key(0)) is None
        assert rig.plugin.batched_get_blocking([key(1)]) == [None]
        assert not rig.plugin.contains(key(0)) and not rig.plugin.contains(key(1))
        assert rig.plugin.store_stats()[0].corrupt == 2
        assert rig.manager.get(key(0)) is None
    finally:
        rig.close()


def test_a_page_with_a_foreign_frame_is_a_miss_and_is_removed(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        p = rig.plugin
        ns = p.store.namespace
        p.close()  # one writer at a time on a disk namespace
        with open_page_store(
            {"tiers": [disk(tmp_path)]},
            page_bytes=p.page_bytes,
            model=ns.model,
            layout=ns.spec.layout,
            hash_scheme=ns.hash_scheme,
        ) as other:
            assert other.put([key(0).to_string()], [bytes(p.page_bytes)]) == [True]  # a zero header
        again = Rig([disk(tmp_path)])
        try:
            assert again.plugin.contains(key(0))
            assert again.plugin.get_blocking(key(0)) is None
            assert again.plugin.stats().bad_pages == 1 and not again.plugin.contains(key(0))
        finally:
            again.close()
    finally:
        rig.close()


def test_a_restart_reads_the_chunks_stored_before(tmp_path):
    first = Rig([disk(tmp_path)])
    objs = [first.obj(0), first.obj(1, tokens=3)]
    want = [image(o) for o in objs]
    first.manager.batched_put([key(0), key(1)], objs)
    first.close()  # waits for the writes
    second = Rig([disk(tmp_path)])
    try:
        assert second.plugin.batched_contains([key(0), key(1)]) == 2
        assert [image(o) for o in second.plugin.batched_get_blocking([key(0), key(1)])] == want
    finally:
        second.close()


def test_redis_killed_mid_get_is_a_miss(redis_server):
    state = {"armed": False}

    def kill(op, _key):
        if op == "load" and state["armed"]:
            redis_server.stop()

    rig = Rig([redis(redis_server.url)], fault_hook=kill)
    try:
        rig.put([key(0), key(1)], [rig.obj(0), rig.obj(1)])
        assert rig.plugin.batched_contains([key(0), key(1)]) == 2
        state["armed"] = True
        started = time.monotonic()
        assert rig.plugin.get_blocking(key(0)) is None
        assert rig.plugin.batched_get_blocking([key(1)]) == [None]
        assert not rig.plugin.contains(key(0))
        assert rig.manager.get(key(1)) is None
        assert time.monotonic() - started < 10
    finally:
        rig.close()


def test_redis_killed_mid_put_is_a_miss(redis_server):
    def kill(op, _key):
        if op == "store":
            redis_server.stop()

    rig = Rig([redis(redis_server.url)], fault_hook=kill)
    try:
        rig.put([key(0), key(1)], [rig.obj(0), rig.obj(1)])
        assert not rig.plugin.exists_in_put_tasks(key(0))
        s = rig.plugin.stats()
        assert (s.written, s.failed) == (0, 2)
        assert rig.plugin.get_blocking(key(0)) is None and not rig.plugin.contains(key(1))
    finally:
        rig.close()


def test_a_redis_that_is_down_is_a_miss_and_a_failed_put():
    rig = Rig([redis(f"redis://127.0.0.1:{free_port()}/0")])
    try:
        rig.put([key(0)], [rig.obj(0)])
        assert rig.plugin.stats().failed == 1
        assert not rig.plugin.contains(key(0)) and rig.plugin.get_blocking(key(0)) is None
        assert rig.manager.batched_contains([key(0)]) == (0, {})
    finally:
        rig.close()


def test_the_chain_serves_from_disk_while_redis_is_down_and_promotes_from_redis(tmp_path, redis_server):
    rig = Rig([disk(tmp_path), redis(redis_server.url)])
    try:
        objs = [rig.obj(0), rig.obj(1)]
        want = [image(o) for o in objs]
        rig.put([key(0), key(1)], objs)
        assert [s.num_pages for s in rig.plugin.store_stats()] == [2, 2]
        rig.plugin.store.tiers[0].remove([key(0).to_string()])  # only Redis has key 0 now
        assert image(rig.plugin.get_blocking(key(0))) == want[0]  # from Redis, promoted to disk
        assert rig.plugin.store.tiers[0].exists([key(0).to_string()]) == [True]
        redis_server.stop()
        assert [image(o) for o in rig.plugin.batched_get_blocking([key(0), key(1)])] == want
    finally:
        rig.close()


def test_objects_a_page_cannot_hold_are_refused_and_never_written(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        big = rig.manager.allocate(rig.metadata.get_shapes(16)[0], torch.float32)  # twice a full fp16 chunk
        blend = rig.obj(2)
        blend.metadata.cached_positions = torch.arange(16)
        assert rig.plugin.batched_submit_put_task([key(0), key(1)], [big, blend]) is None
        assert rig.plugin.stats().refused == 2
        assert not rig.plugin.exists_in_put_tasks(key(0)) and not rig.plugin.contains(key(1))
        assert big.get_ref_count() == 1 and blend.get_ref_count() == 1
    finally:
        rig.close()


def test_bad_calls_are_refused_before_anything_is_queued(tmp_path):
    rig = Rig([disk(tmp_path)])
    try:
        o = rig.obj(0)
        with pytest.raises(InvalidArgumentError, match="1 keys and 2 objects"):
            rig.plugin.batched_submit_put_task([key(0)], [o, o])
        with pytest.raises(InvalidArgumentError, match="CacheEngineKey"):
            rig.plugin.batched_submit_put_task(["k"], [o])
        with pytest.raises(InvalidArgumentError, match="MemoryObj"):
            rig.plugin.batched_submit_put_task([key(0)], [b"x"])
        with pytest.raises(InvalidArgumentError, match="CacheEngineKey"):
            rig.plugin.contains("k")
        assert o.get_ref_count() == 1 and rig.plugin.stats().submitted == 0
        assert not rig.plugin.exists_in_put_tasks(key(0)) and not rig.plugin.contains(key(0))
        assert page_files(tmp_path) == []
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("ours", "error", "message"),
    [
        ({"colour": "blue"}, ConfigError, "unknown extra_config key storage_plugin.tiered_kv.colour"),
        ({"tiers": None}, ConfigError, "needs storage_plugin.tiered_kv.tiers"),
        ({"tiers": "[{"}, ConfigError, "not JSON"),
        ({"tiers": [{"type": "tape"}]}, InvalidArgumentError, "tiers\\[0\\].type"),
        ({"tiers": [{"type": "disk", "root": "ROOT", "capacity_bytes": -1}]}, InvalidArgumentError, "capacity_bytes"),
        ({"tiers": None, "tiers.0.type": "disk", "tiers.2.root": "ROOT"}, ConfigError, "indices must be 0..1"),
        ({"put_workers": 0}, ConfigError, "put_workers"),
    ],
)
def test_bad_configuration_is_a_clear_error_and_creates_nothing(tmp_path, ours, error, message):
    root = tmp_path / "kv"

    def fill(v):
        if v == "ROOT":
            return str(root)
        if isinstance(v, list):
            return [{k: fill(x) for k, x in t.items()} for t in v]
        return v

    ours = {k: fill(v) for k, v in ours.items()}
    tiers = ours.pop("tiers", [disk(root)])
    config, metadata = engine_config(tiers, **ours), engine_metadata()
    with pytest.raises(error, match=message) as info:
        TieredKVStorage(dst_device="cpu", config=config, metadata=metadata, local_cpu_backend=object(), loop=None)
    assert isinstance(info.value, TieredKVError)
    assert not root.exists()
    # LMCache's own loader logs the error and leaves the plug-in out; the engine runs without it.
    manager = StorageManager(config, metadata, EventManager())
    try:
        assert list(manager.storage_backends) == ["LocalCPUBackend"]
    finally:
        manager.close()
    assert not root.exists()


def test_flattened_tier_keys_and_a_json_tier_list_build_the_same_chain(tmp_path, redis_server):
    import json

    flat = Rig(
        None,
        **{
            "tiers.0.type": "disk",
            "tiers.0.root": str(tmp_path / "a"),
            "tiers.0.capacity_bytes": 8 * PAGE_FILE,
            "tiers.1.type": "redis",
            "tiers.1.url": redis_server.url,
        },
    )
    try:
        assert flat.plugin.store.kind == "chain" and [t.kind for t in flat.plugin.store] == ["disk", "redis"]
    finally:
        flat.close()
    text = Rig(json.dumps([disk(tmp_path / "b"), redis(redis_server.url)]))
    try:
        assert [t.kind for t in text.plugin.store] == ["disk", "redis"]
    finally:
        text.close()


def test_a_worker_without_lmcaches_cpu_backend_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="max_local_cpu_size > 0"):
        TieredKVStorage(dst_device="cpu", config=engine_config([disk(tmp_path)]), metadata=engine_metadata())
    assert os.listdir(tmp_path) == []


def docs_section() -> str:
    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    return text[text.index("# tiered_kv inside LMCache") :]


def pasted(text: str, root: Path, url: str) -> str:
    """The docs' configuration with the paths, sizes and server of this test."""
    return (
        text.replace("/mnt/nvme/kv", str(root))
        .replace("200000000000", str(64 * PAGE_FILE))
        .replace("redis://kv-cache:6379/0", url)
    )


def test_the_yaml_in_the_docs_builds_the_chain(tmp_path, redis_server):
    import re

    from lmcache.v1.config import LMCacheEngineConfig

    yaml_text = re.search(r"```yaml\n(.*?)```", docs_section(), flags=re.S).group(1)
    path = tmp_path / "lmcache.yaml"
    path.write_text(pasted(yaml_text, tmp_path / "kv", redis_server.url).replace("chunk_size: 256", "chunk_size: 16"))
    config = LMCacheEngineConfig.from_file(str(path))
    config.max_local_cpu_size = 0.01
    manager = StorageManager(config, engine_metadata(), EventManager())
    try:
        plugin = manager.storage_backends[PLUGIN]
        assert [t.kind for t in plugin.store] == ["disk", "redis"]
        assert plugin.store.tiers[0].stats().capacity_pages == 64
    finally:
        manager.close()


def test_the_environment_variables_in_the_docs_build_the_disk_tier(tmp_path, monkeypatch):
    import re
    import shlex

    from lmcache.v1.config import LMCacheEngineConfig

    line = next(x for x in docs_section().splitlines() if x.startswith("LMCACHE_CHUNK_SIZE="))
    for word in shlex.split(pasted(line, tmp_path / "kv", "")):
        name, _, value = word.partition("=")
        assert re.fullmatch("LMCACHE_[A-Z_]+", name)
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "16")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.01")
    manager = StorageManager(LMCacheEngineConfig.from_env(), engine_metadata(), EventManager())
    try:
        plugin = manager.storage_backends[PLUGIN]
        assert plugin.store.kind == "disk" and plugin.store.stats().capacity_pages == 64
    finally:
        manager.close()
