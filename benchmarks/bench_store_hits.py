"""CPU-tier hit rate on the Mooncake conversation trace: vLLM 0.33.0's manager, our store, and a previous version.

The trace is ``/work/shared/traces/mooncake/conversation_trace.jsonl`` (12 031
requests of the Kimi service; ``hash_ids`` are prefix block hashes, one per
512-token block).  A connector-shaped driver serves the requests in arrival
order, ``--running`` at a time, against a CPU store of ``--capacity`` blocks:
at admission it looks up the prompt's blocks from the first until one misses
and loads the hits; then it stores the rest of the prompt in chunks of
``--chunk`` blocks, one chunk per step; each store completes the step after it;
a request finishes once its prompt is stored, and the load of its hits
completes then.  The hit rate is the blocks found over the blocks looked up
(all of a prompt's blocks but its last, which is always recomputed).

Drivers:

* vLLM 0.33.0's ``CPUOffloadingManager`` (from its wheel) with each policy,
  request-scoped as vLLM's connector drives it (positions set, no ``touch``);
* our ``CPUStore``, driven the same way (its answers are checked to be vLLM's);
* with ``--before PATH`` (a checkout of an earlier tiered_kv, whose
  ``tiered_kv.manager.cpu_store.CPUStore`` had no request scope), that store
  driven as the tier manager drove it then: ``prepare_load`` then ``touch`` of
  the hits, stores without a request.

Usage: python benchmarks/bench_store_hits.py [--capacity 4096] [--running 16] [--chunk 4] [--before PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
TRACE = Path("/work/shared/traces/mooncake/conversation_trace.jsonl")
BLOCK = 512


def load_trace(path: Path) -> list[list[bytes]]:
    with path.open() as f:
        return [[b"m%d" % h for h in json.loads(line)["hash_ids"]] for line in f]


class Driver:
    """One store behind the connector's verbs: new, lookup, load, unload, store, complete, finish."""

    def __init__(self, kind: str, policy: str, capacity: int, v=None, old=None) -> None:
        self.kind = kind
        if kind == "vllm":
            self.v = v
            self.m = v.manager.CPUOffloadingManager(capacity, cache_policy=policy)
        elif kind == "ours":
            from tiered_kv.tiers.cpu_store import CPUStore, RequestContext

            self.m = CPUStore(capacity + 1, policy)
            self.ctx_cls = RequestContext
        else:
            self.m = old(capacity + 1, policy)

    def new(self, rid: int, keys: list) -> object:
        if self.kind == "vllm":
            ctx = self.v.base.ReqContext(req_id=str(rid))
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * BLOCK)
            self.m.on_new_request(ctx)
            return ctx
        if self.kind == "ours":
            ctx = self.ctx_cls(rid)
            ctx.set_positions(keys, BLOCK, BLOCK)
            self.m.on_new_request(ctx)
            return ctx
        return None

    def lookup(self, key, ctx) -> bool:
        if self.kind == "vllm":
            return self.m.lookup(key, ctx).name == "HIT"
        return self.m.lookup(key).name == "HIT"

    def load(self, keys, ctx) -> None:
        if self.kind == "old":
            self.m.prepare_load(keys)
            self.m.touch(keys)
        else:
            self.m.prepare_load(keys, ctx)

    def unload(self, keys, ctx) -> None:
        if self.kind == "vllm":
            self.m.complete_load(keys, ctx)
        else:
            self.m.complete_load(keys)

    def store(self, keys, ctx) -> list | None:
        out = self.m.prepare_store(keys) if self.kind == "old" else self.m.prepare_store(keys, ctx)
        return None if out is None else list(out.keys_to_store)

    def complete(self, keys, ctx) -> None:
        if self.kind == "vllm":
            self.m.complete_store(keys, ctx, True)
        else:
            self.m.complete_store(keys, True)

    def finish(self, ctx) -> None:
        if self.kind != "old":
            self.m.on_request_finished(ctx)


def serve(trace: list[list[bytes]], d: Driver, running: int, chunk: int) -> tuple[int, int, list[int]]:
    """(blocks found, blocks looked up, per-request hits) for the whole trace."""
    waiting = deque(enumerate(trace))
    active: list[list] = []  # [keys, ctx, next block to store, stores landing next step, hit keys]
    found = looked = 0
    per_request = []
    while waiting or active:
        while waiting and len(active) < running:
            rid, keys = waiting.popleft()
            ctx = d.new(rid, keys)
            n = 0
            for k in keys[:-1]:
                if not d.lookup(k, ctx):
                    break
                n += 1
            found, looked = found + n, looked + max(len(keys) - 1, 0)
            per_request.append(n)
            if n:
                d.load(keys[:n], ctx)
            active.append([keys, ctx, n, [], keys[:n]])
        for r in list(active):
            keys, ctx = r[0], r[1]
            for done in r[3]:
                d.complete(done, ctx)
            r[3] = []
            if r[2] < len(keys):
                part = keys[r[2] : r[2] + chunk]
                r[2] += len(part)
                got = d.store(part, ctx)
                if got:
                    r[3].append(got)
            elif not r[3]:
                if r[4]:
                    d.unload(r[4], ctx)
                d.finish(ctx)
                active.remove(r)
    return found, looked, per_request


def before_store(path: str):
    """The ``CPUStore`` class of an earlier checkout (imported in this process from that tree)."""
    sys.path.insert(0, path)
    for name in [n for n in sys.modules if n == "tiered_kv" or n.startswith("tiered_kv.")]:
        del sys.modules[name]
    mod = importlib.import_module("tiered_kv.manager.cpu_store")
    return mod.CPUStore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--running", type=int, default=16)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--before", help="a checkout of an earlier tiered_kv (runs in a subprocess)")
    p.add_argument("--only-before", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    trace = load_trace(a.trace)
    if a.only_before:
        old = before_store(a.before)
        for policy in ("lru", "arc"):
            f, n, _ = serve(trace, Driver("old", policy, a.capacity, old=old), a.running, a.chunk)
            print(f"| before (prepare_load + touch, no request scope) | {policy} | {f} | {n} | {f / n:.3f} |")
        return 0
    import vllm_ref_offload

    v = vllm_ref_offload.load()
    print(f"Mooncake conversation trace: {len(trace)} requests, capacity {a.capacity} blocks, "
          f"{a.running} running, stores of {a.chunk} blocks")  # fmt: skip
    print("| store | policy | blocks found | blocks looked up | hit rate |")
    print("| --- | --- | ---: | ---: | ---: |")
    for policy in ("lru", "arc"):
        fv, nv, hv = serve(trace, Driver("vllm", policy, a.capacity, v=v), a.running, a.chunk)
        fo, no, ho = serve(trace, Driver("ours", policy, a.capacity), a.running, a.chunk)
        assert ho == hv, f"{policy}: our store's hits differ from vLLM's"
        print(f"| vLLM 0.33.0 CPUOffloadingManager | {policy} | {fv} | {nv} | {fv / nv:.3f} |")
        print(f"| tiered_kv CPUStore (request scope) | {policy} | {fo} | {no} | {fo / no:.3f} |")
    sys.stdout.flush()
    if a.before:
        cmd = [sys.executable, __file__, "--only-before", "--before", a.before, "--capacity", str(a.capacity),
               "--running", str(a.running), "--chunk", str(a.chunk), "--trace", str(a.trace)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=a.before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
