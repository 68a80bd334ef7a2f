"""Disk and remote tiers: the tier's throughput against plain I/O of the same bytes, in the same run.

Blocks are Llama-3-8B blocks (16 tokens, 2 MiB), staged in a CPU tier filled
with random bytes.  Each run measures, with the same blocks:

Disk (``DiskStore`` + ``DiskIO``, default thread pools: 2 store, 4 load workers):

* **tier store**: one plan storing every block (a file each: header, CRC-32,
  ``writev`` to a temporary name, rename), against **plain write**: the same
  bytes written with ``os.write`` into one file, sequentially, in one thread;
* **tier store, fsync=data** against **plain write, fdatasync per block**;
* **tier load** (checks the header and the CRC of every block) against **plain
  read** (``preadv`` of the same bytes from the one file into the same CPU
  slots), both from the page cache (*warm*) and after every file was synced and
  dropped from the page cache with ``posix_fadvise(DONTNEED)`` (*cold*);
* ``dd`` writing and reading the same number of 2 MiB blocks (from
  ``/dev/zero``, to ``/dev/null``; the process start is included), where ``dd``
  exists, as a second reference.

Remote (``RedisStore`` + ``RedisIO`` against a ``redis-server`` started on a
free localhost port, no persistence; default pools: 2 store, 4 load workers,
16 blocks per pipeline):

* **tier store** (claim and existence check, then ``SET NX`` and claim
  release: two round trips per pipeline) against **plain SET**: a pipelined
  ``SET`` loop of the same values, 16 per pipeline, one thread;
* **tier load** (``GET``, header and CRC check, copy into the CPU slot) against
  **plain GET**: a pipelined ``GET`` loop, 16 per pipeline, one thread, that
  only receives the values;
* ``redis-benchmark -t set,get -d <block bytes> -P 16 -c 1``, where it exists.

Every write starts after ``os.sync()``, so that none pays for the write-back
of the one before it.  Ratios are the tier's rate over its anchor's in the same
run; the summary gives the range over ``--runs`` runs.

Usage: python benchmarks/bench_tiers.py [--blocks N] [--runs R] [--dir PATH] [--no-redis] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import LLAMA3_8B
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_engine import HostBlocks
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.transfer.plan import TransferPlan

NS = KVNamespace("bench-llama3-8b", LLAMA3_8B, "sha256/v1")
BPB = LLAMA3_8B.bytes_per_block
PIPELINE = 16


def keys_for(run: int, n: int) -> list[bytes]:
    return [run.to_bytes(4, "big") + i.to_bytes(28, "big") for i in range(n)]


def drop_cache(paths: list[Path]) -> None:
    """Write back and evict files from the page cache, so the next read comes from the device."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, settle: bool = False) -> float:
    """Seconds ``fn`` takes; with ``settle``, after writing back every dirty page (so a write does not
    pay for the write-back of the measurement before it)."""
    if settle:
        os.sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------ disk
def disk_run(host: KVStorage, root: Path, run: int, n: int) -> dict[str, float]:
    """Seconds of each disk measurement of one run."""
    out: dict[str, float] = {}
    blocks = HostBlocks(host)
    slots = tuple(range(1, n + 1))
    for fsync in ("none", "data"):
        d = root / f"tier-{run}-{fsync}"
        with DiskStore(d, NS, (n + 1) * 4 * 2**20) as store, DiskIO(host, store, fsync=fsync) as io:
            keys = keys_for(run, n)
            res = store.prepare_store(keys)

            def store_all(res=res, io=io) -> None:
                assert io.submit(TransferPlan(1, "CPU", "DISK", slots, res.store_spec.block_ids)).wait()

            out[f"tier store fsync={fsync}"] = timed(store_all, settle=True)
            store.complete_store(keys)
            if fsync == "none":
                spec = store.prepare_load(keys)

                def load_all(spec=spec, io=io) -> None:
                    assert io.submit(TransferPlan(2, "DISK", "CPU", spec.block_ids, slots)).wait()

                out["tier load warm"] = timed(load_all)
                drop_cache([store.path_of(k) for k in keys])
                out["tier load cold"] = timed(load_all)
                store.complete_load(keys)
        shutil.rmtree(d)

    plain = root / f"plain-{run}.bin"

    def write_plain(sync: bool) -> None:
        fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for s in slots:
                view = blocks.segments(s)[0]
                while view:
                    view = view[os.write(fd, view) :]
                if sync:
                    os.fdatasync(fd)
        finally:
            os.close(fd)

    def read_plain() -> None:
        fd = os.open(plain, os.O_RDONLY)
        try:
            for i, s in enumerate(slots):
                assert os.preadv(fd, blocks.segments(s), i * BPB) == BPB
        finally:
            os.close(fd)

    out["plain write fdatasync"] = timed(lambda: write_plain(True), settle=True)
    out["plain write"] = timed(lambda: write_plain(False), settle=True)
    out["plain read warm"] = timed(read_plain)
    drop_cache([plain])
    out["plain read cold"] = timed(read_plain)
    plain.unlink()
    if shutil.which("dd"):
        target = root / f"dd-{run}.bin"
        bs = f"bs={BPB}"
        out["dd write"] = timed(
            lambda: subprocess.run(["dd", "if=/dev/zero", f"of={target}", bs, f"count={n}", "status=none"], check=True),
            settle=True,
        )
        out["dd read warm"] = timed(
            lambda: subprocess.run(["dd", f"if={target}", "of=/dev/null", bs, "status=none"], check=True)
        )
        target.unlink()
    return out


DISK_PAIRS = [
    ("tier store fsync=none", "plain write"),
    ("tier store fsync=data", "plain write fdatasync"),
    ("tier load warm", "plain read warm"),
    ("tier load cold", "plain read cold"),
]


# ------------------------------------------------------------------ redis
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def redis_run(host: KVStorage, port: int, run: int, n: int) -> dict[str, float]:
    from tiered_kv.tiers.redis_io import RedisIO
    from tiered_kv.tiers.redis_store import RedisStore, connect

    out: dict[str, float] = {}
    url = f"redis://127.0.0.1:{port}/0"
    client = connect(url, timeout_s=10.0)
    client.flushall()
    slots = tuple(range(1, n + 1))
    store = RedisStore(connect(url, timeout_s=10.0), NS)
    with RedisIO(host, store, batch_blocks=PIPELINE) as io:
        keys = keys_for(run, n)
        res = store.prepare_store(keys)

        def store_all() -> None:
            h = io.submit(TransferPlan(1, "CPU", "REMOTE", slots, res.store_spec.block_ids))
            assert h.wait(), h.error

        out["tier store"] = timed(store_all)
        store.complete_store(keys)
        spec = store.prepare_load(keys)

        def load_all() -> None:
            h = io.submit(TransferPlan(2, "REMOTE", "CPU", spec.block_ids, slots))
            assert h.wait(), h.error

        out["tier load"] = timed(load_all)
        store.complete_load(keys)
    client.flushall()
    blocks = HostBlocks(host)
    names = [f"plain:{run}:{i}" for i in range(n)]

    def plain_set() -> None:
        for i in range(0, n, PIPELINE):
            pipe = client.pipeline(transaction=False)
            for j in range(i, min(i + PIPELINE, n)):
                pipe.set(names[j], blocks.segments(slots[j])[0])
            pipe.execute()

    def plain_get() -> None:
        for i in range(0, n, PIPELINE):
            pipe = client.pipeline(transaction=False)
            for j in range(i, min(i + PIPELINE, n)):
                pipe.get(names[j])
            assert all(len(v) == BPB for v in pipe.execute())

    out["plain SET"] = timed(plain_set)
    out["plain GET"] = timed(plain_get)
    client.flushall()
    if shutil.which("redis-benchmark"):
        cmd = ["redis-benchmark", "-p", str(port), "-t", "set,get", "-d", str(BPB), "-n", str(n)]
        text = subprocess.run([*cmd, "-P", str(PIPELINE), "-c", "1", "--csv"], capture_output=True, text=True).stdout
        for line in text.splitlines():
            cells = [c.strip('"') for c in line.split(",")]
            if cells[0] in ("SET", "GET"):
                out[f"redis-benchmark {cells[0]}"] = n / float(cells[1])  # seconds for n requests
        client.flushall()
    return out


REDIS_PAIRS = [("tier store", "plain SET"), ("tier load", "plain GET")]


# ------------------------------------------------------------------ report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128, help="blocks per measurement (2 MiB each)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the disk tier writes (default: a temporary directory)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.blocks
    host = KVStorage(LLAMA3_8B, n + 1, "CPU", device="cpu", pin=False)
    host.kv.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8))
    root = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    redis = None
    if not args.no_redis:
        if shutil.which("redis-server") is None:
            print("redis-server not found: the remote tier is skipped (apt-get install redis-server)")
        else:
            redis = start_redis()
    runs: list[dict[str, float]] = []
    try:
        for run in range(args.runs):
            secs = disk_run(host, root, run, n)
            if redis is not None:
                secs |= redis_run(host, redis[1], run, n)
            runs.append(secs)
            print(f"run {run + 1}: " + ", ".join(f"{k} {rate(k, v, n)}" for k, v in secs.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if redis is not None:
            redis[0].kill()
            redis[0].wait()
    print(f"\n{n} blocks of {BPB // 2**20} MiB per measurement; ranges over {len(runs)} runs\n")
    print("| measurement | rate | anchor | anchor rate | tier / anchor |")
    print("| --- | ---: | --- | ---: | ---: |")
    for tier, anchor in DISK_PAIRS + (REDIS_PAIRS if redis is not None else []):
        ratios = [r[anchor] / r[tier] for r in runs]
        print(
            f"| {tier} | {span([rate(tier, r[tier], n) for r in runs])} | {anchor} | "
            f"{span([rate(anchor, r[anchor], n) for r in runs])} | {min(ratios):.2f}–{max(ratios):.2f} |"
        )
    others = sorted({k for r in runs for k in r} - {k for p in DISK_PAIRS + REDIS_PAIRS for k in p})
    for k in others:
        print(f"| {k} | {span([rate(k, r[k], n) for r in runs if k in r])} | | | |")
    if args.json:
        Path(args.json).write_text(json.dumps({"blocks": n, "block_bytes": BPB, "seconds": runs}, indent=1))


def rate(name: str, seconds: float, n: int) -> str:
    """GB/s for disk measurements, blocks/s for the remote ones."""
    if any(w in name for w in ("SET", "GET")) or name in ("tier store", "tier load"):
        return f"{n / seconds:.0f} blocks/s"
    return f"{n * BPB / seconds / 1e9:.2f} GB/s"


def span(values: list[str]) -> str:
    nums = [float(v.split()[0]) for v in values]
    unit = values[0].split()[1]
    lo, hi = min(nums), max(nums)
    fmt = "{:.0f}" if unit == "blocks/s" else "{:.2f}"
    return f"{fmt.format(lo)}–{fmt.format(hi)} {unit}"


if __name__ == "__main__":
    main()
