"""Block-hashing benchmark: every scheme against the bare ``hashlib.sha256`` floor.

Hashes every full block of a seeded serving trace (``_trace.py``: shared system
prompts, multi-turn follow-ups, decoded outputs; 16-token blocks) with:

* ``sha256 before``: the SHA-256 path as it was before tokens were packed once
  per call (one hash-function call per block, a per-block ``struct`` argument
  list), kept here as the anchor of that change;
* ``sha256``: :class:`tiered_kv.core.BlockHasher` with SHA-256;
* ``xxh3_128``: the same byte layout under XXH3-128 (needs ``xxhash``);
* ``fast``: the 64-bit tuple hash;

and the floors: ``hashlib.sha256(x).digest()`` (and ``xxh3_128_digest(x)``) over
exactly the bytes the SHA-256 chain hashes, prebuilt, in a list comprehension:
hashing with no packing, slicing, chaining or call overhead at all.

Three ways of calling the hasher, each over the whole trace:

* ``trace``: as the managers call it: the prompt in one ``update`` on
  admission, then one ``update`` per output block, as decoding fills it;
* ``bulk``: prompt and output in one ``update`` per request;
* ``per-block``: one ``update`` per block.

Times are the best of ``--repeats`` passes, every scheme and floor timed in
every pass so that noise on a shared machine hits them alike; every ratio is
within one run.  A hasher's time is net of the driver's own work (appending
the tokens, timed alone in the same passes and shown as its own row); its
``update`` calls stay in.  The digests of both SHA-256 paths and of the floor
are checked equal.

Usage: python benchmarks/bench_hashing.py [--requests N] [--repeats R] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _trace import TraceRequest, make_trace

from tiered_kv.core import BlockHash, BlockHasher, Request
from tiered_kv.core.hashing import ExtraKeys, block_extra_keys, root_hash, sha256_block_hash

try:
    import xxhash
except ImportError:  # the benchmark still runs; the table says what is missing
    xxhash = None

BLOCK_SIZE = 16
MODES = ("trace", "bulk", "per-block")
SHA_FLOOR = "hashlib.sha256 floor"
XXH_FLOOR = "xxh3_128 floor"

# ---------------------------------------------------------------- the "before" anchor
# Kept line for line from the hasher before packing once, so the anchor pays what
# the old code paid (slotted record, per-block calls, the plain-request check).
_OLD_PACKERS: dict[int, Callable[..., bytes]] = {}


def old_sha256_block_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
    n = len(token_ids)
    pack = _OLD_PACKERS.get(n)
    if pack is None:
        pack = _OLD_PACKERS[n] = struct.Struct(f"<I{n}q").pack
    if parent.__class__ is not bytes or len(parent) != 32 or extra_keys is not None:  # type: ignore[arg-type]
        return sha256_block_hash(parent, token_ids, extra_keys)  # never taken on this trace
    return hashlib.sha256(parent + pack(n, *token_ids)).digest()


@dataclass(slots=True)
class OldHasher:
    block_size: int
    root: BlockHash = field(default_factory=lambda: root_hash(sha256_block_hash, 0))
    num_hashed_blocks: int = 0

    def update(self, request: Request) -> list[BlockHash]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        num_full = len(tokens) // bs
        i = first = len(hashes)
        if i >= num_full:
            return hashes
        fn = old_sha256_block_hash
        parent = hashes[-1] if hashes else self.root
        plain = request.lora_name is None and not request.mm_features and request.cache_salt is None
        while i < num_full:
            start = i * bs
            extra = None if plain else block_extra_keys(request, start, start + bs)
            parent = fn(parent, tokens[start : start + bs], extra)
            hashes.append(parent)
            i += 1
        self.num_hashed_blocks += num_full - first
        return hashes


# ---------------------------------------------------------------- workloads
def hashers() -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {
        "sha256 before": lambda: OldHasher(BLOCK_SIZE),
        "sha256": lambda: BlockHasher.create(BLOCK_SIZE, "sha256"),
        "fast": lambda: BlockHasher.create(BLOCK_SIZE, "fast"),
    }
    if xxhash is not None:
        out["xxh3_128"] = lambda: BlockHasher.create(BLOCK_SIZE, "xxh3_128")
    return out


def make_work(trace: list[TraceRequest], mode: str) -> list[tuple[Request, list[list[int]]]]:
    """Fresh requests holding their first chunk, and the chunks appended before each later ``update``."""
    bs = BLOCK_SIZE
    work = []
    for tr in trace:
        tokens = tr.prompt + tr.output
        if mode == "bulk":
            first, cuts = len(tokens), []
        elif mode == "per-block":
            first, cuts = min(bs, len(tokens)), list(range(bs, len(tokens), bs))
        else:  # trace: the prompt, then every block boundary the output crosses
            first = len(tr.prompt)
            cuts = list(range((first // bs + 1) * bs, len(tokens), bs))
        bounds = [first, *cuts, len(tokens)]
        chunks = [tokens[a:b] for a, b in itertools.pairwise(bounds) if b > a]
        work.append((Request(tr.rid, tokens[:first]), chunks))
    return work


def hash_work(hasher, work: list[tuple[Request, list[list[int]]]]) -> None:  # type: ignore[no-untyped-def]
    """Hash every block of ``work`` the way its chunks say: the timed part."""
    update = hasher.update
    for req, chunks in work:
        update(req)
        tokens = req.all_token_ids
        for c in chunks:
            tokens += c
            update(req)


def append_only(work: list[tuple[Request, list[list[int]]]]) -> None:
    """``hash_work`` without the ``update`` calls: the driver's own cost, subtracted from every scheme."""
    for req, chunks in work:
        tokens = req.all_token_ids
        for c in chunks:
            tokens += c


def floor_inputs(trace: list[TraceRequest], hashes: list[list[BlockHash]]) -> list[bytes]:
    """The exact bytes SHA-256 reads for every block: ``parent || uint32 n || n x int64``."""
    pack = struct.Struct(f"<I{BLOCK_SIZE}q").pack
    root = root_hash(sha256_block_hash, 0)
    out = []
    for tr, hs in zip(trace, hashes, strict=True):
        tokens = tr.prompt + tr.output
        parents = [root, *hs[:-1]]
        for i, parent in enumerate(parents):
            out.append(parent + pack(BLOCK_SIZE, *tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))  # type: ignore[operator]
    return out


def time_floor(name: str, inputs: list[bytes]) -> tuple[float, list[bytes]]:
    """Bare hashing of prebuilt inputs; the call is written out so no wrapper is timed."""
    if name == SHA_FLOOR:
        sha = hashlib.sha256
        t0 = time.perf_counter()
        out = [sha(x).digest() for x in inputs]
    else:
        xxh = xxhash.xxh3_128_digest
        t0 = time.perf_counter()
        out = [xxh(x) for x in inputs]
    return time.perf_counter() - t0, out


def run(num_requests: int = 2000, repeats: int = 5, seed: int = 0) -> dict[str, object]:
    trace = make_trace(num_requests, seed=seed)
    makers = hashers()
    # The floors hash the exact bytes of the SHA-256 chain, found by one untimed pass.
    ref_work = make_work(trace, "bulk")
    hash_work(BlockHasher.create(BLOCK_SIZE, "sha256"), ref_work)
    ref = [req.block_hashes for req, _ in ref_work]
    inputs = floor_inputs(trace, ref)
    floors = [SHA_FLOOR] if xxhash is None else [SHA_FLOOR, XXH_FLOOR]

    best: dict[tuple[str, str], float] = {}
    driver: dict[str, float] = {}
    floor_best: dict[str, float] = {}
    digests: dict[tuple[str, str], list[list[BlockHash]]] = {}
    floor_digests: list[bytes] = []
    for _ in range(repeats):
        # Every pass times everything, so that noise on a shared machine hits all alike.
        for name in floors:
            dt, out = time_floor(name, inputs)
            floor_best[name] = min(floor_best.get(name, float("inf")), dt)
            if name == SHA_FLOOR:
                floor_digests = out
        for mode in MODES:
            work = make_work(trace, mode)
            t0 = time.perf_counter()
            append_only(work)
            driver[mode] = min(driver.get(mode, float("inf")), time.perf_counter() - t0)
            for name, make in makers.items():
                work = make_work(trace, mode)
                hasher = make()
                t0 = time.perf_counter()
                hash_work(hasher, work)
                dt = time.perf_counter() - t0
                best[name, mode] = min(best.get((name, mode), float("inf")), dt)
                digests[name, mode] = [req.block_hashes for req, _ in work]

    identical = floor_digests == [h for hs in ref for h in hs] and all(
        digests[name, mode] == ref for name in ("sha256", "sha256 before") for mode in MODES
    )
    n_blocks = len(inputs)
    floor = floor_best[SHA_FLOOR]
    rows = []
    for name in [*makers, *floor_best]:
        row: dict[str, object] = {"scheme": name}
        for mode in MODES:
            # A hasher's time is net of the driver's token appends (its ``update`` calls stay in).
            dt = floor_best[name] if name in floor_best else best[name, mode] - driver[mode]
            row[mode] = {"us_per_block": dt / n_blocks * 1e6, "x_floor": dt / floor}
        rows.append(row)
    rows.append({"scheme": "driver (appends only)", **{m: {"us_per_block": driver[m] / n_blocks * 1e6} for m in MODES}})
    before = best["sha256 before", "trace"] - driver["trace"]
    speedups = {name: before / (best[name, "trace"] - driver["trace"]) for name in makers if name != "sha256 before"}
    return {
        "requests": num_requests,
        "blocks": n_blocks,
        "block_size": BLOCK_SIZE,
        "repeats": repeats,
        "python": sys.version.split()[0],
        "xxhash": None if xxhash is None else xxhash.VERSION,
        "identical_sha256_digests": identical,
        "rows": rows,
        "trace_speedup_vs_sha256_before": speedups,
    }


def print_table(res: dict[str, object]) -> None:
    print(
        f"trace: {res['requests']} requests, {res['blocks']} blocks of {res['block_size']} tokens; "
        f"best of {res['repeats']} passes; Python {res['python']}"
    )
    head = " | ".join(f"{m} µs/block | × floor" for m in MODES)
    print(f"\n| scheme | {head} |")
    print("| --- |" + " ---: |" * (2 * len(MODES)))
    for row in res["rows"]:  # type: ignore[attr-defined]
        cells = " | ".join(
            f"{row[m]['us_per_block']:.3f} | " + (f"{row[m]['x_floor']:.2f}" if "x_floor" in row[m] else "–")
            for m in MODES
        )
        print(f"| {row['scheme']} | {cells} |")
    print("\nschemes are net of the driver row (token appends), measured in the same passes")
    for name, x in res["trace_speedup_vs_sha256_before"].items():  # type: ignore[attr-defined]
        print(f"{name}: {x:.2f}x the speed of sha256 before (trace)")
    if res["xxhash"] is None:
        print("xxh3_128: not measured; pip install 'tiered-kv[xxhash]'")
    print(f"sha256 digests identical (before, new, floor) in every mode: {res['identical_sha256_digests']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    res = run(args.requests, args.repeats, args.seed)
    print_table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0 if res["identical_sha256_digests"] else 1


if __name__ == "__main__":
    sys.exit(main())
