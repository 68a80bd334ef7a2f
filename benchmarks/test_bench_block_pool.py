"""pytest-benchmark version of ``bench_block_pool.py``'s pool-call section (collected only by ``pytest benchmarks``).

Run, and compare with the last saved run (see ``docs/benchmarks.md``)::

    .venv/bin/python -m pytest benchmarks --benchmark-enable --benchmark-autosave
    .venv/bin/python -m pytest benchmarks --benchmark-enable --benchmark-compare

Each group replays one recorded pool-call sequence against our ``BlockPool`` and
against vLLM 0.33.0's own ``BlockPool`` (imported from its source by
``tests/vllm_ref_core.py``; left out, with the reason, where the source cannot be
had), so the factor pytest-benchmark prints beside each time is the ratio between
them, measured in the same run.  Every replay starts from a
fresh pool built outside the timing.  Without ``--benchmark-enable`` (the
project's default options) each case runs once, checked, as a smoke test.
"""

from __future__ import annotations

import _pool_log as pl
import pytest
from _trace import BLOCK_SIZE, drive, make_trace, precompute_hashes

NUM_REQUESTS = 2000  # a tenth of the script's trace: a few seconds per round
NUM_BLOCKS = 6000
ROUNDS = 5

_real, _why = pl.real_vllm()
TARGETS = {"tiered_kv": pl.ours()}
if _real is not None:
    TARGETS["vllm"] = _real


@pytest.fixture(scope="module")
def trace_log() -> pl.PoolLog:
    trace = make_trace(NUM_REQUESTS, seed=0)
    hashes = precompute_hashes(trace, "sha256")[0]
    return pl.record_pool_log(lambda mgr: drive(mgr, trace, hashes, 64), NUM_BLOCKS, BLOCK_SIZE)


@pytest.mark.parametrize("name", list(TARGETS))
def test_pool_calls(benchmark, trace_log, name):
    """The whole recorded sequence: lookups, allocations, caching, touches and frees."""
    target = TARGETS[name]
    benchmark.group = "pool calls (2000-request trace)"
    benchmark.extra_info["calls"] = len(trace_log.calls)
    benchmark.extra_info["block_ops"] = sum(trace_log.units().values())
    if benchmark.disabled:  # the smoke run checks the decisions too
        _, pool = benchmark(pl.run, target, trace_log, True)
        assert target.cached_ids(pool)
        return
    benchmark.pedantic(pl.play, setup=lambda: (pl.setup(target, trace_log)[1:], {}), rounds=ROUNDS)


PREFIX = 64  # blocks in the cached prefix the micro-benchmarks work on
LOOPS = 500  # operations per timed round


def _cached_prefix(target: pl.Target) -> tuple[object, list, list]:
    """A pool whose free queue ends with a 64-block cached prefix: (pool, its hashes, its blocks)."""
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(PREFIX)]
    log = pl.PoolLog(NUM_BLOCKS, BLOCK_SIZE)
    log.calls = [
        ("allocate", PREFIX, list(range(1, PREFIX + 1))),
        ("cache", hashes, list(range(1, PREFIX + 1)), 0, PREFIX),
        ("free", list(range(PREFIX, 0, -1))),
    ]
    pool, ops, fns = pl.setup(target, log)
    pl.play(ops, fns)
    return pool, hashes, [pool.blocks[i] for i in range(1, PREFIX + 1)]


def _lookups(lookup, probes: list) -> None:
    for _ in range(LOOPS):
        lookup(probes)


def _touch_free(touch, free, blocks: list, reverse: list) -> None:
    for _ in range(LOOPS):
        touch(blocks)
        free(reverse)


def _allocate_free(get_new, free) -> None:
    for _ in range(LOOPS):
        free(get_new(16)[::-1])


@pytest.mark.parametrize("name", list(TARGETS))
def test_prefix_lookup(benchmark, name):
    """A 64-block cached prefix probed to its first miss, as a manager does on admission."""
    target = TARGETS[name]
    benchmark.group = f"lookup: {PREFIX}-block prefix hit, then a miss (x{LOOPS})"
    pool, hashes, _ = _cached_prefix(target)
    lookup = target.bind(pool)[0]
    probes = [*hashes, b"\xff" * 32]
    assert len(lookup(probes)) == PREFIX
    benchmark.pedantic(_lookups, args=(lookup, probes), rounds=ROUNDS)


@pytest.mark.parametrize("name", list(TARGETS))
def test_touch_then_free(benchmark, name):
    """Hits on a free cached prefix pulled out of the queue, then freed back, deepest first."""
    target = TARGETS[name]
    benchmark.group = f"touch + free: {PREFIX} cached free blocks (x{LOOPS})"
    pool, _, blocks = _cached_prefix(target)
    _, _, touch, free, _ = target.bind(pool)
    benchmark.pedantic(
        _touch_free, args=(touch, free, blocks, blocks[::-1]), rounds=1 if benchmark.disabled else ROUNDS
    )
    assert target.cached_ids(pool) == [b.block_id for b in blocks]


@pytest.mark.parametrize("name", list(TARGETS))
def test_allocate_then_free(benchmark, name):
    """16 blocks taken from the front and given back (no hash: they return to the front)."""
    target = TARGETS[name]
    benchmark.group = f"get_new_blocks(16) + free (x{LOOPS})"
    pool, _, _ = _cached_prefix(target)
    _, get_new, _, free, _ = target.bind(pool)
    benchmark.pedantic(_allocate_free, args=(get_new, free), rounds=ROUNDS)
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
