"""Record a trace's block-pool calls once; replay them against any pool, timed and checked.

The recorder drives the trace through our ``KVCacheManager`` over a recording
``BlockPool`` and logs every pool call in block ids, so that the same sequence can
be replayed against our ``BlockPool`` and against vLLM 0.33.0's own ``BlockPool``
(imported from vLLM's source by ``tests/vllm_ref_core.py``).  Each replay first
checks that the pool hands out the logged block ids and finds the logged hits,
call for call, and ends with the same free-queue order and cached set.

Lookups are replayed the way each side's manager probes: vLLM's
``find_longest_cache_hit`` calls ``get_cached_block(hash, group_ids)`` once per
block until the first miss; ours calls ``get_cached_prefix(hashes)`` once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

from tiered_kv.core import BlockPool, KVCacheManager, Request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

KINDS = ("allocate", "cache", "lookup", "free", "touch")
UNITS = {"allocate": "block", "cache": "block", "lookup": "probe", "free": "block", "touch": "block"}
_OP = {"lookup": 0, "allocate": 1, "touch": 2, "free": 3, "cache": 4}
# The clock of run(): the wall clock, or time.process_time (CPU seconds of this process), which a
# loaded shared machine disturbs less (bench_block_pool.py --clock cpu).
clock = time.perf_counter


@dataclass
class PoolLog:
    """A pool-call sequence in block ids (see :func:`record_pool_log`)."""

    num_blocks: int
    block_size: int
    calls: list[tuple] = field(default_factory=list)
    evicted: int = 0  # blocks handed out that still carried a hash (lazy evictions)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for c in self.calls:
            out[c[0]] += 1
        return out

    def units(self) -> dict[str, int]:
        """Blocks (or probes, for lookups) per kind of call."""
        out = dict.fromkeys(KINDS, 0)
        for c in self.calls:
            kind = c[0]
            if kind == "allocate":
                out[kind] += c[1]
            elif kind == "cache":
                out[kind] += c[4] - c[3]
            else:
                out[kind] += len(c[1])
        return out


class _RecordingPool(BlockPool):
    """Our pool, logging each call our manager makes (in block ids) before making it."""

    def __init__(self, num_blocks: int, log: PoolLog) -> None:
        super().__init__(num_blocks)
        self.log = log

    def get_cached_prefix(self, block_hashes, max_blocks=None):
        hits = super().get_cached_prefix(block_hashes, max_blocks)
        cap = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        # What vLLM's probe loop reads: each hit, then the first miss (if the cap allows one).
        self.log.calls.append(("lookup", list(block_hashes[: min(len(hits) + 1, cap)]), len(hits)))
        return hits

    def get_new_blocks(self, num_blocks):
        self.log.evicted += sum(1 for b in self.peek_free_blocks(num_blocks) if b.block_hash is not None)
        ret = super().get_new_blocks(num_blocks)
        self.log.calls.append(("allocate", num_blocks, [b.block_id for b in ret]))
        return ret

    def touch(self, blocks):
        blocks = list(blocks)
        self.log.calls.append(("touch", [b.block_id for b in blocks]))
        super().touch(blocks)

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        self.log.calls.append(("free", [b.block_id for b in blocks]))
        super().free_blocks(blocks)

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size):
        if num_full_blocks > num_cached_blocks:
            ids = [b.block_id for b in blocks[:num_full_blocks]]
            self.log.calls.append(("cache", request.block_hashes, ids, num_cached_blocks, num_full_blocks))
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)


def record_pool_log(drive: Callable[[object], object], num_blocks: int, block_size: int) -> PoolLog:
    """Run ``drive(manager)`` over our manager on a recording pool; return its pool calls."""
    log = PoolLog(num_blocks, block_size)
    drive(KVCacheManager(block_size=block_size, block_pool=_RecordingPool(num_blocks, log), log_stats=False))
    return log


# ---------------------------------------------------------------- replay targets
def _vllm_lookup(pool) -> Callable[[list], list]:
    """vLLM's ``find_longest_cache_hit`` probe loop for one full-attention group."""
    get_cached_block = pool.get_cached_block
    group_ids = [0]

    def lookup(block_hashes: list) -> list:
        computed_blocks: tuple[list, ...] = tuple([] for _ in range(len(group_ids)))
        for block_hash in islice(block_hashes, len(block_hashes)):
            cached_block = get_cached_block(block_hash, group_ids)
            if not cached_block:
                break
            for computed, cached in zip(computed_blocks, cached_block, strict=False):
                computed.append(cached)
        return computed_blocks[0]

    return lookup


@dataclass
class Target:
    """One pool implementation the log can be replayed against."""

    name: str
    make: Callable[[int, int], object]
    vllm_api: bool  # vLLM's signatures (group ids) rather than ours

    def bind(self, pool) -> tuple:
        """(lookup, get_new_blocks, touch, free_blocks, cache_full_blocks) of ``pool``."""
        lookup = _vllm_lookup(pool) if self.vllm_api else pool.get_cached_prefix
        return lookup, pool.get_new_blocks, pool.touch, pool.free_blocks, pool.cache_full_blocks

    def free_ids(self, pool) -> list[int]:
        """Free block ids, front first (not timed)."""
        if self.vllm_api:
            return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        return pool.free_queue_ids()

    @staticmethod
    def cached_ids(pool) -> list[int]:
        return sorted(b.block_id for b in pool.blocks if b.block_hash is not None)


def ours() -> Target:
    return Target("tiered_kv BlockPool", lambda n, bs: BlockPool(n), vllm_api=False)


def real_vllm() -> tuple[Target | None, str]:
    """vLLM 0.33.0's own ``BlockPool``, loaded from its source, else ``None`` and why not."""
    try:
        import vllm_ref_core
        from vllm_source import VLLM_VERSION

        ref = vllm_ref_core.load()
    except BaseException as exc:  # no source and no network: vllm_source skips (a BaseException)
        return None, f"{type(exc).__name__}: {exc}"
    target = Target(f"vLLM {VLLM_VERSION} BlockPool", lambda n, bs: ref.BlockPool(n, True, bs), vllm_api=True)
    return target, VLLM_VERSION


def prepare(target: Target, pool, log: PoolLog) -> list[tuple]:
    """The log as ``(op, args)`` with ``pool``'s own block objects, built before timing."""
    blocks = pool.blocks
    requests: dict[int, object] = {}
    ops: list[tuple] = []
    for c in log.calls:
        kind = c[0]
        if kind == "lookup":
            ops.append((0, c[1], c[2]))
        elif kind == "allocate":
            ops.append((1, c[1], c[2]))
        elif kind in ("touch", "free"):
            ops.append((_OP[kind], [blocks[i] for i in c[1]]))
        else:
            hashes, ids, n_cached, n_full = c[1], c[2], c[3], c[4]
            req = requests.get(id(hashes))
            if req is None:
                if target.vllm_api:
                    req = SimpleNamespace(block_hashes=hashes)
                else:
                    req = Request(len(requests), [1])
                    req.block_hashes = hashes
                requests[id(hashes)] = req
            table = [blocks[i] for i in ids]
            args = (req, table, n_cached, n_full, log.block_size)
            ops.append((4, (*args, 0) if target.vllm_api else args))
    return ops


def setup(target: Target, log: PoolLog) -> tuple[object, list[tuple], tuple]:
    """A fresh pool of ``target``, the log as its calls, and its bound methods (nothing timed)."""
    pool = target.make(log.num_blocks, log.block_size)
    return pool, prepare(target, pool, log), target.bind(pool)


def play(ops: list[tuple], fns: tuple) -> None:
    """Make the calls: the timed part of a replay."""
    lookup, get_new, touch, free, cache = fns
    for op in ops:
        k = op[0]
        if k == 1:
            get_new(op[1])
        elif k == 0:
            lookup(op[1])
        elif k == 2:
            touch(op[1])
        elif k == 3:
            free(op[1])
        else:
            cache(*op[1])


def run(target: Target, log: PoolLog, check: bool = False) -> tuple[float, object]:
    """Replay ``log`` against a fresh pool of ``target``; return (seconds in pool calls, pool).

    With ``check``, every allocation must return the logged block ids and every
    lookup find the logged number of hits (raises ``AssertionError`` if not).
    """
    pool, ops, fns = setup(target, log)
    if not check:
        t0 = clock()
        play(ops, fns)
        return clock() - t0, pool
    lookup, get_new, touch, free, cache = fns
    for op in ops:
        k = op[0]
        if k == 1:
            got = [b.block_id for b in get_new(op[1])]
            if got != op[2]:
                raise AssertionError(f"{target.name} handed out {got}, logged {op[2]}")
        elif k == 0:
            if len(lookup(op[1])) != op[2]:
                raise AssertionError(f"{target.name} found a different prefix than logged")
        elif k == 2:
            touch(op[1])
        elif k == 3:
            free(op[1])
        else:
            cache(*op[1])
    return 0.0, pool


def run_by_kind(target: Target, log: PoolLog) -> dict[str, float]:
    """Seconds per kind of call, each call timed alone, net of the timer's own cost."""
    _, ops, (lookup, get_new, touch, free, cache) = setup(target, log)
    perf = time.perf_counter
    acc = [0.0] * 5
    calls = [0] * 5
    fns = (lookup, get_new, touch, free, cache)
    for op in ops:
        k, arg = op[0], op[1]
        fn = fns[k]
        if k == 4:  # cache_full_blocks takes its arguments spread
            t = perf()
            fn(*arg)
        else:
            t = perf()
            fn(arg)
        acc[k] += perf() - t
        calls[k] += 1
    overhead = _timer_overhead()
    return {kind: max(acc[_OP[kind]] - overhead * calls[_OP[kind]], 0.0) for kind in KINDS}


def _timer_overhead(n: int = 200_000) -> float:
    perf = time.perf_counter
    acc = 0.0
    for _ in range(n):
        t = perf()
        acc += perf() - t
    return acc / n
