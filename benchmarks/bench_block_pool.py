"""Block-pool benchmark: replay a seeded serving trace through the pool.

Prints requests/s and block-ops/s for:

* ``tiered_kv``: our KVCacheManager + BlockPool;
* ``vllm-structure``: the same decisions made by a pool in vLLM v1's structure
  (intrusive linked list, per-block method calls; see ``_vllm_style_pool.py``);
* ``list-allocator``: the plain list allocator of the
  ``block-allocator-eviction-swapping`` seed, with no prefix caching;

with ratios against each, measured in the same run.  Hashing is timed
separately (pool runs use precomputed hashes).  ``--queues`` adds a
free-queue representation micro-benchmark.

Usage: python benchmarks/bench_block_pool.py [--requests N] [--json PATH] [--queues]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trace import TraceRequest, make_trace
from _vllm_style_pool import LBlock, LinkedFreeQueue, LinkedManager

from tiered_kv.core import BlockHasher, FreeBlockQueue, KVCacheBlock, KVCacheManager, Request

BLOCK_SIZE = 16


class SeedListAllocator:
    """The seed's BlockAllocator (free list + append_token), behind the driver's interface."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.block_tables: dict[object, list[int]] = {}
        self.last_block_usage: dict[object, int] = {}

    def _allocate(self, rid: object) -> int:
        if not self.free_blocks:
            raise MemoryError("No free blocks available")
        block_id = self.free_blocks.pop()
        if rid not in self.block_tables:
            self.block_tables[rid] = []
            self.last_block_usage[rid] = 0
        self.block_tables[rid].append(block_id)
        return block_id

    def _append_token(self, rid: object) -> int:
        usage = self.last_block_usage.get(rid, 0)
        if usage == 0 or usage >= self.block_size:
            block_id = self._allocate(rid)
            self.last_block_usage[rid] = 1
            return block_id
        self.last_block_usage[rid] = usage + 1
        return self.block_tables[rid][-1]

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, n: int = 0, hits: list | None = None):
        rid = request.request_id
        have = len(self.block_tables.get(rid, ()))
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - have
        if need > len(self.free_blocks):
            return None
        before = len(self.free_blocks)
        for _ in range(num_new_tokens):
            self._append_token(rid)
        return range(before - len(self.free_blocks))

    def free(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.block_tables:
            self.free_blocks.extend(self.block_tables.pop(rid))
            del self.last_block_usage[rid]


def replay(mgr, trace: list[TraceRequest], hashes: dict[int, list], concurrency: int) -> dict[str, int]:
    """Continuous batching: admit whole prompts FCFS, decode one token per step.

    A decode that does not fit preempts that request (freed, re-queued at the
    front, restarted), so every implementation makes the same calls as long as
    its pool makes the same decisions.
    """
    pending = deque(trace)
    running: list[list] = []  # [request, trace request, output position]
    ops = {"requests": 0, "allocated": 0, "touched": 0, "freed": 0, "preempted": 0, "lookups": 0}
    while pending or running:
        while pending and len(running) < concurrency:
            tr = pending[0]
            req = Request(tr.rid, tr.prompt)
            req.block_hashes = hashes[tr.rid]
            hits, n = mgr.get_computed_blocks(req)
            ops["lookups"] += 1
            new = mgr.allocate_slots(req, req.num_tokens - n, n, hits)
            if new is None:
                if not running:
                    pending.popleft()  # larger than the whole pool: drop
                break
            pending.popleft()
            ops["allocated"] += len(new)
            ops["touched"] += len(hits)
            req.num_computed_tokens = req.num_tokens
            running.append([req, tr, 0])
        still: list[list] = []
        for item in running:
            req, tr, pos = item
            req.append_output_token_ids(tr.output[pos])
            new = mgr.allocate_slots(req, 1)
            if new is None:
                ops["freed"] += len(mgr_blocks(mgr, req))
                mgr.free(req)
                ops["preempted"] += 1
                pending.appendleft(tr)
                continue
            ops["allocated"] += len(new)
            req.num_computed_tokens += 1
            item[2] = pos + 1
            if pos + 1 == len(tr.output):
                ops["freed"] += len(mgr_blocks(mgr, req))
                mgr.free(req)
                ops["requests"] += 1
            else:
                still.append(item)
        running = still
    return ops


def mgr_blocks(mgr, req: Request) -> list:
    if isinstance(mgr, SeedListAllocator):
        return mgr.block_tables.get(req.request_id, [])
    return mgr.req_to_blocks.get(req.request_id, [])


def precompute_hashes(trace: list[TraceRequest], hash_fn: str) -> tuple[dict[int, list], float, int]:
    hasher = BlockHasher.create(BLOCK_SIZE, hash_fn)
    t0 = time.perf_counter()
    out = {}
    for tr in trace:
        req = Request(tr.rid, tr.prompt + tr.output)
        out[tr.rid] = hasher.update(req)
    dt = time.perf_counter() - t0
    return out, dt, sum(len(h) for h in out.values())


def time_impl(make, trace, hashes, concurrency, repeats) -> tuple[float, dict, object]:
    best = float("inf")
    ops: dict = {}
    mgr = None
    for _ in range(repeats):
        mgr = make()
        t0 = time.perf_counter()
        ops = replay(mgr, trace, hashes, concurrency)
        best = min(best, time.perf_counter() - t0)
    return best, ops, mgr


class _LogRequest:
    """The fields ``cache_full_blocks`` reads, frozen at the time of the call."""

    __slots__ = ("request_id", "block_hashes", "all_token_ids", "lora_name", "num_tokens")

    def __init__(self, req: Request) -> None:
        self.request_id = req.request_id
        self.block_hashes = req.block_hashes
        self.all_token_ids = req.all_token_ids
        self.lora_name = None
        self.num_tokens = req.num_tokens


def record_pool_calls(trace, hashes, blocks: int, concurrency: int) -> list[tuple]:
    """Replay the trace through our manager, logging every pool call it makes.

    Log entries use block ids so they can be replayed against any pool:
    ``("lookup", hashes)`` (``get_cached_block`` until the first miss),
    ``("new", n, ids)``, ``("touch", ids)``, ``("free", ids)``,
    ``("cache", request, table_ids, num_cached, num_full)``.
    """
    mgr = KVCacheManager(blocks, BLOCK_SIZE, hash_fn="fast", log_stats=False)
    pool = mgr.block_pool
    log: list[tuple] = []
    get_new, touch, free, cache = pool.get_new_blocks, pool.touch, pool.free_blocks, pool.cache_full_blocks
    lookup = mgr.get_computed_blocks

    def rec_lookup(request):
        hits, n = lookup(request)
        max_blocks = (request.num_tokens - 1) // BLOCK_SIZE
        log.append(("lookup", request.block_hashes[: min(len(hits) + 1, max_blocks)]))
        return hits, n

    def rec_new(n):
        ret = get_new(n)
        log.append(("new", n, [b.block_id for b in ret]))
        return ret

    def rec_touch(bl):
        log.append(("touch", [b.block_id for b in bl]))
        touch(bl)

    def rec_free(bl):
        log.append(("free", [b.block_id for b in bl]))
        free(bl)

    def rec_cache(request, bl, n_cached, n_full, bs):
        log.append(("cache", _LogRequest(request), [b.block_id for b in bl[:n_full]], n_cached, n_full))
        cache(request, bl, n_cached, n_full, bs)

    mgr.get_computed_blocks = rec_lookup  # type: ignore[method-assign]
    pool.get_new_blocks, pool.touch, pool.free_blocks, pool.cache_full_blocks = rec_new, rec_touch, rec_free, rec_cache
    replay(mgr, trace, hashes, concurrency)
    return log


def replay_pool_log(pool, log: list[tuple], check: bool) -> float:
    """Replay a pool-call log against ``pool``; return seconds spent in pool calls.

    Arguments are converted to ``pool``'s block objects before timing starts.
    With ``check``, every ``get_new_blocks`` must return the logged ids.
    """
    blocks = pool.blocks
    calls: list[tuple] = []
    for entry in log:
        kind = entry[0]
        if kind == "lookup":
            calls.append((0, entry[1]))
        elif kind == "new":
            calls.append((1, entry[1], entry[2]))
        elif kind == "touch":
            calls.append((2, [blocks[i] for i in entry[1]]))
        elif kind == "free":
            calls.append((3, [blocks[i] for i in entry[1]]))
        else:
            calls.append((4, entry[1], [blocks[i] for i in entry[2]], entry[3], entry[4]))
    get_cached, get_new = pool.get_cached_block, pool.get_new_blocks
    touch, free, cache = pool.touch, pool.free_blocks, pool.cache_full_blocks
    t0 = time.perf_counter()
    for call in calls:
        op = call[0]
        if op == 1:
            got = get_new(call[1])
            if check and [b.block_id for b in got] != call[2]:
                raise AssertionError(f"{type(pool).__name__} handed out different blocks than logged")
        elif op == 0:
            for h in call[1]:
                if get_cached(h) is None:
                    break
        elif op == 2:
            touch(call[1])
        elif op == 3:
            free(call[1])
        else:
            cache(call[1], call[2], call[3], call[4], BLOCK_SIZE)
    return time.perf_counter() - t0


def bench_queues(n: int = 20000, rounds: int = 3000, k: int = 32) -> list[dict]:
    """Free-queue representations on take-n / put-back / remove-from-middle."""
    rows = []
    for name in ("deque + lazy removal (ours)", "intrusive linked list (vLLM)"):
        if name.startswith("deque"):
            blocks = [KVCacheBlock(i) for i in range(n)]
            q = FreeBlockQueue(blocks)
        else:
            blocks = [LBlock(i) for i in range(n)]
            q = LinkedFreeQueue(blocks)
        t0 = time.perf_counter()
        for _ in range(rounds):
            got = q.popleft_n(k)
            q.append_n(got)
        t_pop = (time.perf_counter() - t0) / (rounds * k)
        t0 = time.perf_counter()
        step = n // (rounds)
        victims = blocks[::step][:rounds]
        for b in victims:
            q.remove(b)
        t_rm = (time.perf_counter() - t0) / len(victims)
        rows.append({"queue": name, "take+put_back_ns_per_block": t_pop * 1e9, "remove_ns": t_rm * 1e9})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6000, help="pool size in blocks (block size 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queues", action="store_true", help="also compare free-queue representations")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    trace = make_trace(args.requests, seed=args.seed)
    results: dict[str, object] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "blocks": args.blocks,
        "block_size": BLOCK_SIZE,
    }
    print(f"trace: {args.requests} requests, {args.concurrency} running, pool {args.blocks} blocks x {BLOCK_SIZE}")

    print("\nhashing (every block of every prompt+output, incremental hasher)")
    print(f"{'hash':8} {'blocks':>9} {'blocks/s':>12} {'us/block':>9}")
    hashes = {}
    for fn in ("sha256", "fast"):
        hashes[fn], dt, nblk = precompute_hashes(trace, fn)
        print(f"{fn:8} {nblk:9d} {nblk / dt:12.0f} {dt / nblk * 1e6:9.3f}")
        results[f"hash_{fn}_blocks_per_s"] = nblk / dt

    impls = {
        "tiered_kv": lambda: KVCacheManager(args.blocks, BLOCK_SIZE, hash_fn="fast", log_stats=False),
        "vllm-structure": lambda: LinkedManager(args.blocks, BLOCK_SIZE),
        "list-allocator": lambda: SeedListAllocator(args.blocks, BLOCK_SIZE),
    }
    print("\nmanager + pool over the trace (sha256 hashes precomputed; best of", args.repeats, "runs)")
    print(f"{'impl':16} {'seconds':>8} {'req/s':>9} {'block-ops/s':>12} {'preempt':>8} {'hit blocks':>10}")
    timings = {}
    mgrs = {}
    for name, make in impls.items():
        dt, ops, mgr = time_impl(make, trace, hashes["sha256"], args.concurrency, args.repeats)
        mgrs[name] = mgr
        block_ops = ops["allocated"] + ops["touched"] + ops["freed"]
        timings[name] = dt
        print(
            f"{name:16} {dt:8.3f} {ops['requests'] / dt:9.0f} {block_ops / dt:12.0f} "
            f"{ops['preempted']:8d} {ops['touched']:10d}"
        )
        results[name] = {
            "seconds": dt,
            "requests_per_s": ops["requests"] / dt,
            "block_ops_per_s": block_ops / dt,
            **ops,
        }
    same = mgrs["tiered_kv"].block_pool.free_queue_ids() == mgrs["vllm-structure"].block_pool.free_block_queue.ids()
    print(f"\nsame final free-queue order as the vLLM-structure pool: {same}")
    results["same_decisions"] = same
    for anchor in ("vllm-structure", "list-allocator"):
        ratio = timings[anchor] / timings["tiered_kv"]
        print(f"end-to-end speed ratio tiered_kv / {anchor}: {ratio:.2f}x")
        results[f"ratio_vs_{anchor}"] = ratio

    # Pool operations alone: the exact call sequence, replayed against each pool.
    from _vllm_style_pool import LinkedBlockPool

    from tiered_kv.core import BlockPool

    log = record_pool_calls(trace, hashes["sha256"], args.blocks, args.concurrency)
    counts: dict[str, int] = {}
    for entry in log:
        counts[entry[0]] = counts.get(entry[0], 0) + 1
    n_block_ops = sum(len(e[2]) if e[0] == "new" else len(e[1]) for e in log if e[0] in ("new", "touch", "free"))
    n_block_ops += sum(e[4] - e[3] for e in log if e[0] == "cache")
    replay_pool_log(BlockPool(args.blocks), log, check=True)
    replay_pool_log(LinkedBlockPool(args.blocks), log, check=True)
    pool_t = {
        "tiered_kv BlockPool": min(replay_pool_log(BlockPool(args.blocks), log, False) for _ in range(args.repeats)),
        "vllm-structure": min(replay_pool_log(LinkedBlockPool(args.blocks), log, False) for _ in range(args.repeats)),
    }
    print(f"\npool calls only: {len(log)} calls {counts}, {n_block_ops} block-ops; identical block ids: True")
    print(f"{'pool':20} {'seconds':>8} {'calls/s':>10} {'block-ops/s':>12}")
    for name, dt in pool_t.items():
        print(f"{name:20} {dt:8.3f} {len(log) / dt:10.0f} {n_block_ops / dt:12.0f}")
    pool_ratio = pool_t["vllm-structure"] / pool_t["tiered_kv BlockPool"]
    print(f"pool-operation speed ratio tiered_kv / vllm-structure: {pool_ratio:.2f}x")
    results["pool_calls"] = {
        "calls": len(log),
        "block_ops": n_block_ops,
        "by_kind": counts,
        "seconds": pool_t,
        "ratio_vs_vllm_structure": pool_ratio,
    }

    if args.queues:
        print("\nfree-queue representations")
        print(f"{'queue':32} {'take+put ns/block':>18} {'remove ns':>10}")
        rows = bench_queues()
        for r in rows:
            print(f"{r['queue']:32} {r['take+put_back_ns_per_block']:18.1f} {r['remove_ns']:10.1f}")
        results["queues"] = rows
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
