"""tiered_kv's disk store as an LMCache 0.5.6 plug-in against LMCache's own LocalDiskBackend, in the same run.

Both run inside LMCache's own ``StorageManager`` on the CPU (``.venv-lmcache``), over
the same directory's file system, with the same chunks: LMCache ``MemoryObj``s from
its local CPU backend (``local_cpu`` off, so it is only the allocator), filled with
random bytes.  A chunk is 256 tokens of an 8-layer model with 8 KV heads of 128 dims in
float16 (8 MiB).

* **put**: ``StorageManager.batched_put`` of every chunk, until every write has ended
  (``exists_in_put_tasks`` false for all) and ``contains`` is true for all.  Ours frames
  each object in a page, writes a file per page (header with namespace, key and CRC-32,
  temporary name, rename); LMCache's writes the raw bytes with ``open``/``write``.
* **get**: ``get_blocking`` of every chunk, one after the other, from the page cache
  (both just wrote them).  Ours reads the page, checks its header and CRC-32, decodes the
  frame and copies the data into a new object; LMCache's reads the file into a new object.

Every put starts after ``os.sync()``.  The ratio is ours over LMCache's, per run; the
summary gives the range over ``--runs`` runs.

Usage: .venv-lmcache/bin/python benchmarks/bench_lmcache_plugin.py [--chunks N] [--runs R] [--dir PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

CHUNK_TOKENS = 256
KV_SHAPE = (8, 2, CHUNK_TOKENS, 8, 128)


def quiet_lmcache() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)


def manager(root: Path, ours: bool, chunks: int):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    chunk_bytes = 2 * KV_SHAPE[0] * CHUNK_TOKENS * KV_SHAPE[3] * KV_SHAPE[4] * 2
    cpu_gb = (chunks + 8) * chunk_bytes / 1024**3
    disk_gb = 2 * chunks * chunk_bytes / 1024**3
    common = {"chunk_size": CHUNK_TOKENS, "local_cpu": False, "max_local_cpu_size": cpu_gb}
    if ours:
        extra = {
            "storage_plugin.tkv.module_path": "tiered_kv.integrations.lmcache",
            "storage_plugin.tkv.class_name": "TieredKVStorage",
            "storage_plugin.tkv.tiers": [{"type": "disk", "root": str(root), "capacity_bytes": int(disk_gb * 1024**3)}],
        }
        config = LMCacheEngineConfig.from_defaults(**common, storage_plugins=["tkv"], extra_config=extra)
    else:
        config = LMCacheEngineConfig.from_defaults(**common, local_disk=f"file://{root}", max_local_disk_size=disk_gb)
    metadata = LMCacheMetadata(
        model_name="bench-model",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK_TOKENS,
    )
    sm = StorageManager(config, metadata, EventManager())
    quiet_lmcache()
    backend = sm.storage_backends["tkv" if ours else "LocalDiskBackend"]
    return sm, metadata, backend


def one_run(root: Path, ours: bool, chunks: int, seed: int) -> tuple[float, float, int]:
    """(put seconds, get seconds, bytes per chunk) for one backend."""
    from lmcache.utils import CacheEngineKey

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    sm, metadata, backend = manager(root, ours, chunks)
    try:
        shape = metadata.get_shapes()[0]
        keys = [CacheEngineKey("bench-model", 1, 0, seed * 100000 + i, torch.float16) for i in range(chunks)]
        objs = []
        gen = torch.Generator().manual_seed(seed)
        for _ in keys:
            o = sm.allocate(shape, torch.float16, busy_loop=False)
            assert o is not None, "the CPU pool is too small"
            raw = o.raw_data.view(torch.uint8)[: o.get_size()]
            raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
            objs.append(o)
        size = objs[0].get_size()
        os.sync()
        t0 = time.perf_counter()
        sm.batched_put(keys, objs)
        while any(backend.exists_in_put_tasks(k) for k in keys) or not all(backend.contains(k) for k in keys):
            time.sleep(0.0005)
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = []
        for k in keys:
            o = backend.get_blocking(k)
            assert o is not None and o.get_size() == size
            got.append(o)
        get_s = time.perf_counter() - t0
        for o in got:
            o.ref_count_down()
        return put_s, get_s, size
    finally:
        sm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the file system to test (default: a temp dir)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tkv-lmc-bench-", dir=args.dir))
    rows = []
    try:
        for run in range(args.runs):
            theirs = one_run(base / "lmcache", False, args.chunks, seed=2 * run)
            mine = one_run(base / "tiered_kv", True, args.chunks, seed=2 * run + 1)
            rows.append((theirs, mine))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    size = rows[0][0][2]
    mb = args.chunks * size / 1e6
    print(f"{args.chunks} chunks of {size / 2**20:.1f} MiB, {args.runs} runs, under {base.parent}")
    print(f"{'run':>3} | {'op':<4} | {'LMCache LocalDiskBackend MB/s':>30} | {'tiered_kv plug-in MB/s':>23} | ratio")
    ratios: dict[str, list[float]] = {"put": [], "get": []}
    for run, (theirs, mine) in enumerate(rows):
        for i, op in enumerate(("put", "get")):
            a, b = mb / theirs[i], mb / mine[i]
            ratios[op].append(b / a)
            print(f"{run:>3} | {op:<4} | {a:>30.0f} | {b:>23.0f} | {b / a:.2f}")
    for op, rs in ratios.items():
        print(f"{op}: tiered_kv / LMCache = {min(rs):.2f} .. {max(rs):.2f}")


if __name__ == "__main__":
    main()
