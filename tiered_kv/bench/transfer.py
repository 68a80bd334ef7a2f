"""Transfer benchmark: our copy engine against one contiguous copy of the same bytes.

For each layout, block size (16/32/64/128 tokens), id pattern (contiguous,
scattered, interleaved swap-in + swap-out) and direction it measures the
engine's bandwidth and, in the same run, the bandwidth of one contiguous copy
of the same number of bytes between the same two tiers (``peak_gbps``).  On a
GPU it adds vLLM v0's way, a ``cudaMemcpyAsync`` per block per layer.

Each case prints a table row and, with ``--json``, writes one JSON row with
``layout, block_tokens, kv_shape, pattern, direction, engine, gbps, peak_gbps, ratio``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered_kv.bench.timing import sync_device
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import LAYOUTS, LLAMA3_8B, KVSpec
from tiered_kv.transfer.factory import ENGINE_KINDS as ENGINES
from tiered_kv.transfer.factory import available_kinds, make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferPlan

GB = 1e9


def _sync() -> None:
    if torch.cuda.is_available():  # the GPU tier is on the device exactly when there is one
        sync_device("cuda")


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def check_engines(engines: Sequence[str]) -> None:
    """Refuse an engine this machine cannot run, so a row is never labelled with an engine that did not run it."""
    for name in engines:
        if name not in ENGINES:
            raise InvalidArgumentError(f"--engines: unknown engine {name!r} (choose from {', '.join(ENGINES)})")
        if name in ("cuda", "cupy") and not torch.cuda.is_available():
            raise InvalidArgumentError(f"--engines {name}: needs a CUDA device, and torch sees none here")
        if name == "cupy":
            try:
                import cupy  # noqa: F401
            except ImportError:
                raise InvalidArgumentError(
                    "--engines cupy: cupy is not installed (pip install 'tiered-kv[cupy]')"
                ) from None


def id_pattern(pattern: str, n: int, pool: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Source and destination ids: contiguous runs, or random scattered blocks of a pool."""
    if pattern == "contiguous":
        return list(range(1, n + 1)), list(range(1, n + 1))
    src = rng.sample(range(1, pool), n)
    dst = rng.sample(range(1, pool), n)
    return src, dst


class _Bench:
    """Times one engine over one pair of tiers: plans through the engine, and the contiguous anchor."""

    def __init__(self, tiers: dict[str, KVStorage], engine: object, repeats: int) -> None:
        self.tiers = tiers
        self.flat = {m: t.byte_view() for m, t in tiers.items()}
        self.engine = engine
        self.repeats = repeats
        self.next_id = 0

    def plan(self, src_m: str, dst_m: str, src: Sequence[int], dst: Sequence[int]) -> TransferPlan:
        self.next_id += 1
        kind = PlanKind.SWAP_IN if dst_m == "GPU" else PlanKind.SWAP_OUT
        return TransferPlan(self.next_id, src_m, dst_m, tuple(src), tuple(dst), kind, urgent=dst_m == "GPU")

    def engine_time(self, specs: list[tuple[str, str, Sequence[int], Sequence[int]]]) -> float:
        """Best wall time to submit these plans together and wait for all of them."""

        def once() -> float:
            plans = [self.plan(*sp) for sp in specs]
            _sync()
            t0 = time.perf_counter()
            handles = [self.engine.submit(p) for p in plans]  # type: ignore[attr-defined]
            for h in handles:
                if not h.wait(60):
                    raise RuntimeError(f"plan {h.plan.plan_id} failed: {h.error}")
            return time.perf_counter() - t0

        return _best(once, self.repeats)

    def peak_time(self, src_m: str, dst_m: str, nbytes: int) -> float:
        """Best time of one contiguous copy of ``nbytes`` between the same two tiers."""
        src, dst = self.flat[src_m][:nbytes], self.flat[dst_m][:nbytes]

        def once() -> float:
            _sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync()
            return time.perf_counter() - t0

        return _best(once, self.repeats)


# One case: (pattern, direction, plan specs submitted together, bytes moved).
_Case = tuple[str, str, list[tuple[str, str, list[int], list[int]]], int]


def run_cases(
    spec: KVSpec = LLAMA3_8B,
    block_tokens: Sequence[int] = (16, 32, 64, 128),
    layouts: Sequence[str] = LAYOUTS,
    bytes_per_case: int = 128 << 20,
    engines: Sequence[str] | None = None,
    repeats: int = 3,
    seed: int = 0,
    emit: Callable[[str], None] = print,
) -> list[dict[str, object]]:
    """Time every engine over every layout, block size, id pattern and direction; one row per case.

    Each (layout, block size) gets fresh tiers and its own ``random.Random(seed)``,
    shared by its engines in turn and then by vLLM v0's loop, so a run is
    reproducible case by case.
    """
    cuda = torch.cuda.is_available()
    if engines is None:
        engines = [k for k in available_kinds() if k != "cpu"] or ["cpu"]
    check_engines(engines)
    rows: list[dict[str, object]] = []
    emit(
        f"{'engine':10} {'layout':16} {'tok':>4} {'pattern':12} {'dir':5} {'MiB':>6} {'GB/s':>8} "
        f"{'peak':>8} {'ratio':>6}"
    )
    for layout in layouts:
        for bt in block_tokens:
            s = spec.with_block_size(bt)
            n = max(bytes_per_case // s.bytes_per_block, 2)
            half = 2 * n + 1  # ids 1..half-1 for one direction, half..2*half-2 for the other
            tiers = _touched_tiers(s, layout, 2 * half)
            rng = random.Random(seed)
            for eng_name in engines:
                engine = make_copy_engine(tiers, eng_name)  # by name: never a silent fallback
                bench = _Bench(tiers, engine, repeats)
                for case in _cases(n, half, n * s.bytes_per_block, rng):
                    rows.append(_time_case(bench, eng_name, layout, s, case, emit))
                engine.close()
            if cuda:
                rows.extend(_vllm_v0_loop(tiers, s, layout, n, half, rng, repeats, emit))
    return rows


def _touched_tiers(s: KVSpec, layout: str, pool: int) -> dict[str, KVStorage]:
    """A GPU and a CPU tier of ``pool`` blocks, every page touched so that first-touch faults stay out of timings."""
    tiers = {"GPU": KVStorage(s, pool, "GPU", layout), "CPU": KVStorage(s, pool, "CPU", layout)}
    for t in tiers.values():
        t.byte_view().fill_(1)  # touch every page before timing
    return tiers


def _cases(n: int, half: int, nbytes: int, rng: random.Random) -> list[_Case]:
    """Contiguous and scattered copies each way, then a swap-out and a swap-in of disjoint ids submitted together."""
    cases: list[_Case] = []
    for pattern in ("contiguous", "scattered"):
        for src_m, dst_m, d in (("GPU", "CPU", "D2H"), ("CPU", "GPU", "H2D")):
            a, b = id_pattern(pattern, n, half, rng)
            cases.append((pattern, d, [(src_m, dst_m, a, b)], nbytes))
    a, b = id_pattern("scattered", n, half, rng)
    c, d = id_pattern("scattered", n, half, rng)
    out_ids = (a, b)
    in_ids = ([x + half - 1 for x in c], [x + half - 1 for x in d])
    cases.append(("interleaved", "both", [("GPU", "CPU", *out_ids), ("CPU", "GPU", *in_ids)], 2 * nbytes))
    return cases


def case_fields(engine: str, layout: str, s: KVSpec, pattern: str, direction: str, nbytes: int) -> dict[str, Any]:
    """What names one measured case in a row (bench-transfer's and gpu-check's bandwidth rows alike)."""
    return {
        "engine": engine,
        "layout": layout,
        "block_tokens": s.block_size,
        "kv_shape": f"{s.num_layers}x{s.num_kv_heads}x{s.head_dim} {s.dtype}",
        "pattern": pattern,
        "direction": direction,
        "bytes": nbytes,
    }


def _time_case(
    bench: _Bench, eng_name: str, layout: str, s: KVSpec, case: _Case, emit: Callable[[str], None]
) -> dict[str, object]:
    """Time one case through the engine and its contiguous anchor; print its table row and return its JSON row."""
    pattern, direction, specs, moved = case
    dt = bench.engine_time(specs)
    pk = bench.peak_time(specs[0][0], specs[0][1], moved)
    row = {
        **case_fields(eng_name, layout, s, pattern, direction, moved),
        "seconds": dt,
        "gbps": moved / dt / GB,
        "peak_gbps": moved / pk / GB,
        "ratio": pk / dt,
    }
    emit(
        f"{eng_name:10} {layout:16} {s.block_size:4d} {pattern:12} {direction:5} {moved >> 20:6d} "
        f"{row['gbps']:8.2f} {row['peak_gbps']:8.2f} {row['ratio']:6.2f}"
    )
    return row


def _vllm_v0_loop(
    tiers, s: KVSpec, layout: str, n: int, half: int, rng: random.Random, repeats: int, emit: Callable[[str], None]
) -> list[dict[str, object]]:
    """vLLM v0's swap_blocks: one cudaMemcpyAsync per block, per layer, per K/V."""
    rows = []
    for pattern in ("contiguous", "scattered"):
        for src_m, dst_m, d in (("GPU", "CPU", "D2H"), ("CPU", "GPU", "H2D")):
            a, b = id_pattern(pattern, n, half, rng)
            src, dst = tiers[src_m], tiers[dst_m]

            def once(a=a, b=b, src=src, dst=dst) -> float:
                _sync()
                t0 = time.perf_counter()
                for layer in range(s.num_layers):
                    sk, sv = src.layer_kv(layer)
                    dk, dv = dst.layer_kv(layer)
                    for x, y in zip(a, b, strict=True):
                        dk[y].copy_(sk[x], non_blocking=True)
                        dv[y].copy_(sv[x], non_blocking=True)
                _sync()
                return time.perf_counter() - t0

            dt = _best(once, repeats)
            moved = n * s.bytes_per_block
            rows.append(
                {
                    **case_fields("vllm_v0_loop", layout, s, pattern, d, moved),
                    "seconds": dt,
                    "gbps": moved / dt / GB,
                    "peak_gbps": float("nan"),
                    "ratio": float("nan"),
                }
            )
            emit(
                f"{'vllm_v0':10} {layout:16} {s.block_size:4d} {pattern:12} {d:5} {moved >> 20:6d} "
                f"{moved / dt / GB:8.2f}"
            )
    return rows
