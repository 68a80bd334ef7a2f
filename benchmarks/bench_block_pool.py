"""Block-pool benchmark: a seeded serving trace through our pool and through vLLM 0.33.0's own ``BlockPool``.

Three sections, each measured in this run:

* **pool calls**: the exact pool-call sequence of the trace (recorded once, in
  block ids, from our ``KVCacheManager`` serving it) replayed against our
  ``BlockPool`` and against vLLM 0.33.0's real ``BlockPool`` (its unchanged
  source, imported by ``tests/vllm_ref_core.py``).  Both pools must hand out
  the logged block ids and find the logged hits call for call, and end with the
  same free-queue order and cached set.  Prints seconds, block-ops/s and
  microseconds per block (per probe for lookups) by kind of call, and the
  speed ratio ours / vLLM's;
* **managers**: our ``KVCacheManager``, the same with the pool's events on and
  drained (what counting evictions from events costs), and a plain list
  allocator (no prefix caching) serving the trace end to end;
* **hashing**: the incremental hasher over every block of the trace;
* **pool + hashing** (``--hashing``): each side hashes every request's tokens into
  block hashes with its own hasher (ours: ``BlockHasher`` with ``"sha256"``; vLLM
  0.33.0's ``get_request_block_hasher`` with its default ``sha256``, pickle then
  SHA-256), then replays the pool calls; vLLM's replay uses vLLM's hashes.  The
  two hash sets must correspond one to one (checked), so both pools make the same
  decisions (checked, as above).

``--queues`` adds a free-queue micro-benchmark: our deque against vLLM's
``FreeKVCacheBlockQueue``.  The numbers say whether ``tiered_kv.core`` ran
compiled (mypyc) or as pure Python.  Where vLLM's source cannot be had (no
cache, no network) the vLLM columns are left out and the script says why.

``--clock cpu`` times the pool-call replays in this process's CPU seconds
(``time.process_time``) instead of the wall clock, for a loaded shared machine.

Usage: python benchmarks/bench_block_pool.py [--requests N] [--json PATH] [--queues] [--hashing] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pool_log as pl
from _trace import BLOCK_SIZE, TraceRequest, drive, make_trace, precompute_hashes

import tiered_kv.core
from tiered_kv.core import BlockHasher, BlockRemoved, FreeBlockQueue, KVCacheBlock, KVCacheManager, Request


class SeedListAllocator:
    """The seed's BlockAllocator (free list + append_token), behind the driver's interface."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.req_to_blocks: dict[object, list[int]] = {}
        self.last_block_usage: dict[object, int] = {}

    def _allocate(self, rid: object) -> int:
        if not self.free_blocks:
            raise MemoryError("No free blocks available")
        block_id = self.free_blocks.pop()
        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = []
            self.last_block_usage[rid] = 0
        self.req_to_blocks[rid].append(block_id)
        return block_id

    def _append_token(self, rid: object) -> int:
        usage = self.last_block_usage.get(rid, 0)
        if usage == 0 or usage >= self.block_size:
            block_id = self._allocate(rid)
            self.last_block_usage[rid] = 1
            return block_id
        self.last_block_usage[rid] = usage + 1
        return self.req_to_blocks[rid][-1]

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int, n: int = 0, hits: list | None = None):
        rid = request.request_id
        have = len(self.req_to_blocks.get(rid, ()))
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - have
        if need > len(self.free_blocks):
            return None
        before = len(self.free_blocks)
        for _ in range(num_new_tokens):
            self._append_token(rid)
        return range(before - len(self.free_blocks))

    def free(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.req_to_blocks:
            self.free_blocks.extend(self.req_to_blocks.pop(rid))
            del self.last_block_usage[rid]


class DrainingManager(KVCacheManager):
    """Our manager with the pool's events on, drained and counted at every free.

    What the tier manager did to count GPU evictions before the pool counted them
    (``BlockPool.num_evicted_blocks``): the row beside plain ``tiered_kv`` is the cost
    of that.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, enable_kv_cache_events=True, **kwargs)
        self.evicted_from_events = 0

    def free(self, request) -> None:
        super().free(request)
        for ev in self.take_events():
            if isinstance(ev, BlockRemoved):
                self.evicted_from_events += len(ev.block_hashes)


def time_impl(make, trace: list[TraceRequest], hashes, concurrency: int, repeats: int) -> tuple[float, dict, object]:
    best = float("inf")
    ops: dict = {}
    mgr = None
    for _ in range(repeats):
        mgr = make()
        t0 = time.perf_counter()
        ops = drive(mgr, trace, hashes, concurrency)
        best = min(best, time.perf_counter() - t0)
    return best, ops, mgr


def bench_queues(vllm_queue: type | None, vllm_block: type | None, n: int = 20000, rounds: int = 3000, k: int = 32):
    """Free-queue representations on take-n / put-back / remove-from-middle."""
    rows = []
    kinds = [("deque + lazy removal (ours)", FreeBlockQueue, KVCacheBlock)]
    if vllm_queue is not None:
        kinds.append(("vLLM 0.33 FreeKVCacheBlockQueue", vllm_queue, vllm_block))
    for name, queue, block in kinds:
        blocks = [block(i) for i in range(n)]
        q = queue(blocks)
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


def check_targets(targets: list[pl.Target], log: pl.PoolLog) -> None:
    """Every pool hands out the logged ids and hits, and ends in the same state (raises if not)."""
    final = None
    for t in targets:
        _, pool = pl.run(t, log, check=True)
        state = (t.free_ids(pool), t.cached_ids(pool))
        if final is None:
            final = state
        elif state != final:
            raise AssertionError(f"{t.name} ends with a different free queue or cached set")


def bench_pool_calls(log: pl.PoolLog, targets: list[pl.Target], repeats: int) -> dict:
    """Best-of-``repeats`` replay per target (interleaved), plus one per-kind timed replay each."""
    best = {t.name: float("inf") for t in targets}
    for _ in range(repeats):
        for t in targets:  # interleaved, so that load changes hit every target alike
            best[t.name] = min(best[t.name], pl.run(t, log)[0])
    by_kind = {t.name: pl.run_by_kind(t, log) for t in targets}
    return {"seconds": best, "by_kind": by_kind}


def print_pool_calls(log: pl.PoolLog, res: dict, refs: list[str]) -> dict:
    counts, units = log.counts(), log.units()
    n_ops = sum(units.values())
    print(f"\npool calls only: {len(log.calls)} calls, {n_ops} block-ops; {log.evicted} blocks evicted at hand-out")
    print("calls by kind:", ", ".join(f"{k} {counts[k]} ({units[k]} {pl.UNITS[k]}s)" for k in pl.KINDS))
    print("identical block ids, hits, final free queue and cached set on every pool: True")
    head = " ".join(f"{k + ' us/' + pl.UNITS[k]:>18}" for k in pl.KINDS)
    print(f"{'pool':28} {'seconds':>8} {'block-ops/s':>12} {head}")
    ours_name = next(iter(res["seconds"]))
    out: dict = {"calls": len(log.calls), "block_ops": n_ops, "evicted": log.evicted, "by_kind": counts}
    for name, dt in res["seconds"].items():
        kinds = res["by_kind"][name]
        cells = " ".join(f"{kinds[k] / units[k] * 1e6 if units[k] else 0.0:18.3f}" for k in pl.KINDS)
        print(f"{name:28} {dt:8.3f} {n_ops / dt:12.0f} {cells}")
        out[name] = {
            "seconds": dt,
            "block_ops_per_s": n_ops / dt,
            "us_per_unit": {k: kinds[k] / units[k] * 1e6 if units[k] else 0.0 for k in pl.KINDS},
        }
    for ref in refs:
        ratio = res["seconds"][ref] / res["seconds"][ours_name]
        per_kind = {k: res["by_kind"][ref][k] / res["by_kind"][ours_name][k] for k in pl.KINDS}
        print(
            f"pool-operation speed ratio tiered_kv / {ref}: {ratio:.2f}x  (by kind: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in per_kind.items())
            + ")"
        )
        out[f"ratio_vs {ref}"] = ratio
    return out


class _VllmHashedRequest:
    """What vLLM 0.33's ``request_block_hasher`` reads of a request (no LoRA, media, salt or embeddings)."""

    __slots__ = ("all_token_ids", "block_hashes")
    mm_features: tuple = ()  # falsy, as an empty list: what vLLM tests
    lora_request = None
    cache_salt = None
    prompt_embeds = None

    def __init__(self, prompt: list[int]) -> None:
        self.all_token_ids = list(prompt)
        self.block_hashes: list = []

    @property
    def num_tokens(self) -> int:  # vLLM's Request.num_tokens
        return len(self.all_token_ids)


def _hash_in_steps(trace: list[TraceRequest], reqs: list, update) -> None:
    """Each request's prompt hashed in one call, then one call per output block completed (the timed part).

    ``update(req)`` extends ``req.block_hashes``; the same calls on both sides.
    """
    bs = BLOCK_SIZE
    for tr, req in zip(trace, reqs, strict=True):
        update(req)
        tokens = req.all_token_ids
        out = tr.output
        pos = 0
        need = bs - len(tokens) % bs  # output tokens until the next block is full
        while pos + need <= len(out):
            tokens.extend(out[pos : pos + need])
            pos += need
            update(req)
            need = bs
        tokens.extend(out[pos:])


def _hashers(trace: list[TraceRequest]) -> dict:
    """Per side: (fresh requests, update function), both built outside the timing."""
    import vllm_ref_core

    ref = vllm_ref_core.load()  # initialises vLLM's NONE_HASH with its sha256, as its engine does
    vllm_hasher = ref.kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, ref.hashing.sha256)

    def vllm_update(req: _VllmHashedRequest) -> None:  # vLLM's Request.update_block_hashes
        req.block_hashes.extend(vllm_hasher(req))

    ours_update = BlockHasher.create(BLOCK_SIZE, "sha256").update
    return {
        "ours": (lambda: [Request(tr.rid, tr.prompt) for tr in trace], ours_update),
        "vllm": (lambda: [_VllmHashedRequest(tr.prompt) for tr in trace], vllm_update),
    }


def _translate(log: pl.PoolLog, to_vllm: dict) -> pl.PoolLog:
    """``log`` with every block hash replaced by vLLM's hash of the same block (shared lists stay shared)."""
    lists: dict[int, list] = {}
    calls: list[tuple] = []
    for c in log.calls:
        if c[0] == "lookup":
            calls.append(("lookup", [to_vllm[h] for h in c[1]], c[2]))
        elif c[0] == "cache":
            hashes = lists.get(id(c[1]))
            if hashes is None:
                hashes = lists[id(c[1])] = [to_vllm[h] for h in c[1]]
            calls.append(("cache", hashes, *c[2:]))
        else:
            calls.append(c)
    return pl.PoolLog(log.num_blocks, log.block_size, calls, log.evicted)


def bench_pool_and_hashing(
    trace: list[TraceRequest], log: pl.PoolLog, ours_hashes: dict, targets: list[pl.Target], repeats: int
) -> dict:
    """Hashing plus pool calls per side, best of ``repeats`` (interleaved), after checking both.

    Checks: our step-wise hashes equal the ones the log was recorded with; our and
    vLLM's hashes correspond one to one; both pools replay their logs with the
    logged ids and hits and end in the same state.
    """
    sides = _hashers(trace)
    got = {}
    for side, (make, update) in sides.items():
        reqs = make()
        _hash_in_steps(trace, reqs, update)
        got[side] = [r.block_hashes for r in reqs]
    if [ours_hashes[tr.rid] for tr in trace] != got["ours"]:
        raise AssertionError("step-wise hashes differ from the hashes the pool log was recorded with")
    to_vllm: dict = {}
    back: dict = {}
    for a_list, b_list in zip(got["ours"], got["vllm"], strict=True):
        if len(a_list) != len(b_list):
            raise AssertionError("the two hashers hashed different numbers of blocks")
        for a, b in zip(a_list, b_list, strict=True):
            if to_vllm.setdefault(a, b) != b or back.setdefault(b, a) != a:
                raise AssertionError("our hashes and vLLM's do not correspond one to one")
    logs = {targets[0].name: log, targets[1].name: _translate(log, to_vllm)}
    update_of = {targets[0].name: sides["ours"], targets[1].name: sides["vllm"]}
    final = None
    for t in targets:
        _, pool = pl.run(t, logs[t.name], check=True)
        state = (t.free_ids(pool), t.cached_ids(pool))
        if final is not None and state != final:
            raise AssertionError(f"{t.name} ends with a different free queue or cached set")
        final = state
    best = {t.name: (float("inf"), 0.0, 0.0) for t in targets}
    for _ in range(repeats):
        for t in targets:  # interleaved, as the pool-call section
            make, update = update_of[t.name]
            reqs = make()
            t0 = pl.clock()
            _hash_in_steps(trace, reqs, update)
            t_hash = pl.clock() - t0
            t_pool = pl.run(t, logs[t.name])[0]
            if t_hash + t_pool < best[t.name][0]:
                best[t.name] = (t_hash + t_pool, t_hash, t_pool)
    return {"blocks": len(to_vllm), "best": best}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6000, help="pool size in blocks (block size 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-only", action="store_true", help="only the pool-call section")
    ap.add_argument("--queues", action="store_true", help="also compare free-queue representations")
    ap.add_argument(
        "--hashing",
        action="store_true",
        help="also pool + hashing against vLLM's hasher and pool",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall", help="pool-call replays: wall clock or process CPU time"
    )
    args = ap.parse_args(argv)
    pl.clock = time.process_time if args.clock == "cpu" else time.perf_counter

    compiled = getattr(tiered_kv.core, "COMPILED", False)
    trace = make_trace(args.requests, seed=args.seed)
    results: dict[str, object] = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "blocks": args.blocks,
        "block_size": BLOCK_SIZE,
        "core_compiled": compiled,
    }
    print(f"tiered_kv.core: {'compiled (mypyc)' if compiled else 'pure Python'}; Python {sys.version.split()[0]}")
    print(f"trace: {args.requests} requests, {args.concurrency} running, pool {args.blocks} blocks x {BLOCK_SIZE}")

    hashes = {}
    if not args.pool_only:
        print("\nhashing (every block of every prompt+output, incremental hasher)")
        print(f"{'hash':8} {'blocks':>9} {'blocks/s':>12} {'us/block':>9}")
        for fn in ("sha256", "fast"):
            hashes[fn], dt, nblk = precompute_hashes(trace, fn)
            print(f"{fn:8} {nblk:9d} {nblk / dt:12.0f} {dt / nblk * 1e6:9.3f}")
            results[f"hash_{fn}_blocks_per_s"] = nblk / dt
    else:
        hashes["sha256"] = precompute_hashes(trace, "sha256")[0]

    # Pool operations alone: the exact call sequence, replayed against each pool.
    targets = [pl.ours()]
    real, why = pl.real_vllm()
    if real is None:
        print(f"\nvLLM's source is not available here ({why}); replaying against ours only")
    else:
        targets.append(real)
    log = pl.record_pool_log(lambda mgr: drive(mgr, trace, hashes["sha256"], args.concurrency), args.blocks, BLOCK_SIZE)
    check_targets(targets, log)
    res = bench_pool_calls(log, targets, args.repeats)
    results["pool_calls"] = print_pool_calls(log, res, [t.name for t in targets[1:]])

    if args.hashing and real is None:
        print("\npool + hashing: left out (needs vLLM's source, above)")
    elif args.hashing:
        both = bench_pool_and_hashing(trace, log, hashes["sha256"], targets, args.repeats)
        print(
            f"\npool + hashing: prompt hashed in one call, then one call per output block; "
            f"{both['blocks']} distinct blocks, hashes one to one, same decisions: True"
        )
        print(f"{'hasher + pool':40} {'total s':>8} {'hashing s':>10} {'pool s':>8}")
        names = {
            targets[0].name: "tiered_kv BlockHasher sha256 + BlockPool",
            targets[1].name: "vLLM sha256 hasher + BlockPool",
        }
        for name, (tot, t_hash, t_pool) in both["best"].items():
            print(f"{names[name]:40} {tot:8.3f} {t_hash:10.3f} {t_pool:8.3f}")
        ratio = both["best"][targets[1].name][0] / both["best"][targets[0].name][0]
        print(f"pool + hashing speed ratio tiered_kv / {targets[1].name} + hashing: {ratio:.2f}x")
        results["pool_and_hashing"] = {
            "blocks": both["blocks"],
            **{n: dict(zip(("seconds", "hashing_s", "pool_s"), v, strict=True)) for n, v in both["best"].items()},
            "ratio": ratio,
        }

    if not args.pool_only:
        impls = {
            "tiered_kv": lambda: KVCacheManager(args.blocks, BLOCK_SIZE, hash_fn="fast", log_stats=False),
            "tiered_kv+events": lambda: DrainingManager(args.blocks, BLOCK_SIZE, hash_fn="fast", log_stats=False),
            "list-allocator": lambda: SeedListAllocator(args.blocks, BLOCK_SIZE),
        }
        print(f"\nmanager + pool over the trace (sha256 hashes precomputed; best of {args.repeats} runs)")
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
            results[name] = {"seconds": dt, "requests_per_s": ops["requests"] / dt, "block_ops_per_s": block_ops / dt}
            results[name].update(ops)
        for other in ("tiered_kv+events", "list-allocator"):
            ratio = timings[other] / timings["tiered_kv"]
            print(f"end-to-end speed ratio tiered_kv / {other}: {ratio:.2f}x")
            results[f"ratio_vs_{other}"] = ratio
        evicted = mgrs["tiered_kv+events"].evicted_from_events
        same = evicted == mgrs["tiered_kv"].block_pool.num_evicted_blocks
        print(f"evictions counted by the pool = evictions counted from BlockRemoved events ({evicted}): {same}")
        results["eviction_count_matches_events"] = same

    if args.queues:
        print("\nfree-queue representations")
        print(f"{'queue':32} {'take+put ns/block':>18} {'remove ns':>10}")
        ref = None if real is None else __import__("vllm_ref_core").load()
        rows = bench_queues(ref and ref.FreeKVCacheBlockQueue, ref and ref.KVCacheBlock)
        for r in rows:
            print(f"{r['queue']:32} {r['take+put_back_ns_per_block']:18.1f} {r['remove_ns']:10.1f}")
        results["queues"] = rows
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
