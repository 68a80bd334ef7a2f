"""gpu-check's transfer-bandwidth part: every copy engine against two anchors measured in the same run.

For each layout, block size, engine, id pattern (contiguous, scattered) and
direction (GPU to host, host to GPU, both at once) it times the copy engine
moving ``mib_per_case`` MiB each way, from submission until the host sees it
done.  Beside it, on the same tiers:

* **peak**: one contiguous copy of the same bytes between the same two tiers
  (two at once, on two streams, for duplex);
* **per-block loop**: a copy per block, per layer, per K/V, issued one after
  another on one stream, as vLLM v0's ``swap_blocks`` did.  On a GPU with cupy
  the loop calls ``cudaMemcpyAsync`` through cupy's thin runtime binding, the
  closest Python gets to v0's C++ loop; otherwise each copy is a torch ``copy_``.

Each point is one untimed run and ``repeats`` timed ones; rows carry the spread
and GB/s of the median.  The goals (45 GB/s one way, 75 GB/s duplex, 0.9 of
the peak for scattered block-contiguous copies) are evaluated on the GPU form
only: the CPU form's copies are host memory to host memory.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered_kv.bench.device import pcie_link
from tiered_kv.bench.report import Deadline
from tiered_kv.bench.timing import spread, sync_device
from tiered_kv.bench.transfer import case_fields, id_pattern
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec, segment_offsets
from tiered_kv.transfer.factory import available_kinds, make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferPlan

GB = 1e9
ONE_WAY_GOAL_GBPS = 45.0
DUPLEX_GOAL_GBPS = 75.0
SCATTERED_PEAK_RATIO_GOAL = 0.9
DIRECTIONS = ("D2H", "H2D", "duplex")


def engines_here(device: str) -> list[str]:
    """The copy engines to measure: the device engines on a GPU, the CPU engine otherwise."""
    kinds = available_kinds()
    if torch.device(device).type == "cuda":
        return [k for k in kinds if k in ("cuda", "cupy")]
    return ["cpu"]


class CaseTiers:
    """A GPU and a CPU tier for one (layout, block size), with the block ids each case uses.

    Each direction owns half of each tier (ids ``[1, half]`` for GPU to host,
    ``[half + 1, 2 * half]`` for host to GPU), so the duplex case never reads
    what it writes.  A scattered pattern samples ``n`` of ``half`` ids.
    """

    def __init__(self, spec: KVSpec, layout: str, n: int, device: str, seed: int) -> None:
        self.spec, self.layout, self.n, self.device = spec, layout, n, device
        self.half = 2 * n
        pool = 2 * self.half + 1
        self.tiers = {
            "GPU": KVStorage(spec, pool, "GPU", layout, device=device),
            "CPU": KVStorage(spec, pool, "CPU", layout),
        }
        for t in self.tiers.values():
            t.byte_view().fill_(1)  # every page touched before anything is timed
        self.rng = random.Random(seed)
        self.nbytes = n * spec.bytes_per_block

    def ids(self, pattern: str, direction: str) -> tuple[list[int], list[int]]:
        a, b = id_pattern(pattern, self.n, self.half + 1, self.rng)
        if direction == "H2D":
            return [x + self.half for x in a], [x + self.half for x in b]
        return a, b

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()


def _plans(ct: CaseTiers, pattern: str, direction: str, next_id: Callable[[], int]) -> list[TransferPlan]:
    out: list[TransferPlan] = []
    for d in ("D2H", "H2D") if direction == "duplex" else (direction,):
        src, dst = ct.ids(pattern, d)
        if d == "D2H":
            out.append(TransferPlan(next_id(), "GPU", "CPU", tuple(src), tuple(dst), PlanKind.SWAP_OUT))
        else:
            out.append(TransferPlan(next_id(), "CPU", "GPU", tuple(src), tuple(dst), PlanKind.SWAP_IN, urgent=True))
    return out


def time_engine(engine: Any, plans_for_run: Callable[[], list[TransferPlan]], device: str) -> tuple[float, float]:
    """Host seconds from submitting the plans to seeing all of them done, and the longest engine-reported time."""
    plans = plans_for_run()
    sync_device(device)
    t0 = time.perf_counter()
    handles = [engine.submit(p) for p in plans]
    for h in handles:
        if not h.wait(600):
            raise RuntimeError(f"plan {h.plan.plan_id} failed: {h.error}")
    return time.perf_counter() - t0, max(h.elapsed_s for h in handles)


def time_peak(ct: CaseTiers, direction: str, streams: list[Any]) -> float:
    """One contiguous copy of the case's bytes per direction (two at once for duplex, on two streams)."""
    g, c = ct.tiers["GPU"].byte_view(), ct.tiers["CPU"].byte_view()
    n, off = ct.nbytes, ct.half * ct.spec.bytes_per_block
    pairs = []
    if direction in ("D2H", "duplex"):
        pairs.append((c[:n], g[:n]))
    if direction in ("H2D", "duplex"):
        pairs.append((g[off : off + n], c[off : off + n]))
    sync_device(ct.device)
    t0 = time.perf_counter()
    for (dst, src), stream in zip(pairs, streams, strict=False):
        if stream is None:
            dst.copy_(src)
        else:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
    sync_device(ct.device)
    return time.perf_counter() - t0


class PerBlockLoop:
    """vLLM v0's swap: one copy per block, per layer, per K/V, issued in v0's order (layer, K/V, block)."""

    def __init__(self, ct: CaseTiers) -> None:
        self.ct = ct
        self.cuda = torch.device(ct.device).type == "cuda"
        self.cp = None
        if self.cuda:
            try:
                import cupy

                self.cp = cupy
                self.stream = cupy.cuda.Stream(non_blocking=True)
            except Exception:  # no cupy: torch copies on a torch stream
                self.stream = torch.cuda.Stream()
        self.name = "per_block_loop" + (" (cupy memcpyAsync)" if self.cp else " (torch copy_)")

    def _offsets(self, src_m: str, dst_m: str, src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int]]:
        s_t, d_t = self.ct.tiers[src_m], self.ct.tiers[dst_m]
        so = [segment_offsets(s_t.spec, s_t.layout, s_t.num_blocks, b) for b in src]
        do = [segment_offsets(d_t.spec, d_t.layout, d_t.num_blocks, b) for b in dst]
        return [(so[k][i], do[k][i]) for i in range(2 * s_t.spec.num_layers) for k in range(len(src))]

    def timer(self, pattern: str, direction: str) -> Callable[[], float]:
        src, dst = self.ct.ids(pattern, direction)
        src_m, dst_m = ("GPU", "CPU") if direction == "D2H" else ("CPU", "GPU")
        pairs = self._offsets(src_m, dst_m, src, dst)
        seg = self.ct.spec.segment_bytes
        s_flat, d_flat = self.ct.tiers[src_m].byte_view(), self.ct.tiers[dst_m].byte_view()

        def once() -> float:
            sync_device(self.ct.device)
            t0 = time.perf_counter()
            if self.cp is not None:
                sb, db, ptr = s_flat.data_ptr(), d_flat.data_ptr(), self.stream.ptr
                memcpy = self.cp.cuda.runtime.memcpyAsync
                for s, d in pairs:
                    memcpy(db + d, sb + s, seg, 4, ptr)  # 4: cudaMemcpyDefault
            elif self.cuda:
                with torch.cuda.stream(self.stream):
                    for s, d in pairs:
                        d_flat[d : d + seg].copy_(s_flat[s : s + seg], non_blocking=True)
            else:
                for s, d in pairs:
                    d_flat[d : d + seg].copy_(s_flat[s : s + seg])
            sync_device(self.ct.device)
            return time.perf_counter() - t0

        return once


def _point(fn: Callable[[], Any], repeats: int) -> list[Any]:
    fn()  # untimed: first-call set-up
    return [fn() for _ in range(repeats)]


def goals(rows: list[dict[str, Any]], applies: bool) -> list[dict[str, Any]]:
    """Each goal per engine over the block-contiguous rows: the value, the threshold, and whether it was met."""
    if not applies:
        return [
            {
                "goal": name,
                "applies": False,
                "why": "CPU form: copies are host memory to host memory; the goals are for an H200's PCIe",
            }
            for name in ("one_way_gbps", "duplex_gbps", "scattered_over_peak")
        ]
    out = []
    engines = sorted({r["engine"] for r in rows if not r["engine"].startswith("per_block_loop")})
    for eng in engines:
        mine = [r for r in rows if r["engine"] == eng and r["layout"] == "block_contiguous"]
        checks = (
            ("one_way_gbps", [r for r in mine if r["direction"] in ("D2H", "H2D")], "gbps", ONE_WAY_GOAL_GBPS),
            ("duplex_gbps", [r for r in mine if r["direction"] == "duplex"], "gbps", DUPLEX_GOAL_GBPS),
            (
                "scattered_over_peak",
                [r for r in mine if r["pattern"] == "scattered"],
                "ratio",
                SCATTERED_PEAK_RATIO_GOAL,
            ),
        )
        for name, cases, key, threshold in checks:
            if not cases:
                continue
            worst = min(cases, key=lambda r: r[key])
            out.append(
                {
                    "goal": name,
                    "engine": eng,
                    "applies": True,
                    "threshold": threshold,
                    "worst": worst[key],
                    "worst_case": f"{worst['block_tokens']} tokens/block, {worst['pattern']}, {worst['direction']}",
                    "cases": len(cases),
                    "met": all(r[key] >= threshold for r in cases),
                }
            )
    return out


def run_bandwidth(
    spec: KVSpec,
    block_tokens: Sequence[int],
    layouts: Sequence[str],
    mib_per_case: int,
    repeats: int,
    device: str,
    deadline: Deadline,
    emit: Callable[[str], None],
    save: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Measure the matrix until done or out of time; ``save`` gets the result so far after each group."""
    cuda = torch.device(device).type == "cuda"
    engines = engines_here(device)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "kv_shape": f"{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim} {spec.dtype}",
        "mib_per_case": mib_per_case,
        "repeats": repeats,
        "engines": engines,
        "timing": "host wall time from submission until every plan is seen done (median of repeats)",
        "rows": rows,
        "stopped": None,
    }
    plan_id = [0]

    def next_id() -> int:
        plan_id[0] += 1
        return plan_id[0]

    emit(
        f"{'engine':30} {'layout':16} {'tok':>4} {'pattern':10} {'dir':6} {'MiB':>5} {'GB/s':>8} {'peak':>8} "
        f"{'ratio':>6} {'spread':>6}"
    )
    streams = [torch.cuda.Stream(), torch.cuda.Stream()] if cuda else [None, None]
    groups = list(itertools.product(layouts, block_tokens))
    for seed, (layout, bt) in enumerate(groups, 1):
        if deadline.expired():
            result["stopped"] = f"time budget of {deadline.seconds:.0f} s reached before {layout}, {bt} tokens"
            break
        s = spec.with_block_size(bt)
        n = max((mib_per_case << 20) // s.bytes_per_block, 2)
        ct = CaseTiers(s, layout, n, device, seed)
        result["cpu_tier_pinned"] = ct.tiers["CPU"].pinned
        try:
            if cuda and "pcie_during_copies" not in result:
                result["pcie_during_copies"] = pcie_under_load(ct, streams)
            got = _measure_group(ct, engines, repeats, streams, deadline, next_id, emit)
        finally:
            ct.close()
        rows += got
        if len(got) < len(engines) * 2 * len(DIRECTIONS) + 4:
            result["stopped"] = f"time budget of {deadline.seconds:.0f} s reached during {layout}, {bt} tokens"
            break
        save(result)
    result["goals"] = goals(rows, cuda)
    save(result)
    return result


def pcie_under_load(ct: CaseTiers, streams: list[Any], limit_s: float = 20.0) -> dict[str, Any]:
    """Read the PCIe link while duplex copies keep it busy (an idle link may report a lower generation)."""
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.append(pcie_link()), daemon=True)
    reader.start()
    t0 = time.monotonic()
    while reader.is_alive() and time.monotonic() - t0 < limit_s:
        for _ in range(4):
            time_peak_async(ct, streams)
        sync_device(ct.device)  # a bounded queue: the link stays busy, the host never runs far ahead
    reader.join(1.0)
    return got[0] if got else {"unavailable": f"no answer within {limit_s:.0f} s"}


def _measure_group(
    ct: CaseTiers,
    engines: Sequence[str],
    repeats: int,
    streams: list[Any],
    deadline: Deadline,
    next_id: Callable[[], int],
    emit: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Every engine's cases and the per-block loop's on one pair of tiers, beside the peak copies."""
    rows: list[dict[str, Any]] = []
    s = ct.spec
    peaks = {d: spread(_point(lambda d=d: time_peak(ct, d, streams), repeats)) for d in DIRECTIONS}
    for eng_name in engines:
        engine = make_copy_engine(ct.tiers, eng_name)
        try:
            for pattern, direction in itertools.product(("contiguous", "scattered"), DIRECTIONS):
                if deadline.expired():
                    break

                def plans(p: str = pattern, d: str = direction) -> list[TransferPlan]:
                    return _plans(ct, p, d, next_id)

                runs = _point(lambda plans=plans, engine=engine: time_engine(engine, plans, ct.device), repeats)
                rows.append(_row(eng_name, ct.layout, s, pattern, direction, ct.nbytes, runs, peaks[direction]))
                emit(_line(rows[-1]))
        finally:
            engine.close()
    loop = PerBlockLoop(ct)
    for pattern, direction in itertools.product(("contiguous", "scattered"), ("D2H", "H2D")):
        if deadline.expired():
            break
        runs = [(t, t) for t in _point(loop.timer(pattern, direction), repeats)]
        rows.append(_row(loop.name, ct.layout, s, pattern, direction, ct.nbytes, runs, peaks[direction]))
        emit(_line(rows[-1]))
    return rows


def time_peak_async(ct: CaseTiers, streams: list[Any]) -> None:
    """Queue one duplex contiguous copy without waiting (to load the link while it is read)."""
    g, c = ct.tiers["GPU"].byte_view(), ct.tiers["CPU"].byte_view()
    n, off = ct.nbytes, ct.half * ct.spec.bytes_per_block
    with torch.cuda.stream(streams[0]):
        c[:n].copy_(g[:n], non_blocking=True)
    with torch.cuda.stream(streams[1]):
        g[off : off + n].copy_(c[off : off + n], non_blocking=True)


def _row(
    engine: str,
    layout: str,
    s: KVSpec,
    pattern: str,
    direction: str,
    nbytes: int,
    runs: list[tuple[float, float]],
    peak: dict[str, Any],
) -> dict[str, Any]:
    moved = nbytes * (2 if direction == "duplex" else 1)
    wall = spread([w for w, _ in runs])
    return {
        **case_fields(engine, layout, s, pattern, direction, moved),
        "seconds": wall,
        "engine_seconds": spread([e for _, e in runs]),
        "gbps": moved / wall["median"] / GB,
        "gbps_best": moved / wall["min"] / GB,
        "peak_seconds": peak,
        "peak_gbps": moved / peak["median"] / GB,
        "ratio": peak["median"] / wall["median"],
    }


def _line(r: dict[str, Any]) -> str:
    sp = (r["seconds"]["max"] - r["seconds"]["min"]) / r["seconds"]["median"]
    return (
        f"{r['engine']:30} {r['layout']:16} {r['block_tokens']:4d} {r['pattern']:10} {r['direction']:6} "
        f"{r['bytes'] >> 20:5d} {r['gbps']:8.2f} {r['peak_gbps']:8.2f} {r['ratio']:6.2f} {sp:6.0%}"
    )
