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
* host synchronisations inside the issuing region, counted three ways
  (:mod:`tiered_kv.tools.gpu_check_syncs`), plus a control region that
  synchronises on purpose, so a counter that sees nothing is shown able to see.

**Layer-wise swap-in** (a swapped-out request resumes and computes a chunk).
``serial``: the engine's swap-in of every layer, then the chunk.  ``pipelined``
(a reference built here from plain torch copies on a side stream, not the
engine): layer ``i``'s K/V are copied while layer ``i - 1`` computes, and
layer ``i`` waits on the device for its own copy only.  ``engine_layerwise``:
the engine's own layer-wise plan (one event per layer), layer ``i`` waiting
through ``make_compute_wait(handle, layer=i)``; ``layerwise_gain`` is how much
sooner than ``serial`` (a whole-request load) the chunk is done.

On a CPU every torch op runs on the calling thread, so "the device" is the
host: the CPU form runs the same code (copies on the CPU engine's threads)
and its numbers say nothing about a GPU.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tiered_kv.storage.spec import KVSpec
from tiered_kv.tools.crossover_model import LlamaShape
from tiered_kv.tools.gpu_check_bandwidth import engines_here
from tiered_kv.tools.gpu_check_bench import OverlapBench
from tiered_kv.tools.gpu_check_duplex import duplex
from tiered_kv.tools.gpu_check_layerwise import layerwise
from tiered_kv.tools.gpu_check_report import Deadline
from tiered_kv.tools.gpu_check_syncs import SyncCounter, load_trace, profiler_activities, region_name, trace_syncs

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
