"""The prefix-cache hash map: eager deletion at eviction (ours, vLLM's) against lazy deletion.

``BlockPool`` keeps ``cached_block_hash_to_block``: hash -> the block cached
under it.  When a cached block is handed out again (evicted), its entry is
deleted at once (eager).  The alternative is to leave the entry and validate
on lookup: a hit whose block no longer carries that hash is a miss, and the
stale entry is deleted then or overwritten by the next insert (lazy).

This script takes the block-pool benchmark's recorded call sequence (the one
``bench_block_pool.py`` replays) as map work: lookups (probes up to the first
miss), blocks cached under a hash, blocks handed out.  It replays that work on
a plain dict with slotted block records, under both strategies, with the
pool's handling of several blocks sharing one hash:

* eager: a probe is ``get``; an insert is ``get`` then a store; an eviction
  clears the block's hash and deletes its entry;
* lazy: a probe is ``get`` plus a check that the block still carries the hash
  (a stale hit deletes the entry and reads as a miss); an insert is ``get``
  plus the same check, then a store; an eviction only clears the block's hash.

Both replays must find, lookup for lookup, the hits the pool found (checked).  It prints
the time per strategy, their ratio, and the largest map each reached (the lazy
map holds stale entries until they are probed or overwritten).

Usage: python benchmarks/bench_hash_map.py [--requests N] [--repeats K]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pool_log as pl
from _trace import BLOCK_SIZE, drive, make_trace, precompute_hashes

LOOKUP, INSERT, EVICT = 0, 1, 2


def map_ops(log: pl.PoolLog) -> list[tuple]:
    """The log's calls as map work: (LOOKUP, hashes, hits), (INSERT, hash, block id), (EVICT, block id).

    Lookups probe until the first miss; inserts are the blocks a ``cache`` call
    gives a hash; evictions are the blocks an ``allocate`` hands out (a block
    that carries no hash is no work for either map, which each replay checks).
    """
    out: list[tuple] = []
    for c in log.calls:
        kind = c[0]
        if kind == "lookup":
            out.append((LOOKUP, c[1], c[2]))
        elif kind == "allocate":
            out.extend((EVICT, None, i) for i in c[2])
        elif kind == "cache":
            hashes, ids, first, last = c[1], c[2], c[3], c[4]
            out.extend((INSERT, hashes[i], ids[i]) for i in range(first, last))
    return out


class Blk:
    __slots__ = ("block_hash", "block_id")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: object = None


def _first(entry):
    return entry if entry.__class__ is Blk else next(iter(entry.values()))


def eager(stream: list[tuple], num_blocks: int) -> tuple[float, list[int], int]:
    """Our map: an entry per hash (a block, or a dict of the blocks sharing it), deleted at eviction."""
    blocks = [Blk(i) for i in range(num_blocks)]
    m: dict = {}
    hits: list[int] = []
    biggest = 0
    t0 = time.perf_counter()
    for kind, h, bid in stream:
        if kind == LOOKUP:
            n = 0
            for k in h:
                e = m.get(k)
                if e is None:
                    break
                n += 1
            hits.append(n)
        elif kind == INSERT:
            b = blocks[bid]
            if b.block_hash is not None:
                continue  # already cached under its hash
            b.block_hash = h
            e = m.get(h)
            if e is None:
                m[h] = b
                if len(m) > biggest:
                    biggest = len(m)
            elif e.__class__ is Blk:
                m[h] = {e.block_id: e, bid: b}
            else:
                e[bid] = b
        else:
            b = blocks[bid]
            k = b.block_hash
            if k is None:
                continue
            e = m[k]
            if e is b:
                del m[k]
            else:
                del e[bid]
                if not e:
                    del m[k]
            b.block_hash = None
    return time.perf_counter() - t0, hits, biggest


def lazy(stream: list[tuple], num_blocks: int) -> tuple[float, list[int], int]:
    """Entries left at eviction; a probe or an insert that finds a stale one drops it."""
    blocks = [Blk(i) for i in range(num_blocks)]
    m: dict = {}
    hits: list[int] = []
    biggest = 0
    t0 = time.perf_counter()
    for kind, h, bid in stream:
        if kind == LOOKUP:
            n = 0
            for k in h:
                e = m.get(k)
                if e is None:
                    break
                if e.__class__ is Blk:
                    if e.block_hash != k:
                        del m[k]
                        break
                else:
                    for i in [i for i, b in e.items() if b.block_hash != k]:
                        del e[i]
                    if not e:
                        del m[k]
                        break
                n += 1
            hits.append(n)
        elif kind == INSERT:
            b = blocks[bid]
            if b.block_hash is not None:
                continue
            b.block_hash = h
            e = m.get(h)
            if e is None or (e.__class__ is Blk and e.block_hash != h):
                m[h] = b
                if len(m) > biggest:
                    biggest = len(m)
            elif e.__class__ is Blk:
                m[h] = {e.block_id: e, bid: b}
            else:
                for i in [i for i, x in e.items() if x.block_hash != h]:
                    del e[i]
                e[bid] = b
        else:
            blocks[bid].block_hash = None  # the entry stays until a probe or an insert finds it stale
    return time.perf_counter() - t0, hits, biggest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    trace = make_trace(args.requests, seed=0)
    hashes = precompute_hashes(trace, "sha256")[0]
    log = pl.record_pool_log(lambda mgr: drive(mgr, trace, hashes, args.concurrency), args.blocks, BLOCK_SIZE)
    stream = map_ops(log)
    n = [sum(1 for op in stream if op[0] == k) for k in (LOOKUP, INSERT, EVICT)]
    print(
        f"trace: {args.requests} requests, pool {args.blocks} blocks; {n[0]} lookups, "
        f"{n[1]} blocks cached, {n[2]} blocks handed out ({log.evicted} of them evicted)"
    )
    best = {}
    for name, fn in (("eager (ours, vLLM's)", eager), ("lazy, validated on lookup", lazy)):
        runs = [fn(stream, args.blocks) for _ in range(args.repeats)]
        best[name] = min(runs, key=lambda r: r[0])
    (te, he, _), (tl, hl, _) = best.values()
    logged = [op[2] for op in stream if op[0] == LOOKUP]
    if he != logged or hl != logged:
        raise SystemExit("a strategy found other hits than the pool did: the replay is wrong")
    print(f"both find the pool's hits, lookup for lookup: True ({sum(he)} hit blocks)\n")
    print(f"| map | seconds (best of {args.repeats}) | ns per map operation | largest map |")
    print("| --- | ---: | ---: | ---: |")
    total = sum(len(op[1]) if op[0] == LOOKUP else 1 for op in stream)
    for name, (t, _, biggest) in best.items():
        print(f"| {name} | {t:.4f} | {t / total * 1e9:.1f} | {biggest} |")
    print(f"\nlazy / eager time: {tl / te:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
