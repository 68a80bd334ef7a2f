"""The seed's walk-through of the block pool, printed step by step.

Block size 4, 11 blocks (block 0 is null).  One letter is one token.  Free
queue entries marked ``*`` still carry a hash (cached data, evicted only when
the block is handed out).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from tiered_kv.core import BlockPool, KVCacheManager, Request

WALKTHROUGH = (
    ("request 0 arrives", "admit", "r0", "ABCDEFGHIJKLMNO"),
    ("request 1 arrives; its first 10 tokens match request 0", "admit", "r1", "ABCDEFGHIJxxxx"),
    ("request 0 finishes", "finish", "r0", ""),
    ("request 1 finishes", "finish", "r1", ""),
    ("request 2 arrives; its first 12 tokens match request 0", "admit", "r2", "ABCDEFGHIJKLyyyyyyyyyyyyyyyyy"),
    ("request 3 arrives; nothing in common with the others", "admit", "r3", "zzzzzzzz"),
)


def tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


def queue_str(pool: BlockPool) -> str:
    return " ".join(
        f"{b.block_id}*" if b.block_hash is not None else str(b.block_id)
        for b in pool.free_block_queue.get_all_free_blocks()
    )


def run_walkthrough(emit: Callable[[str], None] = print, hash_fn: str = "sha256") -> dict[str, object]:
    """Run the seed's program on our pool; return the final tables and queue."""
    mgr = KVCacheManager(11, block_size=4, hash_fn=hash_fn, enable_kv_cache_events=True)
    pool = mgr.block_pool
    reqs: dict[str, Request] = {}
    tables: dict[str, list[int]] = {}
    emit("start")
    emit(f"    free queue (front first, * = cached): {queue_str(pool)}   usage {pool.get_usage():.2f}\n")
    for title, action, rid, text in WALKTHROUGH:
        emit(title)
        if action == "admit":
            req = reqs[rid] = Request(rid, tokens(text))
            hits, n_hit = mgr.get_computed_blocks(req)
            cached_before = {b.block_id for b in pool.blocks if b.block_hash is not None}
            new = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
            assert new is not None, "the walk-through always fits"
            req.num_computed_tokens = req.num_tokens
            emit(f"  {rid}: {req.num_tokens} tokens, {len(hits)} block(s) from cache, {len(new)} new")
            for b in new:
                if b.block_id in cached_before:
                    emit(f"    evict: block {b.block_id} loses its hash")
            mgr.take_events()
            tables[rid] = mgr.get_block_ids(rid)
            emit(f"    block table {tables[rid]}")
        else:
            mgr.free(reqs[rid])
            mgr.take_events()
        emit(f"    free queue (front first, * = cached): {queue_str(pool)}   usage {pool.get_usage():.2f}\n")
    return {"tables": tables, "queue": queue_str(pool)}


NAME = "demo"
SUMMARY = "walk through the prefix-cached block pool step by step"


def register(subparsers: Any, parents: Sequence[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``demo`` to the ``tiered-kv`` parser."""
    p = subparsers.add_parser(
        NAME,
        parents=parents,
        help=SUMMARY,
        description="Admit and free four requests on an 11-block pool and print the block tables and free queue.",
    )
    p.add_argument(
        "--hash", default="sha256", choices=["sha256", "fast"], help="block hash function (default: %(default)s)"
    )
    p.set_defaults(func=_run)
    return p


def _run(args: argparse.Namespace) -> int:
    run_walkthrough(hash_fn=args.hash)
    return 0


def main() -> None:
    run_walkthrough()


if __name__ == "__main__":
    main()
