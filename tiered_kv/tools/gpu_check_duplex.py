"""gpu-check's first overlap scenario: an engine's swaps in both directions beside a forward pass.

The forward pass is timed alone, the swap-out and swap-in (issued together) are
timed alone, then both are issued together: swaps first, the forward pass right
behind them on the compute stream, which is ordered after the swaps on the
device.  The forward pass is repeated until it takes about as long as the
swaps, so either could hide the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tiered_kv.tools.crossover_timing import spread
from tiered_kv.tools.gpu_check_bench import OverlapBench
from tiered_kv.tools.gpu_check_issuer import Issue, Issuer, Round, hidden_fraction, summarize
from tiered_kv.tools.gpu_check_syncs import SyncCounter
from tiered_kv.transfer.factory import make_copy_engine


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
        if hasattr(engine, "close"):
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
