"""The real engine with tiers below the CPU: a prefix evicted from the GPU and the CPU comes back from disk or Redis.

Each scenario serves one request, then fillers one after another (they push its
prefix out of the GPU and out of a CPU tier of 7 blocks), then a request with
the same prefix.  Every request's tokens must equal the request run alone, and
its logits must be within ``LOGIT_TOL`` of it (``test_engine_exact.check``);
the manager's counters (public API) prove which tier the prefix came from.
Faults (a full disk, a corrupt block file, a Redis server that dies while
storing or loading) must only cost recomputation: the same tokens, and the
manager's invariants hold after every run.
"""

from __future__ import annotations

import errno
import random
import threading

import pytest
from engine_configs import engine_config
from test_engine_exact import LAYOUTS, MAX_TOKENS, check
from tierutil import NS, host

from tiered_kv.core import BlockHasher
from tiered_kv.core.request import Request
from tiered_kv.engine.engine import Engine
from tiered_kv.errors import InvalidArgumentError, StorageError
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.kinds.disk import DiskTierConfig
from tiered_kv.tiers.kinds.redis import RedisTierConfig
from tiered_kv.tiers.stack import TierStack

_rng = random.Random(4)
PREFIX = [_rng.randrange(512) for _ in range(24)]  # six blocks of four tokens
FIRST = {0: [*PREFIX, 1, 2, 3]}
FILLERS = [{i: [_rng.randrange(512) for _ in range(20)]} for i in (1, 2, 3)]
LATER = {4: [*PREFIX, 9, 8, 7, 6]}
EVERYONE = {**FIRST, **FILLERS[0], **FILLERS[1], **FILLERS[2], **LATER}


def tiered(*tiers, **kw) -> Engine:
    """An engine whose CPU tier holds 7 blocks: the fillers evict the prefix from it (and from the GPU)."""
    config = engine_config(num_gpu_blocks=24, num_cpu_blocks=8, offload="write_through", record_logits=True, **kw)
    return Engine(config=config, tiers=list(tiers))


def serve(engine: Engine, groups: list[dict[int, list[int]]]) -> None:
    """Serve each group to the end (every copy settled), checking the manager's invariants after each."""
    for group in groups:
        for rid, prompt in group.items():
            engine.add_request(rid, prompt, MAX_TOKENS)
        engine.run()
        engine.scheduler.tm.check_invariants()


def prefix_keys() -> list[bytes]:
    return BlockHasher.create(4, "sha256", seed=0).update(Request("k", PREFIX))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prefix_evicted_from_gpu_and_cpu_is_loaded_from_disk_with_the_same_tokens(tmp_path, layout):
    e = tiered(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 22), layout=layout)
    serve(e, [FIRST, *FILLERS])
    assert not any(e.scheduler.tm.store.contains(k) for k in prefix_keys())  # gone from the CPU tier
    assert e.metrics().lower_tiers["DISK"].loaded_blocks == 0
    serve(e, [LATER])
    e.close()
    m = e.metrics()
    d = m.lower_tiers["DISK"]
    assert d.loaded_blocks >= 5 and d.loaded_blocks == d.hit_blocks and d.load_failed_blocks == 0
    assert d.stored_blocks >= 6 and m.chain_lost_blocks == 0
    assert m.counters.onboard_blocks == d.loaded_blocks  # every block loaded came through the CPU tier
    assert e.tier_stack.engines["DISK"].stats.blocks_loaded == d.loaded_blocks
    check(e, EVERYONE, layout, exact_logits=False)


def test_a_restarted_engine_finds_the_prefix_its_predecessor_left_on_disk(tmp_path):
    first = tiered(DiskTierConfig(path=tmp_path))
    serve(first, [FIRST])  # the run ends with its CPU tier written back
    first.close()
    assert first.metrics().lower_tiers["DISK"].stored_blocks >= 6
    e = tiered(DiskTierConfig(path=tmp_path))
    assert e.tier_stack.stores["DISK"].disk_stats.recovered >= 6
    serve(e, [LATER])
    e.close()
    d = e.metrics().lower_tiers["DISK"]
    assert d.loaded_blocks == d.hit_blocks == 6 and e.metrics().counters.gpu_hit_tokens == 0
    for rid, tokens in first.outputs.items():
        e.outputs[rid], e.logits[rid] = tokens, first.logits[rid]
    check(e, {**FIRST, **LATER}, "block_contiguous", exact_logits=False)


def test_a_prefix_evicted_from_gpu_and_cpu_is_loaded_from_a_real_redis_server(redis_server):
    e = tiered(RedisTierConfig(server=redis_server.url))
    serve(e, [FIRST, *FILLERS, LATER])
    e.close()
    m = e.metrics()
    r = m.lower_tiers["REMOTE"]
    assert r.loaded_blocks >= 5 and r.load_failed_blocks == 0 and r.stored_blocks >= 6
    assert e.tier_stack.stores["REMOTE"].remote_stats.health.errors == 0
    assert "DISK" not in m.lower_tiers
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_with_three_tiers_a_prefix_that_fell_out_of_a_small_disk_too_comes_back_from_redis(tmp_path, redis_server):
    e = tiered(
        DiskTierConfig(path=tmp_path, capacity_bytes=4 * 8192), RedisTierConfig(server=redis_server.url)
    )  # the disk holds 4 blocks
    serve(e, [FIRST, *FILLERS])
    assert not any(e.tier_stack.stores["DISK"].contains(k) for k in prefix_keys())
    serve(e, [LATER])
    e.close()
    m = e.metrics()
    d, r = m.lower_tiers["DISK"], m.lower_tiers["REMOTE"]
    assert d.stored_blocks >= 6 and r.stored_blocks >= 6  # every tier wrote the prefix back before evicting it
    assert r.hit_blocks == r.loaded_blocks >= 5 and d.loaded_blocks == 0
    assert d.load_failed_blocks == r.load_failed_blocks == 0
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_a_full_disk_costs_only_recomputation(tmp_path):
    e = tiered(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 22))

    def full(op: str, key: object) -> None:
        if op == "store":
            raise OSError(errno.ENOSPC, "injected: no space left on device")

    e.tier_stack.engines["DISK"].fault_hook = full
    serve(e, [FIRST, *FILLERS, LATER])
    e.close()
    m = e.metrics()
    d = m.lower_tiers["DISK"]
    assert d.stored_blocks == 0 and d.store_failed_blocks >= 6 and d.loaded_blocks == 0
    assert m.chain_lost_blocks >= 6  # the prefix left the CPU tier with no copy below: it was recomputed
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_a_corrupt_block_file_ends_the_loaded_prefix_and_the_rest_is_recomputed(tmp_path):
    e = tiered(DiskTierConfig(path=tmp_path, capacity_bytes=1 << 22))
    serve(e, [FIRST, *FILLERS])
    path = e.tier_stack.stores["DISK"].path_of(prefix_keys()[3])
    torn = path.read_bytes()
    path.write_bytes(torn[: len(torn) // 2])  # a torn write: half a block under the block's name
    serve(e, [LATER])
    e.close()
    d = e.metrics().lower_tiers["DISK"]
    assert d.load_failed_blocks == 1 and d.loaded_blocks >= 3  # the blocks before it (and after it) landed
    assert e.metrics().counters.onboard_blocks < d.hit_blocks  # only the blocks before it went to the GPU
    # The torn file was forgotten (deleted); the block, recomputed, may have been written back whole since.
    assert not path.exists() or path.stat().st_size == len(torn)
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_redis_dying_mid_store_costs_only_recomputation(redis_server):
    e = tiered(RedisTierConfig(server=redis_server.url))

    def die(op: str, key: object) -> None:
        if op == "store":
            redis_server.stop()

    e.tier_stack.engines["REMOTE"].fault_hook = die
    serve(e, [FIRST, *FILLERS, LATER])
    e.close()
    r = e.metrics().lower_tiers["REMOTE"]
    assert r.store_failed_blocks >= 1 and r.stored_blocks == 0 and r.loaded_blocks == 0
    assert e.tier_stack.stores["REMOTE"].remote_stats.health.errors >= 1
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_redis_dying_mid_load_costs_only_recomputation(redis_server):
    e = tiered(RedisTierConfig(server=redis_server.url))
    serve(e, [FIRST, *FILLERS])
    assert e.metrics().lower_tiers["REMOTE"].stored_blocks >= 6

    def die(op: str, key: object) -> None:
        if op == "load":
            redis_server.stop()

    e.tier_stack.engines["REMOTE"].fault_hook = die
    serve(e, [LATER])
    e.close()
    r = e.metrics().lower_tiers["REMOTE"]
    assert r.hit_blocks >= 5 and r.load_failed_blocks >= 1 and r.loaded_blocks == 0
    assert e.metrics().counters.onboard_blocks == 0
    check(e, EVERYONE, "block_contiguous", exact_logits=False)


def test_bad_tier_options_fail_and_leave_nothing_open(tmp_path):
    threads = set(threading.enumerate())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="cannot use directory"):
        Engine(tiers=[DiskTierConfig(path=blocker / "tiers")])
    with pytest.raises(InvalidArgumentError, match="write_policy must be one of"):
        Engine(tiers=[DiskTierConfig(path=tmp_path / "d", write_policy="sideways")])
    with pytest.raises(InvalidArgumentError, match="num_cpu_blocks=0"):
        Engine(config=engine_config(num_cpu_blocks=0), tiers=[DiskTierConfig(path=tmp_path / "d")])
    with pytest.raises(
        InvalidArgumentError, match=r"tiers must have distinct media below the CPU, got \['DISK', 'DISK'\]"
    ):
        Engine(tiers=[DiskTierConfig(path=tmp_path / "d"), DiskTierConfig(path=tmp_path / "e")])
    with pytest.raises(InvalidArgumentError, match=r"DiskTierConfig.link must be a TierLink"):
        DiskTierConfig(path=tmp_path / "d", link=(1e9, 0.0))
    assert not (tmp_path / "d").exists()  # refused before a directory was made
    e = Engine(tiers=[DiskTierConfig(path=tmp_path / "d")])
    with pytest.raises(StorageError, match="in use by another store"):
        Engine(tiers=[DiskTierConfig(path=tmp_path / "d")])
    e.close()
    Engine(tiers=[DiskTierConfig(path=tmp_path / "d")]).close()  # closing released the directory
    for _ in range(1000):
        if set(threading.enumerate()) <= threads:
            break
        threading.Event().wait(0.01)
    assert set(threading.enumerate()) <= threads


def test_a_tier_stack_needs_a_tier_below_and_caps_write_back_at_what_that_tier_holds(tmp_path):
    cpu = CPUStore(9)
    with pytest.raises(InvalidArgumentError, match="needs at least one tier below the CPU"):
        TierStack(cpu, host(num_blocks=9), NS, [])
    with pytest.raises(InvalidArgumentError, match="does not match its store"):
        TierStack(cpu, host(num_blocks=5), NS, [DiskTierConfig(path=tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before anything was made
    with TierStack(cpu, host(num_blocks=9), NS, [DiskTierConfig(path=tmp_path, capacity_bytes=3 * 4096)]) as stack:
        assert [t.medium for t in stack.entries] == ["DISK"] and list(stack.engines) == ["DISK"]
        assert [t.writeback_reserve for t in stack.entries] == [3]  # 3: all the disk holds
        assert [t.write_policy for t in stack.entries] == ["write_back"]


@pytest.mark.parametrize(("old", "new"), [("DiskTier", DiskTierConfig), ("RedisTier", RedisTierConfig)])
def test_the_old_names_of_the_tier_kinds_still_work_with_a_warning(old, new):
    """``DiskTier`` and ``RedisTier`` are the vLLM plug-in's classes; the kinds' configs were renamed."""
    import tiered_kv.tiers as tiers

    with pytest.warns(DeprecationWarning, match=rf"tiered_kv\.tiers\.{old} is now tiered_kv\.tiers\.{new.__name__}"):
        assert getattr(tiers, old) is new
    assert old not in tiers.__all__ and new.__name__ in tiers.__all__
