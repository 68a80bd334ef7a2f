"""The free queue: the order in which free blocks are reused.

The order is the eviction policy (front = reused first), so it is the contract
this module keeps exactly as vLLM 0.33.0's ``FreeKVCacheBlockQueue`` does (its own
unit tests run against this queue: ``tests/test_vllm_unit_tests.py``).  The
representation is ours and was chosen by measurement
(``benchmarks/bench_block_pool.py --queues``): vLLM threads a doubly linked list
through the block objects, which costs several Python attribute writes per
block.  We keep a ``collections.deque`` of block objects instead, whose push and
pop run in C, and delete from the middle *lazily*:

* ``remove(b)`` does not search the deque; it bumps ``b.stale``, meaning "the
  next ``stale`` entries of ``b`` met from the front are dead".
* ``popleft_n`` skips entries whose block has ``stale > 0`` (decrementing it).

Why that is exact: a stale entry is left only by ``remove``, which the pool
calls only for a cache hit on a free *hashed* block.  A held block keeps its
hash until it is back in the queue, so it is re-queued at the *back*, behind its
stale entries.  Hence every stale entry of a block precedes its live entry, and
"skip the first ``stale`` occurrences" identifies them.  ``prepend_n`` asserts
the one case that could break this (a block with stale entries going to the
front).  Stale entries are compacted away once they outnumber live ones, so
memory stays O(number of blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.errors import InvalidArgumentError, NotEnoughFreeBlocksError


class FreeBlockQueue:
    """Free blocks in reuse order, with O(1) take-front, put-front, put-back and remove.

    Attributes:
        num_free_blocks: Number of live entries (free blocks).
    """

    __slots__ = ("_dq", "_num_stale", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._dq: deque[KVCacheBlock] = deque(blocks)
        self.num_free_blocks: int = len(self._dq)
        self._num_stale: int = 0

    @property
    def num_entries(self) -> int:
        """Entries in the queue, dead ones (left by ``remove``) included: what its memory holds.

        Compaction keeps this within about twice ``num_free_blocks``; a test of
        that bound reads it here.
        """
        return len(self._dq)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the front block.

        Raises:
            NotEnoughFreeBlocksError: the queue is empty (nothing changes).  It is a
                ``ValueError`` with vLLM 0.33's message, ``"No free blocks available"``,
                and an explicit check rather than an assertion, so that it holds
                under ``python -O`` too.
        """
        if self.num_free_blocks == 0:
            raise NotEnoughFreeBlocksError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the front, in queue order.

        Raises:
            InvalidArgumentError: ``n`` is not an int >= 0.
            NotEnoughFreeBlocksError: ``n`` exceeds the free count (nothing changes;
                vLLM asserts here, which ``python -O`` would skip).
        """
        if type(n) is not int or n < 0:
            raise InvalidArgumentError(f"popleft_n takes an int >= 0, got {n!r}")
        if n > self.num_free_blocks:
            raise NotEnoughFreeBlocksError(f"cannot take {n} blocks: {self.num_free_blocks} free")
        self.num_free_blocks -= n
        pop = self._dq.popleft
        if not self._num_stale:
            # Fast path: no dead entries anywhere, so no per-entry checks.
            return [pop() for _ in repeat(None, n)]
        ret: list[KVCacheBlock] = []
        append = ret.append
        while n:
            block = pop()
            if block.stale:
                block.stale -= 1
                self._num_stale -= 1
                continue
            append(block)
            n -= 1
        return ret

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front so that ``blocks[0]`` becomes the front."""
        if self._num_stale:
            for block in blocks:
                assert not block.stale, f"block {block.block_id} has stale entries and cannot go to the front"
        self._dq.extendleft(reversed(blocks))
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order (``blocks[-1]`` becomes the back)."""
        self._dq.extend(blocks)
        self.num_free_blocks += len(blocks)

    def append(self, block: KVCacheBlock) -> None:
        """Put one block at the back."""
        self._dq.append(block)
        self.num_free_blocks += 1

    def restore(self, block: KVCacheBlock) -> None:
        """Undo the latest ``remove`` of ``block``: it is free again at the place it left.

        The dead entry that ``remove`` left behind is the block's rearmost
        entry, and it is still where the block was; with one stale count less,
        "skip the first ``stale`` entries" makes exactly that entry live again.
        If compaction has dropped it meanwhile, the block goes to the front,
        which is where a block nearest eviction was.
        """
        if block.stale:
            block.stale -= 1
            self._num_stale -= 1
            self.num_free_blocks += 1
        else:
            self._dq.appendleft(block)
            self.num_free_blocks += 1

    def peek(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` free blocks in reuse order (fewer if fewer are free), without taking them."""
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        if not self._num_stale:
            return list(islice(self._dq, n))
        skipped: dict[int, int] = {}
        for block in self._dq:
            if block.stale:
                seen = skipped.get(block.block_id, 0)
                if seen < block.stale:
                    skipped[block.block_id] = seen + 1
                    continue
            out.append(block)
            if len(out) == n:
                break
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Remove a free block from wherever it is in the queue, in O(1) amortised."""
        block.stale += 1
        self.note_removed(1)

    def note_removed(self, n: int) -> None:
        """Account for ``n`` blocks whose ``stale`` count the caller raised (a batched ``remove``)."""
        self._num_stale += n
        self.num_free_blocks -= n
        if self._num_stale > 64 and self._num_stale > self.num_free_blocks:
            self._compact()

    def _compact(self) -> None:
        """Drop every dead entry, keeping the live order (O(len) once per O(len) removes)."""
        live: list[KVCacheBlock] = []
        append = live.append
        for block in self._dq:
            if block.stale:
                block.stale -= 1
            else:
                append(block)
        self._dq = deque(live)
        self._num_stale = 0

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in reuse order (front first).  O(len); for tests and tools."""
        if not self._num_stale:
            return list(self._dq)
        pending: dict[int, int] = {}
        out: list[KVCacheBlock] = []
        for block in self._dq:
            seen = pending.get(block.block_id, 0)
            if seen < block.stale:
                pending[block.block_id] = seen + 1
            else:
                out.append(block)
        return out
