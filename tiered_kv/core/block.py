"""The block record: one object per physical KV block, created once per pool."""

from __future__ import annotations

from dataclasses import dataclass

BlockHash = bytes | int
"""A chained block hash: ``bytes`` from sha256, ``int`` from the fast hash."""


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block.

    Invariants:
        * ``block_id`` is the index of the block in its pool's ``blocks`` list.
        * ``ref_cnt`` is the number of request block tables holding the block;
          it is never negative.  ``ref_cnt == 0`` (and not null) means the block
          sits in the pool's free queue, possibly still carrying cached data.
        * ``block_hash`` is ``None`` until the block is full with final tokens
          and cached; it is cleared only when the block is handed to a new owner
          (lazy eviction) or the prefix cache is reset.
        * ``stale`` counts entries of this block in the free queue's deque that
          no longer stand for it (see :mod:`tiered_kv.core.free_queue`).  It
          replaces the ``prev``/``next`` links of vLLM's intrusive list.
        * ``in_pool`` is set by the pool that made the block, and only by it.
          A block built by hand (as vLLM's unit tests build them) belongs to
          no pool: a pool may cache it, as vLLM does, because that corrupts
          nobody; a block of another pool it refuses, because giving that
          block a hash would corrupt the other pool's prefix-cache map.

    ``eq=False`` keeps identity semantics and the fast identity hash, so blocks
    can be compared and looked up at C speed.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    stale: int = 0
    is_null: bool = False
    in_pool: bool = False

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}{cached})"
