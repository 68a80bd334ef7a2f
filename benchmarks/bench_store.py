"""CPU store benchmark: our ``CPUStore`` against vLLM 0.33.0's real ``CPUOffloadingManager``, per policy.

vLLM's class is imported from its wheel (``tests/vllm_ref_offload.py``: only the
offloading manager and its policies, with stubs for the logger and the metrics
record).  One seeded, connector-shaped trace is played against vLLM's manager
and its every call is recorded with its result: ``--running`` requests at a
time share system prompts and resend conversations; admission looks up the
prefix key by key and loads the hits (``prepare_load``, its ``complete_load``
some steps later); each step stores the next chunk of 1-8 blocks
(``prepare_store``; 30% of the time re-offering blocks already offered);
stores complete later (``complete_store`` with the offer as a set; 5% fail);
requests finish (``on_request_finished``), often before their copies land;
each step ends with ``on_schedule_end``.

Then a checking pass: our store must answer every call exactly as vLLM's did
(each lookup, each load's slots, each store's keys, slots and evictions, in
order).  Then timed passes, alternating, best of ``--repeat``: the same call
list replayed against a fresh vLLM manager and a fresh ``CPUStore``.  The ratio
is vLLM's time over ours, measured in the same run.

``--clock cpu`` times with ``time.process_time`` (this process's CPU seconds)
instead of the wall clock: on a shared, loaded machine the wall clock also
counts the time other jobs hold the cores, which moves both stores' times by
more than their difference.

Usage: python benchmarks/bench_store.py [--requests N] [--running R] [--capacity C] [--repeat K] [--policy lru|arc]
    [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import vllm_ref_offload

from tiered_kv.tiers import CPUStore, RequestContext

BLOCK = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter  # set by --clock
NEW, LOOKUP, LOAD, UNLOAD, STORE, COMPLETE, FINISH, STEP = range(8)
NAMES = ["on_new_request", "lookup", "prepare_load", "complete_load", "prepare_store", "complete_store",
         "on_request_finished", "on_schedule_end"]  # fmt: skip


def make_trace(v, policy: str, capacity: int, n_requests: int, running: int, seed: int) -> list[tuple]:
    """Play the trace against vLLM's manager; return its calls ``(kind, req index, args..., result)``."""
    rng = random.Random(seed)
    mk = v.base.make_offload_key
    docs = [[mk(f"d{d}-{i}".encode(), 0) for i in range(96)] for d in range(64)]
    mgr = v.manager.CPUOffloadingManager(capacity, cache_policy=policy)
    calls: list[tuple] = []
    reqs: list[list] = []  # [keys, vllm ctx, next store, stores in flight, loads in flight]
    active: list[int] = []
    closing: list[int] = []

    def new() -> int:
        i = len(reqs)
        doc = docs[min(int(rng.paretovariate(1.1)) - 1, len(docs) - 1)]
        keys = doc[: rng.randint(0, 80)] + [mk(f"r{i}-{j}".encode(), 0) for j in range(rng.randint(1, 24))]
        ctx = v.base.ReqContext(req_id=str(i))
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, (j + 1) * BLOCK)
        reqs.append([keys, ctx, 0, [], []])
        mgr.on_new_request(ctx)
        calls.append((NEW, i))
        n = 0
        for k in keys[:-1]:
            hit = mgr.lookup(k, ctx) is v.base.LookupResult.HIT
            calls.append((LOOKUP, i, k, hit))
            if not hit:
                break
            n += 1
        if n:
            spec = mgr.prepare_load(keys[:n], ctx)
            calls.append((LOAD, i, keys[:n], tuple(x + 1 for x in spec.block_ids.tolist())))
            reqs[i][4].append(keys[:n])
        reqs[i][2] = n
        active.append(i)
        return i

    def complete(i: int) -> None:
        r = reqs[i]
        if r[3] and (not r[4] or rng.random() < 0.6):
            keys, ok = r[3].pop(rng.randrange(len(r[3])))
            mgr.complete_store(keys, r[1], ok)
            calls.append((COMPLETE, i, keys, ok))
        elif r[4]:
            keys = r[4].pop(0)
            mgr.complete_load(keys, r[1])
            calls.append((UNLOAD, i, keys))

    while len(reqs) < n_requests or active or closing:
        new_ids = []
        while len(reqs) < n_requests and len(active) < running and rng.random() < 0.7:
            new_ids.append(str(new()))
        for i in list(active):
            r = reqs[i]
            keys, x = r[0], rng.random()
            if r[2] < len(keys) and x < 0.7:
                start = rng.randrange(0, r[2]) if r[2] and rng.random() < 0.3 else r[2]
                end = min(len(keys), r[2] + rng.randint(1, 8))
                chunk = keys[start:end]
                r[2] = max(r[2], end)
                out = mgr.prepare_store(chunk, r[1])
                res = None
                if out is not None:
                    ids = tuple(x + 1 for x in out.store_spec.block_ids.tolist())
                    res = (list(out.keys_to_store), ids, list(out.evicted_keys))
                    if out.keys_to_store:
                        r[3].append((set(chunk), rng.random() >= 0.05))
                calls.append((STORE, i, chunk, res))
            elif x < 0.85 and (r[3] or r[4]):
                complete(i)
            elif r[2] >= len(keys) or x < 0.88:
                mgr.on_request_finished(r[1])
                calls.append((FINISH, i))
                active.remove(i)
                if r[3] or r[4]:
                    closing.append(i)
        for i in list(closing):
            if rng.random() < 0.5:
                complete(i)
                if not (reqs[i][3] or reqs[i][4]):
                    closing.remove(i)
        mgr.on_schedule_end(v.base.ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=[]))
        calls.append((STEP, tuple(new_ids)))
    return calls, [r[0] for r in reqs]


def check(calls: list[tuple], keys: list[list], policy: str, capacity: int) -> dict[str, int]:
    """Replay ``calls`` against a fresh ``CPUStore``; raise on the first answer that is not vLLM's."""
    store = CPUStore(capacity + 1, policy)
    ctxs = _our_contexts(keys)
    counts = {"calls": len(calls), "evicted": 0, "hits": 0}
    for n, c in enumerate(calls):
        kind = c[0]
        if kind == NEW:
            store.on_new_request(ctxs[c[1]])
        elif kind == LOOKUP:
            got = store.lookup(c[2]).name == "HIT"
            assert got == c[3], (n, c, got)
            counts["hits"] += got
        elif kind == LOAD:
            assert store.prepare_load(c[2], ctxs[c[1]]).block_ids == c[3], (n, c)
        elif kind == UNLOAD:
            store.complete_load(c[2], ctxs[c[1]])
        elif kind == STORE:
            out = store.prepare_store(c[2], ctxs[c[1]])
            got = None if out is None else (list(out.keys_to_store), out.store_spec.block_ids, list(out.evicted_keys))
            assert got == c[3], (n, c, got)
            counts["evicted"] += len(out.evicted_keys) if out else 0
        elif kind == COMPLETE:
            store.complete_store(c[2], c[3], ctxs[c[1]])
        elif kind == FINISH:
            store.on_request_finished(ctxs[c[1]])
        else:
            store.on_schedule_end(c[1], ())
    store.check_invariants()
    return counts


def _our_contexts(keys: list[list]) -> list[RequestContext]:
    out = []
    for i, ks in enumerate(keys):
        ctx = RequestContext(str(i))
        ctx.set_positions(ks, BLOCK, BLOCK)
        out.append(ctx)
    return out


def _vllm_contexts(v, keys: list[list]) -> list:
    out = []
    for i, ks in enumerate(keys):
        ctx = v.base.ReqContext(req_id=str(i))
        for j, k in enumerate(ks):
            ctx.set_offload_key_position(k, (j + 1) * BLOCK)
        out.append(ctx)
    return out


def time_vllm(v, calls: list[tuple], keys: list[list], policy: str, capacity: int) -> float:
    mgr = v.manager.CPUOffloadingManager(capacity, cache_policy=policy)
    ctxs = _vllm_contexts(v, keys)
    new, lookup, load, unload = mgr.on_new_request, mgr.lookup, mgr.prepare_load, mgr.complete_load
    store, complete, finish, step = mgr.prepare_store, mgr.complete_store, mgr.on_request_finished, mgr.on_schedule_end
    end = v.base.ScheduleEndContext
    gc.collect()
    t0 = clock()
    for c in calls:
        kind = c[0]
        if kind == LOOKUP:
            lookup(c[2], ctxs[c[1]])
        elif kind == STORE:
            store(c[2], ctxs[c[1]])
        elif kind == STEP:
            step(end(c[1], ()))
        elif kind == COMPLETE:
            complete(c[2], ctxs[c[1]], c[3])
        elif kind == LOAD:
            load(c[2], ctxs[c[1]])
        elif kind == UNLOAD:
            unload(c[2], ctxs[c[1]])
        elif kind == NEW:
            new(ctxs[c[1]])
        else:
            finish(ctxs[c[1]])
    return clock() - t0


def time_ours(calls: list[tuple], keys: list[list], policy: str, capacity: int) -> float:
    s = CPUStore(capacity + 1, policy)
    ctxs = _our_contexts(keys)
    new, lookup, load, unload = s.on_new_request, s.lookup, s.prepare_load, s.complete_load
    store, complete, finish, step = s.prepare_store, s.complete_store, s.on_request_finished, s.on_schedule_end
    gc.collect()
    t0 = clock()
    for c in calls:
        kind = c[0]
        if kind == LOOKUP:
            lookup(c[2], ctxs[c[1]])
        elif kind == STORE:
            store(c[2], ctxs[c[1]])
        elif kind == STEP:
            step(c[1], ())
        elif kind == COMPLETE:
            complete(c[2], c[3], ctxs[c[1]])
        elif kind == LOAD:
            load(c[2], ctxs[c[1]])
        elif kind == UNLOAD:
            unload(c[2], ctxs[c[1]])
        elif kind == NEW:
            new(ctxs[c[1]])
        else:
            finish(ctxs[c[1]])
    return clock() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--policy", choices=["lru", "arc"], action="append")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    a = p.parse_args(argv)
    global clock
    clock = CLOCKS[a.clock]
    v = vllm_ref_offload.load()
    print(f"CPU store vs vLLM 0.33.0 CPUOffloadingManager: {a.requests} requests, {a.running} running, "
          f"{a.capacity} blocks, best of {a.repeat}, {a.clock} clock")  # fmt: skip
    print("| policy | calls | evictions | lookup hits | vLLM s | tiered_kv s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy in a.policy or ["lru", "arc"]:
        calls, keys = make_trace(v, policy, a.capacity, a.requests, a.running, a.seed)
        counts = check(calls, keys, policy, a.capacity)
        theirs, ours = [], []
        for _ in range(a.repeat):
            theirs.append(time_vllm(v, calls, keys, policy, a.capacity))
            ours.append(time_ours(calls, keys, policy, a.capacity))
        t, o = min(theirs), min(ours)
        print(f"| {policy} | {counts['calls']} | {counts['evicted']} | {counts['hits']} | {t:.3f} | {o:.3f} "
              f"| {t / o:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
