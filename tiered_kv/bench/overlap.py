"""gpu-check's overlap part: do copies run under compute, and does the host ever wait?

**Swaps beside a forward pass** (per copy engine).  A prefill through a
Llama-shaped model (compute-bound on a GPU) is timed alone, the engine's
swap-out and swap-in (both directions at once) are timed alone, then both are
issued together: swaps first, the forward pass right behind them on the
compute stream, and the compute stream ordered after the swaps on the device
(``make_compute_wait``).  The forward pass is repeated until it takes about as
long as the swaps, so either could hide the other.  Reported:

* ``slowdown``: compute time beside the swaps over compute time alone;
* ``hidden``: the fraction of the swaps' time that did not add to the
  makespan, ``(compute + swaps - makespan) / swaps``;
* ``host_issue_s`` against ``makespan_s``: the host finished issuing
  everything long before the device finished, i.e. it did not wait;
* host synchronisations inside the issuing region, counted three ways (below),
  plus a control region that synchronises on purpose, so a counter that sees
  nothing is shown able to see.

**Layer-wise swap-in** (a swapped-out request resumes and computes a chunk).
``serial``: the engine's swap-in of every layer, then the chunk.  ``pipelined``
(a reference built here from plain torch copies on a side stream, not the
engine): layer ``i``'s K/V are copied while layer ``i - 1`` computes, and
layer ``i`` waits on the device for its own copy only.  ``engine_layerwise``:
the engine's own layer-wise plan (one event per layer), layer ``i`` waiting
through ``make_compute_wait(handle, layer=i)``; ``layerwise_gain`` is how much
sooner than ``serial`` (a whole-request load) the chunk is done.

**Host synchronisations.**  A region of code "makes no host synchronisation"
when the host never waits for the device inside it.  Three instruments look
for waits, each of which sees something the others miss:

* :class:`SyncCounter` counts calls of torch's explicit waits made from Python
  (``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize``)
  while a region is open: what the copy engines or the model would call.
* :class:`SyncDebug` turns on torch's sync debug mode (CUDA only) and counts
  its warnings: the waits hidden inside torch ops (``.item()``, a device tensor
  built from a Python list, a copy to pageable memory).
* :func:`trace_syncs` reads the exported profiler trace and counts the CUDA
  runtime and driver calls that block the host (``*Synchronize``, synchronous
  ``cudaMemcpy``) inside the region's annotation: this sees every library,
  cupy included, because it is recorded below them.

:func:`region_name` names the annotation; a region is opened with
``torch.profiler.record_function(region_name(...))``.

On a CPU every torch op runs on the calling thread, so "the device" is the
host: the CPU form runs the same code (copies on the CPU engine's threads)
and its numbers say nothing about a GPU.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tiered_kv.bench.bandwidth import engines_here
from tiered_kv.bench.model import LlamaShape, RandomLlama
from tiered_kv.bench.report import Deadline
from tiered_kv.bench.timing import spread, sync_device
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer.factory import make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferPlan

# gpu-check's overlap bench: a Llama-shaped model, its paged KV and the swap tiers, built once for every scenario.


class OverlapBench:
    """The model, the tiers and the engines of the overlap part."""

    def __init__(
        self,
        shape: LlamaShape,
        kv: KVSpec,
        compute_tokens: int,
        overlap_mib: int,
        layerwise_context: int,
        layerwise_chunk: int,
        block_size: int,
        device: str,
        repeats: int,
    ) -> None:
        self.device = device
        self.cuda = torch.device(device).type == "cuda"
        self.repeats = repeats
        self.bs = block_size
        self.model = RandomLlama(shape, device)
        # The compute model's own cache (layer-first: one layer's K/V of a run of blocks is contiguous).
        mspec = shape.kv_spec(block_size)
        self.ctx_blocks = -(-layerwise_context // block_size)
        req_blocks = -(-(layerwise_context + layerwise_chunk) // block_size)
        fwd_blocks = -(-compute_tokens // block_size)
        self.model_tiers = {
            "GPU": KVStorage(mspec, 1 + req_blocks + fwd_blocks, "GPU", "layer_first", device=device),
            "CPU": KVStorage(mspec, 1 + self.ctx_blocks, "CPU", "layer_first"),
        }
        self.req_table = list(range(1, 1 + req_blocks))
        fwd_table = list(range(1 + req_blocks, 1 + req_blocks + fwd_blocks))
        self.forward_batch = self.model.prepare([fwd_table], 0, compute_tokens, block_size)
        self.chunk_batch = self.model.prepare([self.req_table], layerwise_context, layerwise_chunk, block_size)
        # The swaps' tiers: the KV shape under test, half of each tier per direction.
        spec = kv.with_block_size(block_size)
        self.n = max((overlap_mib << 20) // spec.bytes_per_block, 1)
        self.swap_tiers = {
            "GPU": KVStorage(spec, 2 * self.n + 1, "GPU", "block_contiguous", device=device),
            "CPU": KVStorage(spec, 2 * self.n + 1, "CPU", "block_contiguous"),
        }
        for tiers in (self.model_tiers, self.swap_tiers):
            for t in tiers.values():
                t.byte_view().fill_(0)
        self.swap_bytes = 2 * self.n * spec.bytes_per_block
        self.next_id = 0
        self.side = torch.cuda.Stream() if self.cuda else None

    def next_plan_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def swap_plans(self) -> list[TransferPlan]:
        out_ids = tuple(range(1, self.n + 1))
        in_ids = tuple(range(self.n + 1, 2 * self.n + 1))
        return [
            TransferPlan(self.next_plan_id(), "GPU", "CPU", out_ids, out_ids, PlanKind.SWAP_OUT),
            TransferPlan(self.next_plan_id(), "CPU", "GPU", in_ids, in_ids, PlanKind.SWAP_IN, urgent=True),
        ]

    def forward(self, times: int) -> None:
        for _ in range(times):
            self.model.forward(self.forward_batch, self.model_tiers["GPU"])

    def close(self) -> None:
        for tiers in (self.model_tiers, self.swap_tiers):
            for t in tiers.values():
                t.close()


# gpu-check's measuring region: issue copies and compute, then time host issue, device makespan and syncs.
#
# On CUDA the region is timed by events on the compute stream; on a CPU, where
# every torch op runs on the calling thread, by the host clock.

Issue = Callable[[Callable[[str], None]], list[Any]]
"""A region's body: called with ``mark``; returns the copy handles it submitted."""


class Round:
    """One issued region and what it took: host issue time, device makespan, compute time, copy times."""

    def __init__(self) -> None:
        self.host_issue_s = 0.0
        self.makespan_s = 0.0
        self.compute_s = 0.0
        self.copy_s = 0.0
        self.syncs_python = 0
        self.syncs_debug = 0


class Issuer:
    """Runs a region on CUDA (events on the compute stream) or on a CPU (the host clock), counting syncs.

    ``run(issue)`` calls ``issue(mark)`` inside the region; ``issue`` returns the
    copy handles it submitted and calls ``mark("compute_start")`` /
    ``mark("compute_end")`` around its compute.
    """

    def __init__(self, device: str, engine: Any, counter: SyncCounter) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.engine = engine
        self.counter = counter

    def run(self, name: str, issue: Issue) -> Round:
        r = Round()
        sync_device(self.device)  # boundary
        marks: dict[str, Any] = {}

        def mark(what: str) -> None:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks[what] = ev
            else:
                marks[what] = time.perf_counter()

        debug = SyncDebug()
        t0 = time.perf_counter()
        with self.counter, debug, torch.profiler.record_function(region_name(name)):
            mark("start")
            handles = issue(mark)
            if self.cuda:
                for h in handles:
                    self.engine.make_compute_wait(h)
            mark("end")
        r.host_issue_s = time.perf_counter() - t0
        r.syncs_python = self.counter.total
        r.syncs_debug = debug.total
        self.counter.counts.clear()
        # Outside the region: the measurement boundary.
        for h in handles:
            if not h.wait(600):
                raise RuntimeError(f"plan {h.plan.plan_id} failed: {h.error}")
        if self.cuda:
            marks["end"].synchronize()
            r.makespan_s = marks["start"].elapsed_time(marks["end"]) / 1e3
            if "compute_start" in marks:
                r.compute_s = marks["compute_start"].elapsed_time(marks["compute_end"]) / 1e3
        else:
            finish = max([marks["end"], *(h.submitted_at + h.elapsed_s for h in handles)])
            r.makespan_s = finish - marks["start"]
            if "compute_start" in marks:
                r.compute_s = marks["compute_end"] - marks["compute_start"]
        r.copy_s = max((h.elapsed_s for h in handles), default=0.0)
        return r


def summarize(rounds: list[Round]) -> dict[str, Any]:
    return {
        "makespan_s": spread([r.makespan_s for r in rounds]),
        "compute_s": spread([r.compute_s for r in rounds]),
        "copy_s": spread([r.copy_s for r in rounds]),
        "host_issue_s": spread([r.host_issue_s for r in rounds]),
        "syncs_python": sum(r.syncs_python for r in rounds),
        "syncs_debug_mode": sum(r.syncs_debug for r in rounds),
    }


def hidden_fraction(compute: float, copies: float, makespan: float) -> float:
    if copies <= 0:
        return 0.0
    return max(0.0, min(1.0, (compute + copies - makespan) / copies))


# gpu-check's first overlap scenario: an engine's swaps in both directions beside a forward pass.
#
# The forward pass is timed alone, the swap-out and swap-in (issued together) are
# timed alone, then both are issued together: swaps first, the forward pass right
# behind them on the compute stream, which is ordered after the swaps on the
# device.  The forward pass is repeated until it takes about as long as the
# swaps, so either could hide the other.


def _regions(bench: OverlapBench, engine: Any) -> tuple[Issue, Callable[[int], Issue], Callable[[int], Issue]]:
    """The three regions: the swaps alone, ``k`` forward passes alone, and both together."""

    def copies_only(mark: Callable[[str], None]) -> list[Any]:
        return [engine.submit(p) for p in bench.swap_plans()]

    def compute_only(k: int) -> Issue:
        def issue(mark: Callable[[str], None]) -> list[Any]:
            mark("compute_start")
            bench.forward(k)
            mark("compute_end")
            return []

        return issue

    def both(k: int) -> Issue:
        def issue(mark: Callable[[str], None]) -> list[Any]:
            handles = [engine.submit(p) for p in bench.swap_plans()]
            mark("compute_start")
            bench.forward(k)
            mark("compute_end")
            return handles

        return issue

    return copies_only, compute_only, both


def duplex(bench: OverlapBench, kind: str, counter: SyncCounter, stop: Callable[[], bool]) -> dict[str, Any]:
    """The scenario for the copy engine ``kind``: slowdown of compute, fraction of copy time hidden, syncs."""
    engine = make_copy_engine(bench.swap_tiers, kind)
    issuer = Issuer(bench.device, engine, counter)
    name = f"duplex/{kind}"
    copies_only, compute_only, both = _regions(bench, engine)
    try:
        issuer.run(name, copies_only)  # untimed set-up runs
        one = [issuer.run(name, compute_only(1)) for _ in range(2)][-1].compute_s
        copies = [issuer.run(name, copies_only) for _ in range(bench.repeats)]
        t_copies = spread([r.makespan_s for r in copies])["median"]
        k = max(1, round(t_copies / one)) if one > 0 else 1
        compute: list[Round] = []
        together: list[Round] = []
        issuer.run(name, both(k))
        for _ in range(bench.repeats):
            if stop():
                break
            compute.append(issuer.run(name, compute_only(k)))
            together.append(issuer.run(name, both(k)))
    finally:
        engine.close()
    if not together:
        return {"engine": kind, "stopped": "out of time before a timed round"}
    c_alone = summarize(compute)["compute_s"]["median"]
    parts = (summarize(compute), summarize(copies), summarize(together))
    both_s = parts[2]
    return {
        "engine": kind,
        "swap_bytes_total": bench.swap_bytes,
        "forward_passes": k,
        "compute_alone": parts[0],
        "copies_alone": parts[1],
        "together": both_s,
        "slowdown": both_s["compute_s"]["median"] / c_alone if c_alone > 0 else None,
        "hidden": hidden_fraction(c_alone, t_copies, both_s["makespan_s"]["median"]),
        "serial_s": c_alone + t_copies,
        "copies_gbps_alone": bench.swap_bytes / t_copies / 1e9 if t_copies > 0 else None,
        "syncs_python": sum(s["syncs_python"] for s in parts),
        "syncs_debug_mode": sum(s["syncs_debug_mode"] for s in parts),
    }


# gpu-check's second overlap scenario: a swapped-out request resumes and computes a chunk.
#
# ``serial``: the engine's swap-in of every layer, then the chunk.  ``pipelined``
# (a reference built here from plain torch copies on a side stream, not the
# engine): layer ``i``'s K/V are copied while layer ``i - 1`` computes, and
# layer ``i`` waits on the device for its own copy only.  ``engine_layerwise``:
# the engine's own layer-wise plan (one event per layer), layer ``i`` waiting
# through ``make_compute_wait(handle, layer=i)``.


def layer_copies(bench: OverlapBench, events: list[Any]) -> None:
    """Copy the request's context back layer by layer; ``events[i]`` fires when layer ``i`` landed."""
    g, c = bench.model_tiers["GPU"], bench.model_tiers["CPU"]
    n, dst0 = bench.ctx_blocks, bench.req_table[0]
    for i, ev in enumerate(events):
        gk, gv = g.layer_kv(i)
        ck, cv = c.layer_kv(i)
        if bench.cuda:
            with torch.cuda.stream(bench.side):
                gk[dst0 : dst0 + n].copy_(ck[1 : 1 + n], non_blocking=True)
                gv[dst0 : dst0 + n].copy_(cv[1 : 1 + n], non_blocking=True)
                ev.record(bench.side)
        else:
            gk[dst0 : dst0 + n].copy_(ck[1 : 1 + n])
            gv[dst0 : dst0 + n].copy_(cv[1 : 1 + n])
            ev.set()


def _variants(bench: OverlapBench, engine: Any) -> dict[str, Issue]:
    """The regions compared: the copy alone, the chunk alone, and the three ways of doing both.

    Five closures over one engine and one request's block ids, side by side so
    that the variants differ visibly in one place each.
    """
    layers = bench.model.shape.num_layers
    ctx_ids = tuple(range(1, 1 + bench.ctx_blocks))
    dst_ids = tuple(bench.req_table[: bench.ctx_blocks])

    def swap_in(num_layers: int = 0) -> Any:
        plan = TransferPlan(
            bench.next_plan_id(), "CPU", "GPU", ctx_ids, dst_ids, PlanKind.SWAP_IN, urgent=True, num_layers=num_layers
        )
        return engine.submit(plan)

    def chunk(mark: Callable[[str], None], before: Callable[[int], None] | None = None) -> None:
        mark("compute_start")
        bench.model.forward(bench.chunk_batch, bench.model_tiers["GPU"], before)
        mark("compute_end")

    def serial(mark: Callable[[str], None]) -> list[Any]:
        h = swap_in()
        if bench.cuda:
            engine.make_compute_wait(h)  # on the device: the host does not wait
        elif not h.wait(600):  # a CPU has no device queue: compute must wait on the host
            raise RuntimeError(f"swap-in failed: {h.error}")
        chunk(mark)
        return [h]

    def pipelined(mark: Callable[[str], None]) -> list[Any]:
        if bench.cuda:
            events = [torch.cuda.Event() for _ in range(layers)]
            layer_copies(bench, events)
            cur = torch.cuda.current_stream()
            chunk(mark, lambda i: cur.wait_event(events[i]))
        else:
            flags = [threading.Event() for _ in range(layers)]
            t = threading.Thread(target=layer_copies, args=(bench, flags))
            t.start()
            chunk(mark, lambda i: flags[i].wait())
            t.join()
        return []

    def engine_layerwise(mark: Callable[[str], None]) -> list[Any]:
        h = swap_in(layers)  # the engine's own layer-wise plan: one event per layer
        if bench.cuda:
            chunk(mark, lambda i: engine.make_compute_wait(h, layer=i))
        else:
            chunk(mark, lambda i: h.wait_layer(i, 600))
        return [h]

    def copy_only(mark: Callable[[str], None]) -> list[Any]:
        return [swap_in()]

    def compute_only(mark: Callable[[str], None]) -> list[Any]:
        chunk(mark)
        return []

    return {
        "copy_alone": copy_only,
        "compute_alone": compute_only,
        "serial": serial,
        "engine_layerwise": engine_layerwise,
        "pipelined": pipelined,
    }


def layerwise(bench: OverlapBench, counter: SyncCounter, stop: Callable[[], bool]) -> dict[str, Any]:
    """Every variant, ``bench.repeats`` rounds each (interleaved); how much each hides and layer-wise's gain."""
    engine = make_copy_engine(bench.model_tiers, "cuda" if bench.cuda else "cpu")
    issuer = Issuer(bench.device, engine, counter)
    variants = _variants(bench, engine)
    rounds: dict[str, list[Round]] = {v: [] for v in variants}
    try:
        for v, fn in variants.items():
            issuer.run(f"layerwise/{v}", fn)  # untimed
        for _ in range(bench.repeats):
            if stop():
                break
            for v, fn in variants.items():
                rounds[v].append(issuer.run(f"layerwise/{v}", fn))
    finally:
        engine.close()
    if not rounds["serial"]:
        return {"stopped": "out of time before a timed round"}
    s = {v: summarize(r) for v, r in rounds.items()}
    copy = s["copy_alone"]["makespan_s"]["median"]
    comp = s["compute_alone"]["compute_s"]["median"]
    serial_s = s["serial"]["makespan_s"]["median"]
    engine_s = s["engine_layerwise"]["makespan_s"]["median"]
    return {
        "context_tokens": bench.ctx_blocks * bench.bs,
        "chunk_tokens": int(bench.chunk_batch.tokens.shape[1]),
        "layers": bench.model.shape.num_layers,
        "bytes": bench.ctx_blocks * bench.model_tiers["GPU"].spec.bytes_per_block,
        "variants": s,
        "serial_s": serial_s,
        "pipelined_reference_s": s["pipelined"]["makespan_s"]["median"],
        "hidden_serial": hidden_fraction(comp, copy, serial_s),
        "hidden_pipelined_reference": hidden_fraction(comp, copy, s["pipelined"]["makespan_s"]["median"]),
        "engine_layerwise_s": engine_s,
        "hidden_engine_layerwise": hidden_fraction(comp, copy, engine_s),
        # The gain of layer-wise over whole-request loads: how much sooner the chunk is computed.
        "layerwise_gain": serial_s / engine_s if engine_s > 0 else None,
    }


#: A trace larger than this is gzipped (Perfetto opens .json.gz as it is).
TRACE_GZIP_BYTES = 12 << 20


def traced(bench: OverlapBench, kinds: list[str], counter: SyncCounter, trace_path: Path) -> dict[str, Any]:
    """One round of each scenario and a deliberate sync under the profiler; counts from the exported trace."""
    names = [f"duplex/{k}" for k in kinds] + [f"layerwise/{v}" for v in ("serial", "engine_layerwise", "pipelined")]
    repeats, bench.repeats = bench.repeats, 1  # one timed round each: the trace is for reading, not timing
    try:
        with torch.profiler.profile(activities=profiler_activities()) as prof:
            for k in kinds:
                duplex(bench, k, counter, lambda: False)
            layerwise(bench, counter, lambda: False)
            with counter, torch.profiler.record_function(region_name("control/deliberate_sync")):
                if bench.cuda:
                    torch.cuda.current_stream().synchronize()
            control_python = counter.total
            counter.counts.clear()
    finally:
        bench.repeats = repeats
    prof.export_chrome_trace(str(trace_path))
    events = load_trace(trace_path)
    if trace_path.stat().st_size > TRACE_GZIP_BYTES:  # keep it small enough to carry back from a GPU machine
        packed = trace_path.with_name(trace_path.name + ".gz")
        packed.write_bytes(gzip.compress(trace_path.read_bytes()))
        trace_path.unlink()
        trace_path = packed
    out = {n: trace_syncs(events, region_name(n)) for n in names}
    control = trace_syncs(events, region_name("control/deliberate_sync"))
    control["python"] = control_python
    control["can_see"] = (control["total"] > 0 and control_python > 0) if bench.cuda else None
    if not bench.cuda:
        control["why"] = "no CUDA: nothing here can synchronise with a device, so the control has nothing to show"
    return {"file": trace_path.name, "regions": out, "control": control}


def _duplex_line(d: dict[str, Any]) -> str:
    return (
        f"overlap {d['engine']}: compute {d['compute_alone']['compute_s']['median'] * 1e3:.2f} ms alone, "
        f"{d['together']['compute_s']['median'] * 1e3:.2f} ms beside "
        f"{d['swap_bytes_total'] >> 20} MiB of swaps ({d['copies_alone']['makespan_s']['median'] * 1e3:.2f}"
        f" ms alone); makespan {d['together']['makespan_s']['median'] * 1e3:.2f} ms; slowdown "
        f"{d['slowdown']:.2f}x, {d['hidden']:.0%} of copy time hidden; host issued in "
        f"{d['together']['host_issue_s']['median'] * 1e3:.2f} ms; syncs: {d['syncs_python']} (python), "
        f"{d['syncs_debug_mode']} (debug mode)"
    )


def _layerwise_line(lw: dict[str, Any]) -> str:
    return (
        f"layer-wise swap-in of {lw['bytes'] >> 20} MiB ({lw['layers']} layers) + {lw['chunk_tokens']} "
        f"tokens: serial {lw['serial_s'] * 1e3:.2f} ms, pipelined reference "
        f"{lw['pipelined_reference_s'] * 1e3:.2f} ms ({lw['hidden_pipelined_reference']:.0%} of copy "
        f"hidden); engine layer-wise {lw['engine_layerwise_s'] * 1e3:.2f} ms "
        f"({lw['hidden_engine_layerwise']:.0%} hidden, {lw['layerwise_gain']:.2f}x faster than serial)"
    )


def _trace_line(t: dict[str, Any]) -> str:
    return (
        "trace: blocking CUDA calls inside the issuing regions: "
        + ", ".join(f"{n} {r['total']}" for n, r in t["regions"].items())
        + f"; control region (a deliberate sync): {t['control']['total']} in the trace, "
        f"{t['control']['python']} counted in python"
    )


def run_overlap(
    shape: LlamaShape,
    kv: KVSpec,
    compute_tokens: int,
    overlap_mib: int,
    layerwise_context: int,
    layerwise_chunk: int,
    block_size: int,
    device: str,
    repeats: int,
    deadline: Deadline,
    emit: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
    trace_path: Path,
) -> dict[str, Any]:
    """Both scenarios for every engine here, then the traced rounds; ``save`` after each step."""
    result: dict[str, Any] = {
        "compute": f"{shape.name}: prefill of {compute_tokens} tokens ({shape.dtype})",
        "kv_shape": f"{kv.num_layers}x{kv.num_kv_heads}x{kv.head_dim} {kv.dtype}, block {block_size}",
        "duplex": [],
        "stopped": None,
    }
    counter = SyncCounter().install()
    bench = OverlapBench(
        shape, kv, compute_tokens, overlap_mib, layerwise_context, layerwise_chunk, block_size, device, repeats
    )
    kinds = engines_here(device)
    try:
        for kind in kinds:
            if deadline.expired():
                result["stopped"] = f"time budget of {deadline.seconds:.0f} s reached before {kind}"
                break
            d = duplex(bench, kind, counter, deadline.expired)
            result["duplex"].append(d)
            if "slowdown" in d:
                emit(_duplex_line(d))
            save(result)
        if not deadline.expired():
            lw = layerwise(bench, counter, deadline.expired)
            result["layerwise"] = lw
            if "serial_s" in lw:
                emit(_layerwise_line(lw))
            save(result)
        if not deadline.expired():
            result["trace"] = traced(bench, kinds, counter, trace_path)
            emit(_trace_line(result["trace"]))
        else:
            result["stopped"] = result["stopped"] or f"time budget of {deadline.seconds:.0f} s reached"
        save(result)
        return result
    finally:
        counter.uninstall()
        bench.close()


REGION_PREFIX = "gpu_check/"
#: Runtime and driver calls after which the host has waited for the device.
BLOCKING_CALL = re.compile(r"(Synchronize|^cudaMemcpy$|^cudaMemcpy2D$|^cuMemcpyDtoH|^cuMemcpyHtoD(?!.*Async))")


def region_name(name: str) -> str:
    return REGION_PREFIX + name


class SyncCounter:
    """Counts explicit host waits made through torch's Python API while open.

    The wrapped functions still run; each call while a region is open adds one
    to ``counts[name]``.  Installed once, removed by :meth:`uninstall`.
    """

    TARGETS = (
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
        (torch.cuda.Event, "synchronize", "Event.synchronize"),
    )

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.open = False
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> SyncCounter:
        for owner, attr, label in self.TARGETS:
            original = getattr(owner, attr)
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._wrap(original, label))
        return self

    def _wrap(self, fn: Any, label: str) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.open:
                self.counts[label] += 1
            return fn(*args, **kwargs)

        return counted

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def __enter__(self) -> SyncCounter:
        self.open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.open = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class SyncDebug:
    """torch's sync debug mode ("warn") while open; counts the synchronising ops it reports.

    Only CUDA builds have the mode: elsewhere ``available`` is False and nothing is counted.
    """

    def __init__(self) -> None:
        self.available = torch.cuda.is_available() and hasattr(torch.cuda, "set_sync_debug_mode")
        self.messages: Counter[str] = Counter()
        self._catch: Any = None

    def __enter__(self) -> SyncDebug:
        if self.available:
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
            for w in self._log:
                text = str(w.message)
                if "synchroniz" in text.lower():
                    self.messages[text.split("\n")[0][:120]] += 1

    @property
    def total(self) -> int:
        return sum(self.messages.values())


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome/Perfetto JSON trace (plain or gzipped)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(raw)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def trace_syncs(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Blocking CUDA calls inside each occurrence of the annotation ``name`` (same thread, within its span).

    Returns ``{"regions": occurrences found, "calls": {call name: count}, "total": n,
    "cuda_api_events": CUDA runtime/driver events seen in the regions}``.
    """
    spans = [
        (e["pid"], e["tid"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("name") == name and e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]
    calls: Counter[str] = Counter()
    api = 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        ts = float(e["ts"])
        if not any(p == e["pid"] and t == e["tid"] and a <= ts <= b for p, t, a, b in spans):
            continue
        api += 1
        if BLOCKING_CALL.search(e.get("name", "")):
            calls[e["name"]] += 1
    return {"regions": len(spans), "calls": dict(calls), "total": sum(calls.values()), "cuda_api_events": api}


def profiler_activities() -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts
