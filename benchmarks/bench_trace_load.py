"""Loading a production trace: prefix hashes kept as hashes, against expanding them into token ids.

Reads the shipped Mooncake conversation trace (12,031 requests, 12k input tokens on average) and
builds the simulator's requests, measuring wall time and peak Python memory (tracemalloc).  The
anchor, measured in the same run, is what replaying it took before requests could carry hashes:
every hash id expanded into 512 token ids (a JSONL of ``prompt_tokens``), loaded the same way.  The
anchor runs on the first ``--anchor-requests`` requests (2,000 by default, as the issue that asked
for hashes measured) because the whole trace expanded needs several GB; the ratio is per request.
Then one request's core record (``Request.from_hashes``) is built for the longest prompt and its
pool keys are hashed, to show the per-request cost of the simulation itself.

Usage: python benchmarks/bench_trace_load.py [--anchor-requests N]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered_kv.core import KVCacheManager, Request
from tiered_kv.sim.workload import load_trace

TRACE = Path(__file__).resolve().parent.parent / "configs" / "traces" / "mooncake" / "conversation_trace.jsonl"


def measure(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, peak MiB allocated while it ran, its result).

    Timed on a call of its own: tracing allocations slows Python several times over, so the
    memory is measured on a second call under tracemalloc.
    """
    gc.collect()
    t = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t
    del out
    gc.collect()
    tracemalloc.start()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return wall, peak / 2**20, out


def expanded(src: Path, dst: Path, n: int) -> int:
    """Write the first ``n`` requests with each hash id expanded into 512 token ids; return the file's bytes."""
    with src.open() as f, dst.open("w") as out:
        for i, line in enumerate(f):
            if i == n:
                break
            row = json.loads(line)
            tokens: list[int] = []
            for h in row["hash_ids"]:
                tokens.extend(range(h * 512, h * 512 + 512))
            tokens = tokens[: row["input_length"]]
            out.write(
                json.dumps(
                    {"arrival": row["timestamp"] / 1e3, "prompt_tokens": tokens, "output_len": row["output_length"]}
                )
                + "\n"
            )
    return dst.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchor-requests", type=int, default=2000)
    args = ap.parse_args()
    n_anchor = args.anchor_requests

    # Untimed warm-up: imports and the first read of the file.
    load_trace(TRACE, fmt="mooncake")
    wall, peak, reqs = measure(lambda: load_trace(TRACE, fmt="mooncake"))
    tokens = sum(r.prompt_len for r in reqs)
    rows = [("hashes, whole trace", len(reqs), TRACE.stat().st_size, wall, peak)]
    w2, p2, part = measure(lambda: load_trace(TRACE, fmt="mooncake")[:n_anchor])
    rows.append((f"hashes, first {n_anchor} (whole file read)", len(part), TRACE.stat().st_size, w2, p2))
    del part
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "expanded.jsonl"
        size = expanded(TRACE, dst, n_anchor)
        wa, pa, anchor = measure(lambda: load_trace(dst))
        rows.append((f"token ids, first {n_anchor} (anchor)", len(anchor), size, wa, pa))
        del anchor

    print(f"trace: {TRACE.name}, {len(reqs)} requests, {tokens} prompt tokens")
    print(f"{'load':38} {'requests':>8} {'file MB':>8} {'wall s':>7} {'peak MiB':>9} {'KiB/request':>11}")
    for name, n, nbytes, w, p in rows:
        print(f"{name:38} {n:8d} {nbytes / 1e6:8.1f} {w:7.3f} {p:9.1f} {p * 1024 / n:11.2f}")
    per_hash = rows[0][4] / rows[0][1]
    per_anchor = rows[2][4] / rows[2][1]
    print(f"memory per request, token ids / hashes: {per_anchor / per_hash:.0f}x")
    print(f"wall per request, token ids / hashes:   {(rows[2][3] / rows[2][1]) / (rows[0][3] / rows[0][1]):.0f}x")

    big = max(reqs, key=lambda r: r.prompt_len)
    mgr = KVCacheManager(num_blocks=16, block_size=16, hash_fn="fast")
    assert big.hashes is not None
    w, p, req = measure(lambda: Request.from_hashes("r", big.prompt_len, big.hashes, big.hash_block_size))
    wk, _, keys = measure(lambda: mgr.hasher.update(req))
    print(
        f"longest prompt ({big.prompt_len} tokens): Request.from_hashes {w * 1e3:.2f} ms, {p:.2f} MiB; "
        f"{len(keys)} pool keys hashed in {wk * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
