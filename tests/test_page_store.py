"""The engine-neutral page store under the SGLang and LMCache adapters: disk, Redis and the chain of both.

Every test drives the public API (``open_page_store``, ``PageStore``, ``ChainedPageStore``)
against real media: files under a temporary directory and a real ``redis-server``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tierutil import RedisServer

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.page_store import ChainedPageStore, PageStore, open_page_store, page_key

PAGE = 4096
MODEL = "test-model"
LAYOUT = "test-layout;tp=0/1"


def page(seed: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A page of distinct bytes for ``seed``, viewed as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g).view(dtype)


def empty(dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.full((PAGE,), 0xAB, dtype=torch.uint8).view(dtype)


def disk(root: Path, pages: int = 64, **extra) -> dict:
    # A page file is its payload plus header rounded up to 4 KiB: 8 KiB for a 4 KiB page.
    return {"type": "disk", "root": str(root), "capacity_bytes": pages * 8192, **extra}


def redis(url: str, **extra) -> dict:
    return {"type": "redis", "url": url, "timeout_s": 0.3, **extra}


def open_store(*tiers: dict, fault_hook=None, **top):
    return open_page_store({"tiers": list(tiers), **top}, page_bytes=PAGE, model=MODEL, layout=LAYOUT,
                           fault_hook=fault_hook)  # fmt: skip


@pytest.fixture(params=["disk", "redis", "chain"])
def store(request, tmp_path):
    if request.param == "disk":
        s = open_store(disk(tmp_path))
    else:
        server = RedisServer()
        request.addfinalizer(server.stop)
        s = open_store(redis(server.url)) if request.param == "redis" else open_store(disk(tmp_path), redis(server.url))
    yield s
    s.close()


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
def test_put_then_get_is_byte_identical_for_every_dtype(store, dtype):
    pages = [page(i, dtype) for i in range(5)]
    assert store.put([f"k{i}" for i in range(5)], pages) == [True] * 5
    outs = [empty(dtype) for _ in range(5)]
    assert store.get([f"k{i}" for i in range(5)], outs) == [True] * 5
    for got, want in zip(outs, pages, strict=True):
        assert got.view(torch.uint8).tolist() == want.view(torch.uint8).tolist()


def test_exists_and_prefix_hits_agree_with_what_was_stored(store):
    assert store.put(["a", "b", "d"], [page(1), page(2), page(4)]) == [True, True, True]
    assert store.exists(["a", "b", "c", "d"]) == [True, True, False, True]
    assert store.prefix_hits(["a", "b", "c", "d"]) == 2
    assert store.prefix_hits(["c", "a"]) == 0


def test_a_miss_leaves_the_buffer_exactly_as_it_was(store):
    store.put(["a"], [page(1)])
    outs = [empty(), empty()]
    assert store.get(["a", "zzz"], outs) == [True, False]
    assert outs[0].tolist() == page(1).tolist()
    assert outs[1].tolist() == empty().tolist()


def test_a_key_given_twice_is_stored_once_and_read_into_both_buffers(tmp_path):
    with open_store(disk(tmp_path)) as s:
        assert s.put(["a", "a"], [page(1), page(2)]) == [True, True]
        outs = [empty(), empty()]
        assert s.get(["a", "a"], outs) == [True, True]
        assert outs[0].tolist() == outs[1].tolist() == page(1).tolist()  # the first page wins
        assert s.stats().stored == 1


def test_a_stored_key_is_not_written_again(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a"], [page(1)])
        assert s.put(["a", "b"], [page(9), page(2)]) == [True, True]
        out = empty()
        s.get(["a"], [out])
        assert out.tolist() == page(1).tolist()
        assert (s.stats().puts, s.stats().stored) == (3, 2)


def test_pages_larger_than_the_staging_buffer_move_in_several_rounds(tmp_path):
    with open_store(disk(tmp_path), staging_bytes=2 * PAGE) as s:
        keys = [f"k{i}" for i in range(7)]
        assert s.put(keys, [page(i) for i in range(7)]) == [True] * 7
        outs = [empty() for _ in keys]
        assert s.get(keys, outs) == [True] * 7
        assert [o.tolist() for o in outs] == [page(i).tolist() for i in range(7)]


def test_bytes_int_and_str_keys_name_distinct_pages(tmp_path):
    with open_store(disk(tmp_path)) as s:
        keys = [b"\x01" * 32, 7, "7", "\x01" * 32]
        assert s.put(keys, [page(i) for i in range(4)]) == [True] * 4
        outs = [empty() for _ in keys]
        assert s.get(keys, outs) == [True] * 4
        assert [o.tolist() for o in outs] == [page(i).tolist() for i in range(4)]
    assert page_key("abc") == page_key("abc") != page_key("abd")
    assert len(page_key("abc")) == 32


# ---------------------------------------------------------------- eviction
def test_eviction_drops_the_least_recent_page_and_exists_says_so(tmp_path):
    with open_store(disk(tmp_path, pages=3)) as s:
        assert s.stats().capacity_pages == 3
        s.put(["a", "b", "c"], [page(1), page(2), page(3)])
        s.get(["a"], [empty()])  # a is now the most recent
        assert s.put(["d"], [page(4)]) == [True]
        assert s.exists(["a", "b", "c", "d"]) == [True, False, True, True]
        assert s.stats().evicted == 1
        assert len(page_files(tmp_path)) == 3  # the evicted page's file is deleted


def test_a_put_larger_than_the_store_keeps_the_first_pages_that_fit(tmp_path):
    with open_store(disk(tmp_path, pages=2)) as s:
        got = s.put(["a", "b", "c"], [page(1), page(2), page(3)])
        # key by key, first keys first: a and b are being written when c asks, so c finds no room
        assert got == [True, True, False]
        assert s.exists(["a", "b", "c"]) == [True, True, False]


# ---------------------------------------------------------------- faults
def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and "lock" not in p.name)


def test_a_corrupt_disk_file_is_a_miss_and_is_forgotten(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a", "b"], [page(1), page(2)])
        files = page_files(tmp_path)
        assert len(files) == 2
        for f in files:  # flip one payload byte of each file
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
        out = empty()
        assert s.get(["a"], [out]) == [False]
        assert out.tolist() == empty().tolist()
        assert s.exists(["a", "b"]) == [False, True]
        assert s.stats().corrupt == 1


def test_a_vanished_disk_file_is_a_miss(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a"], [page(1)])
        for f in page_files(tmp_path):
            f.unlink()
        assert s.get(["a"], [empty()]) == [False]
        assert s.exists(["a"]) == [False]


def test_a_restart_reads_the_pages_stored_before(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a", "b"], [page(1), page(2)])
    with open_store(disk(tmp_path)) as s:
        assert s.exists(["a", "b", "c"]) == [True, True, False]
        out = empty()
        assert s.get(["b"], [out]) == [True]
        assert out.tolist() == page(2).tolist()


def test_another_layout_never_reads_these_pages(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a"], [page(1)])
    other = open_page_store({"tiers": [disk(tmp_path)]}, page_bytes=PAGE, model=MODEL, layout="tp=1/2")
    with other:
        assert other.exists(["a"]) == [False]
        assert other.get(["a"], [empty()]) == [False]


def test_a_failed_disk_write_is_a_failed_put_and_leaves_no_file(tmp_path):
    def fail(op, key):
        if op == "store":
            raise OSError(5, "injected I/O error")

    with open_store(disk(tmp_path), fault_hook=fail) as s:
        assert s.put(["a"], [page(1)]) == [False]
        assert s.exists(["a"]) == [False]
        assert [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".tmp"] == []
        assert s.stats().num_pages == 0


def test_redis_down_is_a_miss_and_a_failed_put(redis_server):
    with open_store(redis(redis_server.url)) as s:
        s.put(["a"], [page(1)])
        redis_server.stop()
        out = empty()
        assert s.get(["a"], [out]) == [False]
        assert out.tolist() == empty().tolist()
        assert s.put(["b"], [page(2)]) == [False]
        assert s.exists(["a", "b"]) == [False, False]


def test_redis_killed_mid_get_is_a_miss_and_the_buffer_is_untouched(redis_server):
    def kill(op, key):
        if op == "load":
            redis_server.stop()

    with open_store(redis(redis_server.url), fault_hook=kill) as s:
        assert s.put(["a", "b"], [page(1), page(2)]) == [True, True]
        outs = [empty(), empty()]
        assert s.get(["a", "b"], outs) == [False, False]
        assert [o.tolist() for o in outs] == [empty().tolist()] * 2


def test_redis_killed_mid_put_is_a_failed_put(redis_server):
    def kill(op, key):
        if op == "store":
            redis_server.stop()

    with open_store(redis(redis_server.url), fault_hook=kill) as s:
        assert s.put(["a"], [page(1)]) == [False]
        assert s.stats().num_pages == 0


def test_redis_pages_are_shared_by_a_second_process_store(redis_server):
    with open_store(redis(redis_server.url)) as first, open_store(redis(redis_server.url)) as second:
        first.put(["a"], [page(1)])
        assert second.exists(["a", "b"]) == [True, False]
        out = empty()
        assert second.get(["a"], [out]) == [True]
        assert out.tolist() == page(1).tolist()


# ---------------------------------------------------------------- the chain
def test_the_chain_writes_through_and_promotes_what_it_finds_below(tmp_path, redis_server):
    with open_store(disk(tmp_path), redis(redis_server.url)) as chain:
        assert isinstance(chain, ChainedPageStore)
        local, remote = chain.tiers
        chain.put(["a"], [page(1)])
        assert local.exists(["a"]) == remote.exists(["a"]) == [True]
        local.remove(["a"])
        assert (local.exists(["a"]), chain.exists(["a"])) == ([False], [True])
        out = empty()
        assert chain.get(["a"], [out]) == [True]
        assert out.tolist() == page(1).tolist()
        assert local.exists(["a"]) == [True]  # promoted
        assert (local.stats().hits, remote.stats().hits) == (0, 1)


def test_the_chain_serves_from_disk_while_redis_is_down(tmp_path, redis_server):
    with open_store(disk(tmp_path), redis(redis_server.url)) as chain:
        chain.put(["a"], [page(1)])
        redis_server.stop()
        out = empty()
        assert chain.get(["a", "b"], [out, empty()]) == [True, False]
        assert out.tolist() == page(1).tolist()
        assert chain.put(["c"], [page(3)]) == [True]  # the disk tier still stores


def test_remove_and_clear(store):
    store.put(["a", "b", "c"], [page(1), page(2), page(3)])
    store.remove(["a", "nope"])
    assert store.exists(["a", "b", "c"]) == [False, True, True]
    store.clear()
    assert store.exists(["a", "b", "c"]) == [False, False, False]


def test_concurrent_puts_and_gets_from_many_threads_stay_byte_exact(tmp_path):
    errors: list[BaseException] = []
    with open_store(disk(tmp_path, pages=256), staging_bytes=3 * PAGE) as s:

        def work(t: int) -> None:
            try:
                keys = [f"t{t}-{i}" for i in range(12)]
                assert s.put(keys, [page(100 * t + i) for i in range(12)]) == [True] * 12
                outs = [empty() for _ in keys]
                assert s.get(keys, outs) == [True] * 12
                assert [o.tolist() for o in outs] == [page(100 * t + i).tolist() for i in range(12)]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert s.stats().num_pages == 72
        s.store.check_invariants()
        assert (s.store.num_pinned, s.store.num_pending) == (0, 0)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: [page(1)[:100]], "holds 100 bytes"),
        (lambda: [page(1).view(torch.uint8).reshape(64, 64).t()], "contiguous"),
        (lambda: [page(1), page(2)], "1 keys and 2 pages"),
        (lambda: [object()], "CPU tensor or a buffer"),
    ],
)
def test_a_bad_page_is_refused_and_nothing_is_stored(tmp_path, bad, message):
    with open_store(disk(tmp_path)) as s:
        s.put(["keep"], [page(0)])
        before = (s.stats(), page_files(tmp_path))
        with pytest.raises(InvalidArgumentError, match=message):
            s.put(["a"], bad())
        assert (s.stats(), page_files(tmp_path)) == before


def test_a_bad_key_or_read_only_buffer_is_refused_before_anything_moves(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a"], [page(1)])
        before = s.stats()
        with pytest.raises(InvalidArgumentError, match="page key"):
            s.put(["b", None], [page(2), page(3)])
        with pytest.raises(InvalidArgumentError, match="page key"):
            s.get([b""], [empty()])
        with pytest.raises(InvalidArgumentError, match="writable"):
            s.get(["a"], [bytes(PAGE)])
        assert s.stats() == before
        assert s.exists(["b"]) == [False]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"tiers": []}, "non-empty list 'tiers'"),
        ({"tiers": [{"type": "tape"}]}, "type must be one of"),
        ({"tiers": [{"type": "disk", "root": "R"}]}, "missing \\['capacity_bytes'\\]"),
        ({"tiers": [{"type": "disk", "root": "R", "capacity_bytes": -5}]}, "capacity_bytes"),
        ({"tiers": [{"type": "disk", "root": "R", "capacity_bytes": 1e6, "colour": 1}]}, "unknown keys \\['colour'\\]"),
        ({"tiers": [{"type": "disk", "root": "R", "capacity_bytes": 1e6, "fsync": "often"}]}, "fsync"),
        ({"tiers": [{"type": "redis", "url": "redis://x", "timeout_s": -1}]}, "timeout_s"),
        ({"tiers": [{"type": "disk", "root": "R", "capacity_bytes": 1e6}], "colour": 1}, "unknown page store"),
    ],
)
def test_a_bad_config_is_refused_and_creates_nothing(tmp_path, monkeypatch, config, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match=message):
        open_page_store(config, page_bytes=PAGE, model=MODEL, layout=LAYOUT)
    assert list(tmp_path.iterdir()) == []


def test_a_closed_store_refuses_calls(tmp_path):
    s = open_store(disk(tmp_path))
    s.close()
    s.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        s.put(["a"], [page(1)])
    assert isinstance(s, PageStore)


# ---------------------------------------------------------------- holds
def test_a_held_page_survives_puts_that_fill_the_store_until_it_is_released(tmp_path):
    with open_store(disk(tmp_path, pages=2)) as s:
        s.put(["a", "b"], [page(1), page(2)])
        assert s.hold(["a", "zzz"]) == [True, False]
        assert (s.num_holds("a"), s.num_holds("zzz")) == (1, 0)
        assert s.put(["c"], [page(3)]) == [True]  # evicts b, the only page not held
        assert s.exists(["a", "b", "c"]) == [True, False, True]
        assert s.put(["d"], [page(4)]) == [True]  # evicts c; a is still held
        assert s.exists(["a", "c", "d"]) == [True, False, True]
        s.release(["a"])
        assert s.num_holds("a") == 0
        s.get(["d"], [empty()])
        assert s.put(["e"], [page(5)]) == [True]  # a is evictable again, and the least recent
        assert s.exists(["a", "d", "e"]) == [False, True, True]


def test_releasing_more_holds_than_were_made_is_refused_and_releases_nothing(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a", "b"], [page(1), page(2)])
        s.hold(["a", "b"])
        with pytest.raises(InvalidArgumentError, match="cannot release 2 hold"):
            s.release(["b", "a", "a"])
        assert (s.num_holds("a"), s.num_holds("b")) == (1, 1)
        s.release(["a", "b"])
        assert (s.store.num_pinned, s.num_holds("a")) == (0, 0)


def test_a_held_page_that_is_removed_goes_when_its_hold_is_released(tmp_path):
    with open_store(disk(tmp_path)) as s:
        s.put(["a"], [page(1)])
        s.hold(["a"])
        s.remove(["a"])
        out = empty()
        assert s.get(["a"], [out]) == [True]  # still readable while held
        s.release(["a"])
        assert s.exists(["a"]) == [False]
        assert page_files(tmp_path) == []


def test_the_chain_releases_a_hold_in_exactly_the_tiers_that_made_it(tmp_path, redis_server):
    with open_store(disk(tmp_path), redis(redis_server.url)) as chain:
        local, remote = chain.tiers
        chain.put(["a"], [page(1)])
        local.remove(["a"])
        assert chain.hold(["a"]) == [True]  # held in Redis only
        chain.get(["a"], [empty()])  # promoted to disk
        assert chain.hold(["a"]) == [True]  # held in both
        assert (local.num_holds("a"), remote.num_holds("a"), chain.num_holds("a")) == (1, 2, 2)
        chain.release(["a"])
        assert (local.num_holds("a"), remote.num_holds("a")) == (0, 1)
        chain.release(["a"])
        assert (local.num_holds("a"), remote.num_holds("a"), chain.num_holds("a")) == (0, 0, 0)
        with pytest.raises(InvalidArgumentError, match="cannot release"):
            chain.release(["a"])
