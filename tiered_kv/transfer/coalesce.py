"""Coalescing and chunking of block copies (pure arithmetic, shared by every engine).

A *run* is a maximal stretch where both source and destination ids increase by
one: in the block-contiguous layout it is one contiguous region on each side,
so it becomes one copy call.  Large plans are cut into chunks of at most
``max_blocks_per_chunk`` blocks so an urgent small plan can slip in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CopyRun:
    """Copy ``length`` consecutive blocks from ``src_start`` to ``dst_start``."""

    src_start: int
    dst_start: int
    length: int


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[CopyRun]:
    """Merge pairs into runs where both sides are consecutive, preserving plan order."""
    runs: list[CopyRun] = []
    n = len(src)
    i = 0
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append(CopyRun(src[i], dst[i], j - i))
        i = j
    return runs


def count_runs(ids: Sequence[int]) -> int:
    """Runs of consecutive ids on one side: the copies a coalescing engine issues for these blocks.

    An estimate before the other side is known; pricing calls it for every
    preemption candidate, hence the plain loop (about twice as fast as a
    ``pairwise`` generator on a few hundred ids).
    """
    if not ids:
        return 0
    it = iter(ids)
    prev = next(it)
    runs = 1
    for i in it:
        if i != prev + 1:
            runs += 1
        prev = i
    return runs


def chunk_runs(runs: Sequence[CopyRun], max_blocks_per_chunk: int) -> list[list[CopyRun]]:
    """Split runs into chunks of at most ``max_blocks_per_chunk`` blocks, splitting long runs."""
    if max_blocks_per_chunk <= 0:
        raise ValueError(f"max_blocks_per_chunk must be > 0, got {max_blocks_per_chunk}")
    chunks: list[list[CopyRun]] = []
    cur: list[CopyRun] = []
    room = max_blocks_per_chunk
    for run in runs:
        s, d, left = run.src_start, run.dst_start, run.length
        while left:
            take = min(left, room)
            cur.append(CopyRun(s, d, take))
            s += take
            d += take
            left -= take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur = []
                room = max_blocks_per_chunk
    if cur:
        chunks.append(cur)
    return chunks
