"""What a load from a tier below the CPU costs per block: the numbers behind ``TierLink`` (cost_model.py).

The tier manager prices a load from disk or Redis as ``n * (block_latency_s +
bytes / bytes_per_s)``.  This measures both terms on this machine: it loads
blocks of two sizes (the tiny engine's 4 KiB blocks, and Llama-3-8B's 2 MiB
ones) through the tier's I/O engine (``DiskIO``: open, header check, ``preadv``
into the CPU slot, CRC-32, close, on 4 threads; ``RedisIO``: pipelined ``GET``
of 16 blocks, header and CRC check, copy), and fits the line through the two
per-block times: the slope is 1 / bytes_per_s, the intercept block_latency_s.

Anchors, in the same run, on the same blocks: for disk, a plain loop that
opens, reads and closes each block file on one thread; for Redis, a pipelined
``GET`` loop (16 per pipeline) that only receives the values.  Disk loads come
from the page cache (the files were just written), so the disk's numbers are
the file system's and the CPU's, not the device's; ``bench_tiers.py`` measures
cold reads of large blocks.

Usage: python benchmarks/bench_tier_links.py [--runs R] [--no-redis]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import LLAMA3_8B, KVSpec
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.kinds.disk import DiskTierConfig
from tiered_kv.tiers.kinds.redis import RedisTierConfig
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.transfer.plan import TransferPlan

TINY = KVSpec(2, 2, 32, "float32", 4)  # the engine's default model: 4 KiB blocks
SIZES = ((TINY, 256), (LLAMA3_8B, 24))  # (spec, blocks per measurement)


def tier_and_anchor(medium: str, spec: KVSpec, n: int, url: str | None) -> tuple[float, float]:
    """Seconds per block: a load through the tier's engine, and its anchor, on the same blocks."""
    ns = KVNamespace("bench", spec, "sha256/v1")
    host = KVStorage(spec, n + 1, "CPU", "block_contiguous", device="cpu", pin=False)
    keys = [i.to_bytes(4, "big") * 8 for i in range(1, n + 1)]
    slots = tuple(range(1, n + 1))
    with tempfile.TemporaryDirectory() as root:
        if medium == "DISK":
            store = DiskStore(root, ns, (n + 1) * (spec.bytes_per_block + 8192))
            io = DiskIO(host, store)
        else:
            from tiered_kv.tiers.redis_io import RedisIO
            from tiered_kv.tiers.redis_store import RedisStore, connect

            store = RedisStore(connect(url, timeout_s=5.0), ns)
            io = RedisIO(host, store)
        out = store.prepare_store(keys)
        h = io.submit(TransferPlan(1, "CPU", medium, slots, out.store_spec.block_ids))
        assert h.wait(120) and h.ok, h.error
        store.complete_store(keys)
        src = store.prepare_load(keys)
        t0 = time.perf_counter()
        h = io.submit(TransferPlan(2, medium, "CPU", src.block_ids, slots))
        assert h.wait(120) and h.ok, h.error
        tier = (time.perf_counter() - t0) / n
        store.complete_load(keys)
        t0 = time.perf_counter()
        if medium == "DISK":
            for k in keys:
                with open(store.path_of(k), "rb", buffering=0) as f:
                    f.read()
        else:
            for i in range(0, n, 16):
                pipe = store.client.pipeline(transaction=False)
                for k in keys[i : i + 16]:
                    pipe.get(store.data_key(k))
                pipe.execute()
        anchor = (time.perf_counter() - t0) / n
        io.close()
        if medium == "DISK":
            store.close()
        else:
            store.client.flushall()
    return tier, anchor


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(bytes_per_s, block_latency_s)`` of the line through two (bytes, seconds per block) points."""
    (b1, t1), (b2, t2) = points
    slope = (t2 - t1) / (b2 - b1)
    bw = 1 / slope if slope > 0 else float("inf")
    return bw, max(t1 - b1 * slope, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()
    media = ["DISK"]
    server = None
    if not args.no_redis:
        from tierutil import RedisServer

        server = RedisServer()
        media.append("REMOTE")
    try:
        print("| medium | block | tier, us/block (median of runs) | anchor, us/block | tier / anchor |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for medium in media:
            points = []
            for spec, n in SIZES:
                runs = [tier_and_anchor(medium, spec, n, server.url if server else None) for _ in range(args.runs)]
                tier = statistics.median(r[0] for r in runs)
                anchor = statistics.median(r[1] for r in runs)
                lo, hi = min(r[0] for r in runs), max(r[0] for r in runs)
                size = f"{spec.bytes_per_block // 1024} KiB"
                print(
                    f"| {medium} | {size} | {tier * 1e6:.1f} ({lo * 1e6:.1f}-{hi * 1e6:.1f}) | "
                    f"{anchor * 1e6:.1f} | {tier / anchor:.2f} |"
                )
                points.append((spec.bytes_per_block, tier))
            bw, lat = fit(points)
            d = next(k.default_link for k in (DiskTierConfig, RedisTierConfig) if k.medium == medium)
            print(
                f"|   fit: {bw / 1e9:.2f} GB/s, {lat * 1e6:.1f} us/block "
                f"(default TierLink: {d.bytes_per_s / 1e9:.2f} GB/s, {d.block_latency_s * 1e6:.0f} us) | | | | |"
            )
    finally:
        if server is not None:
            server.stop()
    print("Disk loads are from the page cache; bench_tiers.py measures cold reads of 2 MiB blocks.")


if __name__ == "__main__":
    main()
