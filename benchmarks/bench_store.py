"""CPU store benchmark: one connector-shaped call sequence against our store and a vLLM-structure store.

The trace (seeded): 20 000 requests over a 4096-block CPU store.  Prompts start
with one of 24 shared system prompts (8-48 blocks, Zipf s=1.1) or, 40% of the
time, resend a recent conversation whole (multi-turn); then 2-24 new user
blocks; outputs are long-tailed (median 10 blocks, at most 128).  Keys are
36-byte block hashes (32-byte hash + 4-byte group id, as vLLM keys its
offloaded blocks).

The driver plays the offloading connector against the vLLM-structure store
(``_vllm_style_store.py``), ``--running`` requests at a time (64 by default),
one step = one prefill chunk of up to 32 blocks or one decoded block per
request:

* admission: per-key ``lookup`` from the first block until one is not a hit
  (the last prompt block is always recomputed); hits are pinned with
  ``prepare_load`` and ``touch``-ed, and unpinned with ``complete_load`` 1-4
  steps later (the load's duration), before prefill;
* every step that completes full blocks: ``prepare_store`` of the blocks not
  yet offered (a refused store is offered again, with more blocks, next step);
* finish: the request's stores complete (``complete_store(..., True)`` for its
  successful ones, ``complete_store(..., False)`` for the 5% that failed), then
  ``on_request_finished``.  Stores stay pending until their request finishes,
  as in vLLM's connector, which learns of finished sends per request.

``--touches connector`` adds what vLLM's connector also does: a ``touch`` of
the whole prompt before its lookups and of every computed block after each
accepted store.  (Our tier manager touches only the blocks it loads.)

The calls are recorded with their results, then replayed against fresh stores:
first a checking pass (every result of ``tiered_kv``'s ``CPUStore`` must equal
the recorded one call for call: lookups, slots shifted by one, keys to store,
evicted keys in order, refusals; resident keys, slots, states and LRU order at
checkpoints and at the end), then timed passes.  ``tiered_kv`` is replayed
twice: with the same per-key ``lookup`` calls, and with one ``lookup_prefix``
per admission (the verb our tier manager uses).  Timings: whole replays (best
of ``--repeat``, alternating) and, in separate passes, per call kind with the
timer's own cost subtracted (best of ``--repeat``).  ``--sweep 32,64,128``
prints whole-replay ratios for several loads instead.

Usage: python benchmarks/bench_store.py [--requests N] [--running R | --sweep R1,R2,...] [--repeat K]
       [--touches hits|connector] [--status dataclass|ctypes] [--json PATH] [--count IMPL]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_style_store import BlockStatus, CBlockStatus, ReqContext, VCPUStoreManager, VLookupResult

from tiered_kv.manager.cpu_store import CPUStore

CAPACITY = 4096
MAX_RUNNING = 64
PREFILL_CHUNK = 32  # blocks per step
LOAD_STEPS = (1, 4)
STORE_FAIL = 0.05
GROUP0 = (0).to_bytes(4, "big")

# Call kinds, in table order.
LOOKUP, LOOKUP_PREFIX, TOUCH, LOAD, UNLOAD, STORE, COMPLETE, FINISH = range(8)
KIND_NAMES = [
    "lookup",
    "lookup_prefix",
    "touch",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
]


@dataclass(slots=True)
class StoreRequest:
    rid: int
    prompt: list[bytes]
    output: list[bytes]


def make_store_trace(
    num_requests: int = 20_000,
    num_system_prompts: int = 24,
    zipf_s: float = 1.1,
    followup_prob: float = 0.4,
    seed: int = 0,
) -> list[StoreRequest]:
    """Block-level requests: shared system prompts, multi-turn resends, new user and output blocks."""
    rng = random.Random(seed)

    def new_keys(n: int) -> list[bytes]:
        return [rng.randbytes(32) + GROUP0 for _ in range(n)]

    systems = [new_keys(rng.randint(8, 48)) for _ in range(num_system_prompts)]
    weights = [1 / (k + 1) ** zipf_s for k in range(num_system_prompts)]
    history: list[list[bytes]] = []
    out = []
    for rid in range(num_requests):
        base = None
        if history and rng.random() < followup_prob:
            base = history[rng.randrange(len(history))]
            if len(base) > 192:  # a conversation that long starts over
                base = None
        if base is None:
            base = systems[rng.choices(range(num_system_prompts), weights)[0]]
        prompt = base + new_keys(rng.randint(2, 24))
        # Output lengths are long-tailed: median ~10 blocks (160 tokens), up to 128.
        output = new_keys(min(128, max(1, round(rng.lognormvariate(2.3, 0.9)))))
        history.append(prompt + output)
        if len(history) > 256:
            history.pop(rng.randrange(len(history)))
        out.append(StoreRequest(rid, prompt, output))
    return out


# ------------------------------------------------------------------ recording
@dataclass
class Recording:
    """The connector's calls, in order, with what the vLLM-structure store answered.

    ``ops`` entries: ``(kind, rid, args, result)``.  A lookup entry is one
    admission's lookups: ``args`` is the keys looked at (the prompt minus its
    last block), ``result`` the per-key answers (names), ending at the first
    that is not a hit.  Slot ids are recorded as vLLM numbers them (from 0).
    """

    ops: list[tuple] = field(default_factory=list)
    num_requests: int = 0
    capacity: int = CAPACITY
    final: list[tuple] = field(default_factory=list)


@dataclass(slots=True)
class _Running:
    req: StoreRequest
    keys: list[bytes]
    ctx: ReqContext
    computed: int = 0
    offered: int = 0  # blocks handed to prepare_store so far (accepted)
    load_keys: list[bytes] | None = None
    load_done: int = 0
    ok: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)


def _norm_store(out: object, shift: int) -> tuple | None:
    if out is None:
        return None
    ids = out.store_spec.block_ids  # type: ignore[attr-defined]
    return (tuple(out.keys_to_store), tuple(i + shift for i in ids), tuple(out.evicted_keys))  # type: ignore[attr-defined]


def record(
    trace: list[StoreRequest],
    capacity: int = CAPACITY,
    seed: int = 1,
    touches: str = "hits",
    running: int = MAX_RUNNING,
) -> Recording:
    """Drive the vLLM-structure store the way the offloading connector does, recording every call.

    ``touches="hits"`` touches the loaded hits only; ``"connector"`` also
    touches the whole prompt before its lookups and every computed block after
    each accepted store, as vLLM's connector does.
    """
    rng = random.Random(seed)
    every_touch = touches == "connector"
    m = VCPUStoreManager(capacity)
    rec = Recording(num_requests=len(trace), capacity=capacity)
    ops = rec.ops
    pending = iter(trace)
    max_running = running
    running: list[_Running] = []
    step = 0
    more = True
    while more or running:
        while more and len(running) < max_running:
            req = next(pending, None)
            if req is None:
                more = False
                break
            st = _Running(req, req.prompt + req.output, ReqContext(str(req.rid)))
            if every_touch:
                m.touch(req.prompt, st.ctx)
                ops.append((TOUCH, req.rid, req.prompt, None))
            looked = req.prompt[:-1]
            answers = []
            for key in looked:
                answer = m.lookup(key, st.ctx)
                answers.append(answer.name)
                if answer is not VLookupResult.HIT:
                    break
            ops.append((LOOKUP, req.rid, looked, answers))
            hits = len(answers) - (answers[-1] != "HIT") if answers else 0
            if hits:
                st.load_keys = req.prompt[:hits]
                spec = m.prepare_load(st.load_keys, st.ctx)
                ops.append((LOAD, req.rid, st.load_keys, tuple(spec.block_ids)))
                if not every_touch:
                    m.touch(st.load_keys, st.ctx)
                    ops.append((TOUCH, req.rid, st.load_keys, None))
                st.load_done = step + rng.randint(*LOAD_STEPS)
            st.computed = st.offered = hits
            running.append(st)
        still = []
        for st in running:
            if st.load_keys is not None:
                if step < st.load_done:
                    still.append(st)
                    continue
                m.complete_load(st.load_keys, st.ctx)
                ops.append((UNLOAD, st.req.rid, st.load_keys, None))
                st.load_keys = None
            n_prompt = len(st.req.prompt)
            st.computed = min(n_prompt, st.computed + PREFILL_CHUNK) if st.computed < n_prompt else st.computed + 1
            new = st.keys[st.offered : st.computed]
            if new:
                out = m.prepare_store(new, st.ctx)
                ops.append((STORE, st.req.rid, new, _norm_store(out, 0)))
                if out is not None:
                    st.offered = st.computed
                    if out.keys_to_store and every_touch:
                        sofar = st.keys[: st.computed]
                        m.touch(sofar, st.ctx)
                        ops.append((TOUCH, st.req.rid, sofar, None))
                    if out.keys_to_store:
                        (st.failed if rng.random() < STORE_FAIL else st.ok).extend(out.keys_to_store)
            if st.computed < len(st.keys):
                still.append(st)
                continue
            for keys, success in ((st.ok, True), (st.failed, False)):
                if keys:
                    m.complete_store(keys, st.ctx, success)
                    ops.append((COMPLETE, st.req.rid, keys, success))
            m.on_request_finished(st.ctx)
            ops.append((FINISH, st.req.rid, None, None))
        running = still
        step += 1
    rec.final = [(key, block_id, ref) for key, block_id, ref in m.resident()]
    return rec


# ------------------------------------------------------------------- replaying
Call = tuple[int, Callable, tuple]


def vllm_calls(rec: Recording, m: VCPUStoreManager) -> list[Call]:
    ctxs: dict[int, ReqContext] = {}
    calls: list[Call] = []
    for kind, rid, args, result in rec.ops:
        ctx = ctxs.get(rid)
        if ctx is None:
            ctx = ctxs[rid] = ReqContext(str(rid))
        if kind == LOOKUP:
            calls.extend((LOOKUP, m.lookup, (key, ctx)) for key in args[: len(result)])
        elif kind == TOUCH:
            calls.append((TOUCH, m.touch, (args, ctx)))
        elif kind == LOAD:
            calls.append((LOAD, m.prepare_load, (args, ctx)))
        elif kind == UNLOAD:
            calls.append((UNLOAD, m.complete_load, (args, ctx)))
        elif kind == STORE:
            calls.append((STORE, m.prepare_store, (args, ctx)))
        elif kind == COMPLETE:
            calls.append((COMPLETE, m.complete_store, (args, ctx, result)))
        else:
            calls.append((FINISH, m.on_request_finished, (ctx,)))
    return calls


def ours_calls(rec: Recording, s: CPUStore, prefix: bool) -> list[Call]:
    """Our store's calls for the same sequence (it keeps no per-request state: no finish hook)."""
    calls: list[Call] = []
    for kind, _rid, args, result in rec.ops:
        if kind == LOOKUP:
            if prefix:
                calls.append((LOOKUP_PREFIX, s.lookup_prefix, (args,)))
            else:
                calls.extend((LOOKUP, s.lookup, (key,)) for key in args[: len(result)])
        elif kind == TOUCH:
            calls.append((TOUCH, s.touch, (args,)))
        elif kind == LOAD:
            calls.append((LOAD, s.prepare_load, (args,)))
        elif kind == UNLOAD:
            calls.append((UNLOAD, s.complete_load, (args,)))
        elif kind == STORE:
            calls.append((STORE, s.prepare_store, (args,)))
        elif kind == COMPLETE:
            calls.append((COMPLETE, s.complete_store, (args, result)))
    return calls


def new_vllm(rec: Recording, status: str = "dataclass") -> VCPUStoreManager:
    return VCPUStoreManager(rec.capacity, status_cls=CBlockStatus if status == "ctypes" else BlockStatus)


def new_ours(rec: Recording) -> CPUStore:
    return CPUStore(rec.capacity + 1, policy="lru")


def _ours_resident(s: CPUStore) -> list[tuple]:
    # Back to vLLM's numbering and encoding (slot - 1; ref -1 while pending).
    return [(e.key, e.block_id - 1, e.ref_cnt if e.ready else -1) for e in s.entries()]


class Mismatch(AssertionError):
    pass


def check(rec: Recording, status: str = "dataclass", every: int = 50_000) -> dict[str, int]:
    """Replay the recording against fresh stores and compare every decision; return what was compared."""
    m, s, sp = new_vllm(rec, status), new_ours(rec), new_ours(rec)
    counts = dict.fromkeys(["calls", "lookups", "stores", "refused", "evicted", "loads", "checkpoints", "resident"], 0)
    for n, (kind, rid, args, result) in enumerate(rec.ops):
        if n % every == 0:
            _same_resident(m, s, sp, n)
            counts["checkpoints"] += 1
        ctx = ReqContext(str(rid))
        if kind == LOOKUP:
            looked = args[: len(result)]
            got_v = [m.lookup(k, ctx).name for k in looked]
            got_s = [s.lookup(k).name for k in looked]
            hits = len(result) - (result[-1] != "HIT") if result else 0
            got_p = sp.lookup_prefix(args)
            if not (got_v == got_s == result and got_p == hits):
                raise Mismatch(f"op {n}: lookups {got_v} / {got_s} / prefix {got_p}, recorded {result}")
            counts["lookups"] += len(looked)
            counts["calls"] += len(looked)
            continue
        if kind == FINISH:
            m.on_request_finished(ctx)
            counts["calls"] += 1
            continue
        if kind == TOUCH:
            got = (m.touch(args, ctx), s.touch(args), sp.touch(args))
            want = (None, None, None)
        elif kind == LOAD:
            got = (
                tuple(m.prepare_load(args, ctx).block_ids),
                *(tuple(i - 1 for i in x.prepare_load(args).block_ids) for x in (s, sp)),
            )
            want = (result, result, result)
            counts["loads"] += 1
        elif kind == UNLOAD:
            got = (m.complete_load(args, ctx), s.complete_load(args), sp.complete_load(args))
            want = (None, None, None)
        elif kind == STORE:
            got = (
                _norm_store(m.prepare_store(args, ctx), 0),
                _norm_store(s.prepare_store(args), -1),
                _norm_store(sp.prepare_store(args), -1),
            )
            want = (result, result, result)
            counts["stores"] += 1
            counts["refused"] += result is None
            counts["evicted"] += len(result[2]) if result else 0
        else:
            got = (m.complete_store(args, ctx, result), s.complete_store(args, result), sp.complete_store(args, result))
            want = (None, None, None)
        counts["calls"] += 1
        if got != want:
            raise Mismatch(f"op {n} ({KIND_NAMES[kind]}): got {got}, recorded {want[0]}")
    _same_resident(m, s, sp, len(rec.ops))
    if m.resident() != rec.final:
        raise Mismatch("the replay of the vLLM-structure store does not end where the recording did")
    s.check_invariants()
    sp.check_invariants()
    counts["resident"] = len(rec.final)
    return counts


def _same_resident(m: VCPUStoreManager, s: CPUStore, sp: CPUStore, n: int) -> None:
    want = m.resident()
    if _ours_resident(s) != want or _ours_resident(sp) != want:
        raise Mismatch(f"after op {n}: resident keys, slots, states or LRU order differ")


# -------------------------------------------------------------------- timing
def run(calls: list[Call]) -> None:
    """Issue every call, in order."""
    for _, fn, args in calls:
        fn(*args)


def replay(calls: list[Call]) -> float:
    """Seconds to issue every call, in order."""
    gc.collect()
    gc.freeze()  # the trace's own objects are old: keep collections to what the stores allocate
    t0 = time.perf_counter()
    run(calls)
    t = time.perf_counter() - t0
    gc.unfreeze()
    return t


def _timer_cost(n: int = 200_000) -> float:
    """ns that one timed call adds around the call itself (two clock reads and the bookkeeping)."""
    pc = time.perf_counter_ns
    acc = [0]
    samples = []
    for _ in range(5):
        t0 = pc()
        for _ in range(n):
            t = pc()
            acc[0] += pc() - t
        samples.append((pc() - t0) / n)
    loop = []
    for _ in range(5):
        t0 = pc()
        for _ in range(n):
            pass
        loop.append((pc() - t0) / n)
    # Only the part inside the measured interval counts: one clock read, about half the pair.
    return max(0.0, (min(samples) - min(loop)) / 2)


def replay_by_kind(calls: list[Call], timer_ns: float) -> dict[int, tuple[int, float]]:
    """Per call kind: (calls, seconds), each call timed on its own, the timer's cost subtracted."""
    pc = time.perf_counter_ns
    total = [0] * len(KIND_NAMES)
    count = [0] * len(KIND_NAMES)
    gc.collect()
    gc.freeze()
    for kind, fn, args in calls:
        t = pc()
        fn(*args)
        total[kind] += pc() - t
        count[kind] += 1
    gc.unfreeze()
    return {k: (count[k], max(0.0, total[k] - timer_ns * count[k]) / 1e9) for k in range(len(KIND_NAMES)) if count[k]}


def keys_per_call(calls: list[Call]) -> dict[int, float]:
    n: dict[int, list[int]] = {}
    for kind, _fn, args in calls:
        n.setdefault(kind, []).append(len(args[0]) if kind not in (LOOKUP, FINISH) else 1)
    return {k: statistics.fmean(v) for k, v in n.items()}


IMPLS = ("vllm", "ours", "ours_prefix")


def make_calls(rec: Recording, impl: str, status: str) -> list[Call]:
    if impl == "vllm":
        return vllm_calls(rec, new_vllm(rec, status))
    return ours_calls(rec, new_ours(rec), prefix=impl == "ours_prefix")


def time_replays(rec: Recording, status: str, repeat: int) -> dict[str, float]:
    """Best whole-replay seconds per implementation, passes alternating between them."""
    best = dict.fromkeys(IMPLS, float("inf"))
    for _ in range(repeat):
        for impl in IMPLS:
            best[impl] = min(best[impl], replay(make_calls(rec, impl, status)))
    return best


def time_kinds(rec: Recording, status: str, repeat: int) -> tuple[dict[str, dict[int, tuple[int, float]]], float]:
    """Per implementation and call kind, (calls, best seconds over ``repeat`` passes); and the timer cost."""
    timer_ns = _timer_cost()
    best: dict[str, dict[int, tuple[int, float]]] = {impl: {} for impl in IMPLS}
    for _ in range(repeat):
        for impl in IMPLS:
            for kind, (n, t) in replay_by_kind(make_calls(rec, impl, status), timer_ns).items():
                if kind not in best[impl] or t < best[impl][kind][1]:
                    best[impl][kind] = (n, t)
    return best, timer_ns


def build(a: argparse.Namespace, running: int) -> tuple[Recording, dict[str, int]]:
    t0 = time.perf_counter()
    trace = make_store_trace(a.requests, seed=a.seed)
    rec = record(trace, a.capacity, seed=a.seed + 1, touches=a.touches, running=running)
    counts = check(rec, a.status)
    print(
        f"trace: {a.requests} requests, {running} running, capacity {a.capacity}, touches={a.touches}: "
        f"{len(rec.ops)} recorded ops ({time.perf_counter() - t0:.1f} s to build, record and check)"
    )
    print(
        "decisions identical, call for call: {calls} calls ({lookups} per-key lookups, and the same prefixes "
        "by lookup_prefix; {loads} loads; {stores} stores, {refused} of them refused; {evicted} evicted keys, in "
        "order); resident keys, slots, states and LRU order equal at {checkpoints} checkpoints and at the end "
        "({resident} resident)".format(**counts)
    )
    return rec, counts


def _us(t: tuple[int, float] | None) -> float | None:
    return t[1] / t[0] * 1e6 if t else None


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--capacity", type=int, default=CAPACITY)
    ap.add_argument("--running", type=int, default=MAX_RUNNING, help="requests running at once")
    ap.add_argument("--sweep", help="comma-separated running counts: whole-replay ratios only, one trace each")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--status", choices=["dataclass", "ctypes"], default="dataclass", help="vLLM-structure record")
    ap.add_argument(
        "--touches",
        choices=["hits", "connector"],
        default="hits",
        help="touch the loaded hits only, or also each prompt and each computed prefix, as vLLM's connector does",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--count",
        choices=["none", *IMPLS],
        help="build the trace, then replay one store once, untimed and unchecked (for instruction counters: "
        "run it under valgrind --tool=cachegrind and subtract the 'none' run)",
    )
    a = ap.parse_args()
    out: dict = {"args": {k: str(v) for k, v in vars(a).items()}}

    if a.count:
        rec = record(make_store_trace(a.requests, seed=a.seed), a.capacity, a.seed + 1, a.touches, a.running)
        calls = make_calls(rec, "vllm" if a.count == "none" else a.count, a.status)
        if a.count != "none":
            run(calls)
        return

    if a.sweep:
        rows = []
        for running in (int(x) for x in a.sweep.split(",")):
            rec, counts = build(a, running)
            best = time_replays(rec, a.status, a.repeat)
            rows.append((running, counts, best))
        print(f"\nWhole replay, best of {a.repeat}, by requests running at once:\n")
        print("| running | stores refused | vLLM-structure s | tiered_kv s | ratio | with `lookup_prefix` |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for running, counts, best in rows:
            v, o, p = best["vllm"], best["ours"], best["ours_prefix"]
            print(f"| {running} | {counts['refused']} | {v:.3f} | {o:.3f} | {v / o:.2f}× | {v / p:.2f}× |")
        out["sweep"] = [{"running": r, "check": c, "replay_s": b} for r, c, b in rows]
    else:
        rec, counts = build(a, a.running)
        best = time_replays(rec, a.status, a.repeat)
        kinds, timer_ns = time_kinds(rec, a.status, a.repeat)
        v, o, p = best["vllm"], best["ours"], best["ours_prefix"]
        print(f"\nWhole replay, best of {a.repeat} (vLLM-structure status record: {a.status}):\n")
        print("| store | seconds | ratio |")
        print("| --- | ---: | ---: |")
        print(f"| vLLM-structure (`_vllm_style_store.py`) | {v:.3f} | 1.00× |")
        print(f"| tiered_kv `CPUStore`, per-key lookups | {o:.3f} | {v / o:.2f}× |")
        print(f"| tiered_kv `CPUStore`, `lookup_prefix` | {p:.3f} | {v / p:.2f}× |")
        print(
            f"\nPer call kind (each call timed alone, best of {a.repeat} passes; "
            f"{timer_ns:.0f} ns of timer cost subtracted per call):\n"
        )
        print("| call | calls | keys/call | vLLM-structure µs/call | tiered_kv µs/call | ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        kpc = {
            **keys_per_call(make_calls(rec, "ours_prefix", a.status)),
            **keys_per_call(make_calls(rec, "vllm", a.status)),
        }
        rows = {}
        for kind, name in enumerate(KIND_NAMES):
            vk = kinds["vllm"].get(kind)
            ok = kinds["ours"].get(kind) or kinds["ours_prefix"].get(kind)
            if vk is None and ok is None:
                continue
            vu, ou = _us(vk), _us(ok)
            ratio = f"{vu / ou:.2f}×" if vu and ou else "—"
            n = (vk or ok)[0]  # type: ignore[index]
            rows[name] = {"calls": n, "keys_per_call": kpc[kind], "vllm_us": vu, "ours_us": ou}
            ours = _fmt(ou) if ou is not None else "— (no call)"
            print(f"| {name} | {n} | {kpc[kind]:.1f} | {_fmt(vu)} | {ours} | {ratio} |")
        per_req = 1e6 / rec.num_requests
        adm_v = kinds["vllm"][LOOKUP][1] * per_req
        adm_p = kinds["ours_prefix"][LOOKUP_PREFIX][1] * per_req
        fin_v = (kinds["vllm"][COMPLETE][1] + kinds["vllm"][FINISH][1]) * per_req
        fin_o = kinds["ours"][COMPLETE][1] * per_req
        print(
            f"\nPer request: lookups at admission {adm_v:.2f} µs (vLLM-structure, per-key) vs {adm_p:.2f} µs "
            f"(ours, lookup_prefix): {adm_v / adm_p:.2f}×; finish (its complete_store calls and the hook) "
            f"{fin_v:.2f} µs vs {fin_o:.2f} µs: {fin_v / fin_o:.2f}×."
        )
        out.update(check=counts, replay_s=best, by_kind=rows, timer_ns=timer_ns)
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
