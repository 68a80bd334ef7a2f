"""tiered_kv's disk and Redis stores as an SGLang 0.5.23 HiCache storage backend, built by SGLang's own loader.

Every backend here is made by SGLang's ``StorageBackendFactory`` from a
``HiCacheStorageConfig`` whose extra config names our class (the ``dynamic`` path:
``backend_name``, ``module_path``, ``class_name``), exactly as ``--hicache-storage-backend
dynamic`` does; then the host pool is registered as SGLang's cache controller does.
Keys are SGLang's own page hashes (``get_hash_str``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sglang_env import PROBLEM, HostPoolDouble, sglang_mark, storage_config
from tierutil import RedisServer, free_port

pytestmark = sglang_mark()

if PROBLEM is None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    from tiered_kv.errors import InvalidArgumentError
    from tiered_kv.integrations.sglang import TieredKVHiCacheStorage

DTYPES = [torch.bfloat16, torch.float16] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
LOADER = {
    "backend_name": "tiered_kv",
    "module_path": "tiered_kv.integrations.sglang",
    "class_name": "TieredKVHiCacheStorage",
}


def disk(root: Path, pages: int = 64) -> dict:
    return {"type": "disk", "root": str(root), "capacity_bytes": pages * 8192}  # a 4 KiB page's file takes 8 KiB


def redis(url: str) -> dict:
    return {"type": "redis", "url": url, "timeout_s": 0.3}


def build(tiers: list[dict], pool: HostPoolDouble | None = None, fault_hook=None, **overrides):
    """SGLang's loader builds the backend from the extra config; the host pool is registered as the controller does."""
    extra = json.loads(json.dumps({**LOADER, "tiers": tiers}))  # what --hicache-storage-backend-extra-config parses
    kwargs = {} if fault_hook is None else {"fault_hook": fault_hook}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **overrides), None, **kwargs)
    backend.register_mem_pool_host(pool if pool is not None else HostPoolDouble())
    return backend


def hashes(n: int, start: int = 0, page: int = 16) -> list[str]:
    """SGLang's storage keys of n pages of tokens: a SHA-256 chain over each page's tokens."""
    return get_hash_str(list(range(start, start + n * page)), None, page_size=page)


def page(pool: HostPoolDouble, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = pool.get_dummy_flat_data_page().numel() * pool.kv_buffer.element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(pool.dtype)


def page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


@pytest.fixture(params=["disk", "redis", "chain"])
def tiers(request, tmp_path):
    if request.param == "disk":
        yield [disk(tmp_path / "kv")]
        return
    server = RedisServer()
    try:
        yield [redis(server.url)] if request.param == "redis" else [disk(tmp_path / "kv"), redis(server.url)]
    finally:
        server.stop()


# ---------------------------------------------------------------- the loader


def test_sglangs_loader_builds_our_backend_from_the_dynamic_config(tmp_path):
    backend = build([disk(tmp_path / "kv")])
    try:
        assert type(backend) is TieredKVHiCacheStorage
        assert backend.page_bytes == 2 * 2 * 16 * 2 * 16 * 2  # K and V, 2 layers, 16 tokens, 2 heads of 16, bf16
        assert backend.config.model == "meta-llama/Llama-3.1-8B-Instruct"
        assert backend.layout == "sglang;HostPoolDouble;layer_first;torch.bfloat16;page16;tp0/1;pp0/1;cp0/1;dp0"
    finally:
        backend.close()


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_set_get_and_batch_round_trips_are_byte_identical(tiers, dtype):
    pool = HostPoolDouble(dtype=dtype)
    backend = build(tiers, pool)
    try:
        ks = hashes(3)
        pages = [page(pool, i) for i in range(3)]
        assert backend.set(ks[0], pages[0]) is True
        assert backend.batch_set(ks[1:], pages[1:]) is True
        out = torch.full_like(pages[0], 0)
        assert backend.get(ks[0], out) is out and raw(out) == raw(pages[0])
        got = backend.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
        assert [raw(g) for g in got] == [raw(p) for p in pages]
        fresh = backend.batch_get(ks)  # no destinations: flat pages of the host pool's geometry
        assert [(g.dtype, raw(g)) for g in fresh] == [(dtype, raw(p)) for p in pages]
        assert backend.exists(ks[2]) and backend.batch_exists(ks) == 3
    finally:
        backend.close()


def test_exists_and_batch_exists_agree_with_what_was_stored(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        ks = hashes(4)
        assert backend.batch_exists(ks) == 0 and [backend.exists(k) for k in ks] == [False] * 4
        assert backend.batch_set([ks[0], ks[1], ks[3]], [page(pool, i) for i in (0, 1, 3)]) is True
        assert [backend.exists(k) for k in ks] == [True, True, False, True]
        assert backend.batch_exists(ks) == 2  # the prefix SGLang would load stops at the gap
        assert backend.batch_get(ks)[2] is None
    finally:
        backend.close()


def test_eviction_under_a_small_capacity_and_exists_agree(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv", pages=3)], pool)
    try:
        assert backend.store.stats().capacity_pages == 3
        ks = hashes(5)
        for i, k in enumerate(ks):
            assert backend.set(k, page(pool, i))
        # LRU: the two oldest pages were evicted to make room, and their files deleted
        assert [backend.exists(k) for k in ks] == [False, False, True, True, True]
        assert backend.store.stats().evicted == 2
        assert len(page_files(tmp_path / "kv")) == 3
        assert backend.batch_get(ks[:2]) == [None, None]
        # a read makes a page recent: reading ks[2] makes ks[3] the oldest, the next victim
        assert backend.get(ks[2]) is not None
        assert backend.set(hashes(1, start=1000)[0], page(pool, 9))
        assert [backend.exists(k) for k in ks] == [False, False, True, False, True]
    finally:
        backend.close()


def test_registering_the_pool_again_reopens_the_same_pages(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        k = hashes(1)[0]
        assert backend.set(k, page(pool, 3))
        backend.register_mem_pool_host(pool)  # SGLang re-attaches storage at run time
        assert raw(backend.get(k)) == raw(page(pool, 3))
    finally:
        backend.close()


def test_a_restart_on_the_same_root_reads_the_stored_pages(tmp_path):
    pool = HostPoolDouble()
    ks = hashes(2)
    pages = [page(pool, 5), page(pool, 6)]
    first = build([disk(tmp_path / "kv")], pool)
    assert first.batch_set(ks, pages)
    first.close()
    second = build([disk(tmp_path / "kv")], HostPoolDouble())
    try:
        assert second.batch_exists(ks) == 2
        assert [raw(g) for g in second.batch_get(ks)] == [raw(p) for p in pages]
    finally:
        second.close()


# ---------------------------------------------------------------- faults


def test_a_corrupt_disk_file_is_a_miss_and_is_forgotten(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        k = hashes(1)[0]
        assert backend.set(k, page(pool, 1))
        (path,) = page_files(tmp_path / "kv")
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF  # one payload byte: the CRC no longer matches
        path.write_bytes(bytes(data))
        out = torch.full_like(page(pool, 0), 3)
        before = raw(out)
        assert backend.get(k, out) is None
        assert raw(out) == before  # no torn read: the destination is exactly as it was
        assert backend.exists(k) is False and backend.batch_exists([k]) == 0
        assert backend.store.stats().corrupt == 1
    finally:
        backend.close()


def test_a_redis_killed_mid_get_is_a_miss_and_the_out_tensor_is_unchanged(redis_server):
    armed = {"on": False}

    def kill(op, key):
        if op == "load" and armed["on"]:
            redis_server.stop()

    pool = HostPoolDouble()
    backend = build([redis(redis_server.url)], pool, fault_hook=kill)
    try:
        ks = hashes(2)
        assert backend.batch_set(ks, [page(pool, 1), page(pool, 2)])
        armed["on"] = True
        outs = [torch.full_like(page(pool, 0), 7) for _ in ks]
        before = [raw(o) for o in outs]
        assert backend.batch_get(ks, outs) == [None, None]
        assert [raw(o) for o in outs] == before
        assert backend.batch_exists(ks) == 0 and backend.exists(ks[0]) is False  # the server is gone: misses
    finally:
        backend.close()


def test_a_redis_killed_mid_set_is_a_failed_set_and_nothing_is_found(redis_server):
    def kill(op, key):
        if op == "store":
            redis_server.stop()

    pool = HostPoolDouble()
    backend = build([redis(redis_server.url)], pool, fault_hook=kill)
    try:
        k = hashes(1)[0]
        assert backend.set(k, page(pool, 1)) is False
        assert backend.batch_set(hashes(2, start=100), [page(pool, 2), page(pool, 3)]) is False
        assert backend.store.stats().num_pages == 0
        redis_server.start()  # back up, empty: the failed pages were never there
        assert backend.exists(k) is False and backend.get(k) is None
    finally:
        backend.close()


def test_a_redis_that_is_down_makes_the_chain_serve_from_disk(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv"), redis(f"redis://127.0.0.1:{free_port()}/0")], pool)
    try:
        k = hashes(1)[0]
        assert backend.set(k, page(pool, 4)) is True  # held by the disk tier
        assert raw(backend.get(k)) == raw(page(pool, 4))
    finally:
        backend.close()


def test_the_chain_promotes_a_page_found_only_in_redis_to_disk(tmp_path, redis_server):
    pool = HostPoolDouble()
    ks = hashes(1)
    writer = build([redis(redis_server.url)], pool)  # another instance sharing the Redis server
    assert writer.set(ks[0], page(pool, 8))
    writer.close()
    backend = build([disk(tmp_path / "kv"), redis(redis_server.url)], pool)
    try:
        disk_tier = backend.store.tiers[0]
        assert disk_tier.exists(ks) == [False]
        assert raw(backend.get(ks[0])) == raw(page(pool, 8))
        assert disk_tier.exists(ks) == [True]
        redis_server.stop()
        assert raw(backend.get(ks[0])) == raw(page(pool, 8))  # now local
    finally:
        backend.close()


# ---------------------------------------------------------------- the page interface (interface_v1)


@pytest.mark.parametrize(
    "kind,layout", [("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")]
)
def test_v1_page_methods_move_host_pool_pages_byte_exactly(tmp_path, kind, layout):
    pool = HostPoolDouble(kind=kind, layout=layout, head_dim=64 if kind == "mla" else 16)
    pool.fill(seed=11)
    backend = build([disk(tmp_path / "kv")], pool, is_mla_model=kind == "mla")
    try:
        ks = hashes(3)
        want = [pool.page_bytes_at(p * pool.page_size) for p in (1, 4, 2)]
        assert backend.batch_set_v1(ks, pool.slots(1, 4, 2)) == [True, True, True]
        assert backend.batch_exists(ks) == 3
        untouched = pool.page_bytes_at(0)
        assert backend.batch_get_v1(ks, pool.slots(5, 6, 7)) == [True, True, True]
        assert [pool.page_bytes_at(p * pool.page_size) for p in (5, 6, 7)] == want
        assert pool.page_bytes_at(0) == untouched
        # the generic interface reads what the page interface wrote (one byte order for both)
        assert [raw(g) for g in backend.batch_get(ks)] == want
    finally:
        backend.close()


def test_v1_batches_larger_than_the_scratch_are_byte_exact(tmp_path):
    pool = HostPoolDouble(num_pages=40)
    pool.fill(seed=21)
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        ks = hashes(20)  # more pages than one thread's scratch stages at a time (16)
        want = [pool.page_bytes_at(p * pool.page_size) for p in range(20)]
        assert backend.batch_set_v1(ks, pool.slots(*range(20))) == [True] * 20
        assert backend.batch_get_v1(ks, pool.slots(*range(20, 40))) == [True] * 20
        assert [pool.page_bytes_at(p * pool.page_size) for p in range(20, 40)] == want
    finally:
        backend.close()


@pytest.mark.parametrize(
    "kind,layout",
    [("mla", "page_first"), ("mha", "layer_first")],
    ids=["in-place", "via-a-flat-page"],  # MLA page-first pages are contiguous in the pool, MHA ones are not
)
def test_v1_get_leaves_the_slots_of_a_missing_page_as_they_were(tmp_path, kind, layout):
    pool = HostPoolDouble(kind=kind, layout=layout, head_dim=64 if kind == "mla" else 16)
    pool.fill(seed=3)
    backend = build([disk(tmp_path / "kv")], pool, is_mla_model=kind == "mla")
    try:
        ks = hashes(2)
        assert backend.batch_set_v1(ks[:1], pool.slots(0)) == [True]
        before = pool.page_bytes_at(3 * pool.page_size)
        assert backend.batch_get_v1(ks, pool.slots(2, 3)) == [True, False]
        assert pool.page_bytes_at(2 * pool.page_size) == pool.page_bytes_at(0)
        assert pool.page_bytes_at(3 * pool.page_size) == before
    finally:
        backend.close()


def test_v1_methods_refuse_host_indices_that_do_not_cover_the_keys(tmp_path):
    pool = HostPoolDouble()
    pool.fill(seed=1)
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        snapshot = raw(pool.kv_buffer)
        with pytest.raises(InvalidArgumentError, match="host_indices holds 16 slots; 2 pages of 16 slots need 32"):
            backend.batch_set_v1(hashes(2), pool.slots(1))
        with pytest.raises(InvalidArgumentError, match="host_indices holds 16 slots"):
            backend.batch_get_v1(hashes(2), pool.slots(1))
        assert backend.batch_exists(hashes(2)) == 0 and raw(pool.kv_buffer) == snapshot
    finally:
        backend.close()


# ---------------------------------------------------------------- ranks


def test_two_tensor_parallel_ranks_never_read_each_others_pages(tmp_path):
    pool = HostPoolDouble()
    ranks = [build([disk(tmp_path / "kv")], pool, tp_rank=r, tp_size=2) for r in (0, 1)]
    try:
        k = hashes(1)[0]
        assert ranks[0].set(k, page(pool, 1)) and ranks[1].set(k, page(pool, 2))
        assert raw(ranks[0].get(k)) == raw(page(pool, 1))
        assert raw(ranks[1].get(k)) == raw(page(pool, 2))
        other = build([disk(tmp_path / "kv")], pool, tp_rank=1, tp_size=4)  # another TP size: another shard
        assert other.exists(k) is False
        other.close()
    finally:
        for r in ranks:
            r.close()


def test_mla_pages_are_shared_by_every_rank_as_sglangs_backends_keep_them(redis_server):
    pool = HostPoolDouble(kind="mla", head_dim=64)
    ranks = [build([redis(redis_server.url)], pool, tp_rank=r, tp_size=2, is_mla_model=True) for r in (0, 1)]
    try:
        assert (
            ranks[0].layout == ranks[1].layout == "sglang;HostPoolDouble;layer_first;torch.bfloat16;page16;pp0/1;cp0/1"
        )
        k = hashes(1)[0]
        assert ranks[0].set(k, page(pool, 1))  # SGLang lets one rank write a replicated page
        assert ranks[1].exists(k) is True
        assert raw(ranks[1].get(k)) == raw(page(pool, 1))
    finally:
        for r in ranks:
            r.close()


def test_mla_over_several_ranks_refuses_a_disk_tier_that_one_process_owns(tmp_path):
    root = tmp_path / "kv"
    config = storage_config({**LOADER, "tiers": [disk(root)]}, tp_size=2, is_mla_model=True)
    with pytest.raises(InvalidArgumentError, match="use a Redis tier"):
        StorageBackendFactory.create_backend("dynamic", config, None)
    assert list(tmp_path.iterdir()) == []
    single = build([disk(root)], HostPoolDouble(kind="mla", head_dim=64), is_mla_model=True)  # one rank: fine
    single.close()


def test_data_parallel_groups_keep_their_own_pages(tmp_path):
    pool = HostPoolDouble()
    groups = [build([disk(tmp_path / "kv")], pool, dp_rank=d) for d in (0, 1)]  # one directory each
    try:
        assert groups[1].layout.endswith(";dp1")
        assert groups[0].set(hashes(1)[0], page(pool, 1)) and groups[1].exists(hashes(1)[0]) is False
    finally:
        for g in groups:
            g.close()


# ---------------------------------------------------------------- bad configuration


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"colour": "blue"}, r"unknown keys \['colour'\]"),
        ({"tiers": [{"type": "disk", "root": "ROOT", "capacity_bytes": -5}]}, "capacity_bytes"),
        ({"tiers": [{"type": "disk", "capacity_bytes": 1e9}]}, r"missing \['root'\]"),
        ({"tiers": [{"type": "disk", "root": "ROOT", "capacity_bytes": 1e9, "fsync": "often"}]}, "fsync"),
        ({"tiers": []}, "non-empty list 'tiers'"),
        ({"policy": "mru"}, "'policy' must be one of"),
        ({"model": ""}, "'model' must be a non-empty string"),
    ],
)
def test_a_bad_config_is_a_clear_error_at_construction_and_creates_nothing(tmp_path, extra, message):
    root = tmp_path / "kv"
    config = {**LOADER, "tiers": [disk(root)], **extra}
    config = json.loads(json.dumps(config).replace("ROOT", str(root)))
    with pytest.raises(InvalidArgumentError, match=message):
        StorageBackendFactory.create_backend("dynamic", storage_config(config), None)
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_no_model_name_from_sglang_or_the_config_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgumentError, match="SGLang gave no model name"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config({**LOADER, "tiers": [disk(tmp_path / "kv")]}, model_name=None), None
        )
    assert list(tmp_path.iterdir()) == []


def test_a_destination_of_the_wrong_size_is_refused_and_nothing_changes(tmp_path):
    pool = HostPoolDouble()
    backend = build([disk(tmp_path / "kv")], pool)
    try:
        k = hashes(1)[0]
        assert backend.set(k, page(pool, 1))
        short = torch.zeros(10, dtype=pool.dtype)
        with pytest.raises(InvalidArgumentError, match="holds 20 bytes, a page is 4096"):
            backend.get(k, short)
        with pytest.raises(InvalidArgumentError, match="holds 20 bytes, a page is 4096"):
            backend.set(hashes(1, start=50)[0], short)
        assert torch.equal(short, torch.zeros(10, dtype=pool.dtype))
        assert backend.exists(hashes(1, start=50)[0]) is False and backend.store.stats().num_pages == 1
    finally:
        backend.close()


def test_before_a_host_pool_is_registered_everything_misses(tmp_path):
    config = storage_config({**LOADER, "tiers": [disk(tmp_path / "kv")]})
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    try:
        k = hashes(1)[0]
        assert backend.exists(k) is False and backend.batch_exists([k]) == 0 and backend.get(k) is None
        assert backend.set(k, torch.zeros(8)) is False
        assert list(tmp_path.iterdir()) == []  # the store opens with the pool
    finally:
        backend.close()
