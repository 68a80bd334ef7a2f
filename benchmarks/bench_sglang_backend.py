"""The SGLang HiCache backend against the page store under it, with the same pages, in the same run.

Runs in ``.venv-sglang`` (``bash scripts/setup-venv.sh sglang``).  The backend is built by
SGLang 0.5.23's own ``StorageBackendFactory`` (the ``dynamic`` path) over a host pool of
Llama-3-8B geometry (32 layers, 8 KV heads of 128, bf16, 16 tokens a page: 2 MiB pages) in
SGLang's default ``page_first`` layout (``tests/sglang_env.py``'s host pool double: SGLang's
real host pools do not import on the CPU wheel).  Each run measures, per tier:

* **backend set**: ``batch_set_v1`` of every page from the host pool's slots (each page
  gathered from the pool's K and V halves into one flat page, then stored), against the
  **anchor** ``PageStore.put`` of the same pages already flat and contiguous;
* **backend get**: ``batch_get_v1`` of every page into other slots (stored page -> flat
  page -> scattered into the pool), against ``PageStore.get`` into flat pages.

The ratio is the backend's rate over the anchor's: what the adapter's copies to and from
the host pool's layout cost.  Disk pages are read from the page cache (warm).

Usage: .venv-sglang/bin/python benchmarks/bench_sglang_backend.py [--pages N] [--runs R] [--no-redis]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang_env import HostPoolDouble, storage_config

LOADER = {
    "backend_name": "tiered_kv",
    "module_path": "tiered_kv.integrations.sglang",
    "class_name": "TieredKVHiCacheStorage",
    "interface_v1": 1,
}


def timed(fn) -> float:
    t = time.perf_counter()
    ok = fn()
    assert all(ok) if isinstance(ok, list) else ok, "a benchmark call failed"
    return time.perf_counter() - t


def run(tier: dict, pages: int, run_id: int) -> dict[str, float]:
    pool = HostPoolDouble(layout="page_first", layers=32, heads=8, head_dim=128, page_size=16, num_pages=2 * pages)
    pool.fill(seed=run_id)
    backend = StorageBackendFactory.create_backend("dynamic", storage_config({**LOADER, "tiers": [tier]}), None)
    backend.register_mem_pool_host(pool)
    try:
        store = backend.store
        page_bytes = store.page_bytes
        keys = [f"{run_id:04d}-backend-{i:06d}" for i in range(pages)]
        anchor_keys = [f"{run_id:04d}-anchor-{i:06d}" for i in range(pages)]
        flat = [pool.get_data_page(i * pool.page_size).contiguous() for i in range(pages)]
        outs = [torch.empty_like(f) for f in flat]
        src, dst = pool.slots(*range(pages)), pool.slots(*range(pages, 2 * pages))
        # warm up: the I/O engines' threads, the namespace directory, the server connection
        assert store.put(["warm-up"], flat[:1]) == [True] and store.get(["warm-up"], outs[:1]) == [True]
        t = {
            "backend set": timed(lambda: backend.batch_set_v1(keys, src)),
            "anchor put": timed(lambda: store.put(anchor_keys, flat)),
            "backend get": timed(lambda: backend.batch_get_v1(keys, dst)),
            "anchor get": timed(lambda: store.get(anchor_keys, outs)),
        }
        assert all(
            pool.page_bytes_at((pages + i) * pool.page_size) == pool.page_bytes_at(i * pool.page_size)
            for i in range(pages)
        )
        return {k: pages * page_bytes / v / 1e9 for k, v in t.items()}
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-redis", action="store_true")
    args = ap.parse_args()
    tiers = ["disk"] + ([] if args.no_redis else ["redis"])
    print(f"{args.pages} pages of 2 MiB, {args.runs} runs; GB/s (median of runs), ratio = backend / anchor")
    head = ("tier", "backend set", "anchor put", "ratio", "backend get", "anchor get", "ratio")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (6, 12, 11, 6, 12, 11, 6), strict=True)))
    for kind in tiers:
        rates: list[dict[str, float]] = []
        for r in range(args.runs):
            if kind == "disk":
                with tempfile.TemporaryDirectory() as root:
                    tier = {"type": "disk", "root": root, "capacity_bytes": 4 * args.pages * (3 << 20)}
                    rates.append(run(tier, args.pages, r))
            else:
                from tierutil import RedisServer

                server = RedisServer()
                try:
                    rates.append(run({"type": "redis", "url": server.url, "timeout_s": 5.0}, args.pages, r))
                finally:
                    server.stop()
        med = {k: sorted(x[k] for x in rates)[len(rates) // 2] for k in rates[0]}
        pairs = (("backend set", "anchor put"), ("backend get", "anchor get"))
        ratios = [sorted(x[a] / x[b] for x in rates) for a, b in pairs]
        rs = [f"{q[len(q) // 2]:.2f}" for q in ratios]
        print(
            f"{kind:6} {med['backend set']:12.2f} {med['anchor put']:11.2f} {rs[0]:>6} "
            f"{med['backend get']:12.2f} {med['anchor get']:11.2f} {rs[1]:>6}"
        )


if __name__ == "__main__":
    main()
