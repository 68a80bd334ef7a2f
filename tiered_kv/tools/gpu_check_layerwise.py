"""gpu-check's second overlap scenario: a swapped-out request resumes and computes a chunk.

``serial``: the engine's swap-in of every layer, then the chunk.  ``pipelined``
(a reference built here from plain torch copies on a side stream, not the
engine): layer ``i``'s K/V are copied while layer ``i - 1`` computes, and
layer ``i`` waits on the device for its own copy only.  ``engine_layerwise``:
the engine's own layer-wise plan (one event per layer), layer ``i`` waiting
through ``make_compute_wait(handle, layer=i)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from tiered_kv.tools.gpu_check_bench import OverlapBench
from tiered_kv.tools.gpu_check_issuer import Issue, Issuer, Round, hidden_fraction, summarize
from tiered_kv.tools.gpu_check_syncs import SyncCounter
from tiered_kv.transfer.factory import make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferPlan


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

    About 60 lines on purpose: five small closures over one engine and one
    request's block ids read best side by side, as the variants they are.
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
        if hasattr(engine, "close"):
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
