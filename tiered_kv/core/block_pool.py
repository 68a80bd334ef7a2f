"""BlockPool: vLLM v1's prefix-cached block pool, decision for decision.

Names and behaviour follow ``vllm/v1/core/block_pool.py`` (see
``shared/seeds/vllm-block-pool-internals.txt``):

* ``get_new_blocks`` takes from the front of the free queue; a block that still
  carries a hash is evicted at that moment and not before (lazy eviction).
* ``touch`` is a cache hit: one more owner, and out of the free queue if free.
* ``free_blocks`` sends blocks that reach ``ref_cnt == 0`` without a hash to the
  front (reuse first, keeps memory warm) and blocks with a hash to the back
  (keep as cache), each group in the order given.  Callers pass a request's
  blocks last block first, so a request's deepest block is evicted first.
* A hash maps to one or more blocks; blocks are never de-duplicated, because
  block tables are append-only.
* Block 0 is the null block, never handed out.  ``touch`` and ``free_blocks``
  skip it, as vLLM does: hybrid and sliding-window block tables hold null
  blocks in place of blocks that fell out of the window, and pass them along.

Every public method is all-or-nothing: it validates, then mutates.  Misuse
raises a :class:`~tiered_kv.errors.TieredKVError` subclass and leaves the pool
exactly as it was.

The hot paths (``get_new_blocks``, ``touch``, ``free_blocks``,
``cache_full_blocks``) are written as single flat loops with locals bound once
and no per-block method calls or temporaries beyond the returned list; this is
where the speed over vLLM's implementation comes from, together with the
deque-based free queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from tiered_kv import checks
from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from tiered_kv.core.free_queue import FreeBlockQueue
from tiered_kv.core.request import Request
from tiered_kv.errors import BlockStateError, HashingError, InvalidArgumentError, NotEnoughFreeBlocksError

MEDIA = ("GPU", "CPU")


class BlockPool:
    """A fixed set of blocks, a free queue in reuse order, and a prefix-cache map.

    Args:
        num_blocks: Blocks in the pool, including the null block 0 (>= 2).
        enable_caching: Prefix caching; off makes the pool a LIFO allocator.
        enable_kv_cache_events: Queue :mod:`tiered_kv.core.events` for ``take_events``.
        medium: ``"GPU"`` or ``"CPU"``; the tier this pool stands for.

    Invariants (checked by the tests after every operation):
        * free + held == num_blocks - 1 (the null block is neither).
        * a block is free iff ``ref_cnt == 0`` and it is not the null block.
        * every hashed block is in ``cached_block_hash_to_block`` under its hash.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        medium: str = "GPU",
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        if medium not in MEDIA:
            raise InvalidArgumentError(f"medium must be one of {MEDIA}, got {medium!r}")
        checks.flag("enable_caching", enable_caching)
        checks.flag("enable_kv_cache_events", enable_kv_cache_events)
        self.num_gpu_blocks = num_blocks  # vLLM's name, kept for adapters
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.medium = medium
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # hash -> one block, or {block_id: block} in caching order when duplicated.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        # Called by get_new_blocks with (blocks, their old hashes) just evicted, after
        # the blocks are handed out.  The tier manager uses it to offload-on-evict.
        self.on_evict: Callable[[list[KVCacheBlock], list[BlockHash]], None] | None = None

    # ------------------------------------------------------------------ lookups
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The first block cached under ``block_hash``, or ``None`` on a miss."""
        if block_hash.__class__ is not bytes and block_hash.__class__ is not int:
            raise InvalidArgumentError(f"block_hash must be bytes or an int, got {checks.describe(block_hash)}")
        hit = self.cached_block_hash_to_block.get(block_hash)
        if hit is None or hit.__class__ is KVCacheBlock:
            return hit  # type: ignore[return-value]
        return next(iter(hit.values()))  # type: ignore[union-attr]

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """``1 - free / (total - 1)``: vLLM's ``kv_cache_usage_perc``.

        Cached-but-free blocks count as free, so with prefix caching on the
        metric can stay below 1.0 while every free block holds reusable data.
        """
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def get_num_cached_blocks(self) -> int:
        """Blocks that carry a hash (held or free)."""
        return sum(1 if v.__class__ is KVCacheBlock else len(v) for v in self.cached_block_hash_to_block.values())

    # --------------------------------------------------------------- allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front, each with ``ref_cnt`` 1.

        A block that still carries a hash loses it now (and a ``BlockRemoved``
        event is queued): this is the only place cached data is discarded.

        Raises:
            NotEnoughFreeBlocksError: more blocks than are free (nothing changes).
        """
        fq = self.free_block_queue
        if num_blocks.__class__ is not int or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks > fq.num_free_blocks:
            raise NotEnoughFreeBlocksError(
                f"cannot get {num_blocks} free blocks from the {self.medium} pool: "
                f"{fq.num_free_blocks} free of {self.num_blocks - 1}"
            )
        if num_blocks == 1:
            # The decode hot path, inlined (no method call), skipping the dead entries
            # that touch leaves behind (lazy removal, see free_queue.py).
            dq = fq._dq
            block = dq.popleft()
            while block.stale:
                block.stale -= 1
                fq._num_stale -= 1
                block = dq.popleft()
            fq.num_free_blocks -= 1
            ret = [block]
        elif fq._num_stale:
            ret = fq.popleft_n(num_blocks)
        else:
            # No dead entries: pop n in one C-level loop (iter(callable, sentinel) never
            # reaches its sentinel because the deque holds blocks, not None).
            fq.num_free_blocks -= num_blocks
            ret = list(islice(iter(fq._dq.popleft, None), num_blocks))
        if self.enable_caching:
            cmap = self.cached_block_hash_to_block
            removed: list[BlockHash] | None = None
            evicted: list[KVCacheBlock] | None = None  # built only when something is evicted
            for block in ret:
                h = block.block_hash
                if h is not None:
                    entry = cmap[h]
                    if entry is block:
                        del cmap[h]
                    else:
                        del entry[block.block_id]  # type: ignore[union-attr]
                        if not entry:
                            del cmap[h]
                    block.block_hash = None
                    if removed is None:
                        removed = [h]
                        evicted = [block]
                    else:
                        removed.append(h)
                        evicted.append(block)  # type: ignore[union-attr]
                block.ref_cnt = 1
            if removed is not None:
                if self.enable_kv_cache_events:
                    self.kv_event_queue.append(BlockRemoved(removed, self.medium))
                if self.on_evict is not None:
                    self.on_evict(evicted, removed)  # type: ignore[arg-type]
        else:
            for block in ret:
                block.ref_cnt = 1
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A cache hit: add an owner to each block, pulling free ones out of the queue.

        Null blocks are skipped.

        Raises:
            BlockStateError: a block of another pool was passed (nothing changes).
        """
        blocks = self.check_own_blocks("blocks", blocks)
        null = self.null_block
        removed = 0
        for block in blocks:
            if block is null:
                continue  # never owned, never in the free queue (vLLM skips it too)
            if block.ref_cnt == 0:
                block.stale += 1  # lazy removal from the free queue (see free_queue.py)
                removed += 1
            block.ref_cnt += 1
        if removed:
            fq = self.free_block_queue
            fq._num_stale += removed
            fq.num_free_blocks -= removed
            if fq._num_stale > 64 and fq._num_stale > fq.num_free_blocks:
                fq._compact()

    def check_own_blocks(self, name: str, blocks: object) -> list[KVCacheBlock] | tuple[KVCacheBlock, ...]:
        """``blocks`` as a list or tuple, after checking that every item is a block of this pool (else raise).

        A block of another pool has an id that may also exist here; accepting it
        would change the other pool's ref counts and corrupt both, so it is
        refused by identity, not by id.
        """
        if blocks.__class__ is not list and blocks.__class__ is not tuple:
            if isinstance(blocks, str | bytes) or not isinstance(blocks, Iterable):
                raise InvalidArgumentError(f"{name} must be a sequence of KV blocks, got {checks.describe(blocks)}")
            blocks = list(blocks)
        own = self.blocks
        n = len(own)
        for b in blocks:  # type: ignore[union-attr]
            if b.__class__ is not KVCacheBlock:
                raise InvalidArgumentError(f"{name} must hold KVCacheBlock objects, got {checks.describe(b)}")
            i = b.block_id
            if i >= n or own[i] is not b:
                raise BlockStateError(f"block {i} does not belong to this {self.medium} pool (a foreign block)")
        return blocks  # type: ignore[return-value]

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one owner from each block; blocks reaching zero return to the queue.

        Blocks without a hash go to the front, blocks with a hash to the back,
        each group in the order given (pass a request's blocks last block first).
        Null blocks are skipped.

        Raises:
            BlockStateError: a block would go below zero owners (double free) or
                belongs to another pool; nothing changes.
        """
        blocks = self.check_own_blocks("ordered_blocks", ordered_blocks)
        to_front: list[KVCacheBlock] = []
        to_back: list[KVCacheBlock] = []
        front = to_front.append
        back = to_back.append if self.enable_caching else front
        bad = False
        null = self.null_block
        for block in blocks:
            if block is null:
                continue  # skipped, as in vLLM: null blocks stand in for blocks outside a window
            rc = block.ref_cnt - 1
            block.ref_cnt = rc
            if rc == 0:
                if block.block_hash is None:
                    front(block)
                else:
                    back(block)
            elif rc < 0:
                bad = True
        if bad:
            for block in blocks:
                if block is not null:
                    block.ref_cnt += 1
            culprits = sorted({b.block_id for b in blocks if b is not null and blocks.count(b) > b.ref_cnt})
            raise BlockStateError(f"double free in the {self.medium} pool: block(s) {culprits} have no owner left")
        fq = self.free_block_queue
        if to_front:
            fq.prepend_n(to_front)
        if to_back:
            fq.append_n(to_back)

    def peek_free_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """The blocks ``get_new_blocks(num_blocks)`` would hand out now (fewer if fewer are free).

        Nothing changes.  A tier manager looks here to save cached blocks to a
        lower tier before they reach the front and are evicted.
        """
        checks.count("num_blocks", num_blocks)
        return self.free_block_queue.peek(num_blocks)

    def release_in_place(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one owner from each block; a block left with none is free again where it was.

        ``free_blocks`` re-queues a freed block by the caching rule (front
        without a hash, back with one).  A *temporary hold* must not move a
        block, or holding it would change the eviction order: a copy that saves
        a cached block before its eviction takes it with ``touch`` and gives it
        back here, and the block returns to the place in the free queue it left
        (the front, if that place was compacted away), hash and all.

        Raises:
            BlockStateError: a block has no owner, is null or is foreign (nothing changes).
        """
        blocks = self.check_own_blocks("blocks", blocks)
        for b in blocks:
            if b.is_null or b.ref_cnt - blocks.count(b) < 0:
                raise BlockStateError(f"block {b.block_id} of the {self.medium} pool has no owner to release")
        fq = self.free_block_queue
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                fq.restore(b)

    # ------------------------------------------------------------------ caching
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and cache them.

        Hashes come from ``request.block_hashes``, which must already cover
        every block being cached: a block is cached only when full with final
        tokens.  A hash already in the map gets a second block (no de-dup).
        As in vLLM, null blocks in the range are skipped, and so is a block
        that already carries the very hash it would get (a block restored by
        copy and then cached again by the request's own allocation).

        Raises:
            HashingError: a block in range is not full / not hashed yet.
            BlockStateError: a block in range carries a different hash, or
                belongs to another pool (nothing changes).
        """
        if (
            num_cached_blocks.__class__ is not int
            or num_full_blocks.__class__ is not int
            or block_size.__class__ is not int
            or block_size <= 0
        ):
            raise InvalidArgumentError(
                "num_cached_blocks and num_full_blocks must be ints and block_size an int > 0, got "
                f"{checks.describe(num_cached_blocks)}, {checks.describe(num_full_blocks)}, "
                f"{checks.describe(block_size)}"
            )
        if not isinstance(request, Request):
            raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
        if blocks.__class__ is not list and blocks.__class__ is not tuple:
            raise InvalidArgumentError(f"blocks must be a list of KV blocks, got {checks.describe(blocks)}")
        if num_cached_blocks >= num_full_blocks:
            if num_cached_blocks < 0 or num_full_blocks < 0:
                raise InvalidArgumentError(f"negative block counts: {num_cached_blocks}, {num_full_blocks}")
            return
        hashes = request.block_hashes
        if num_cached_blocks < 0 or num_full_blocks > len(blocks):
            raise InvalidArgumentError(
                f"cannot cache blocks [{num_cached_blocks}, {num_full_blocks}) of a table of {len(blocks)}"
            )
        if num_full_blocks > len(hashes):
            raise HashingError(
                f"request {request.request_id!r}: block {len(hashes)} is partial or not final "
                f"({request.num_tokens} tokens, block size {block_size}); only full blocks are cached"
            )
        cmap = self.cached_block_hash_to_block
        if num_full_blocks - num_cached_blocks == 1:
            # Common case (a decode step filled one block): validated and inserted inline,
            # without slices, zip or a call on this hot path.
            block = blocks[num_cached_blocks]
            h = hashes[num_cached_blocks]
            if (
                block.__class__ is not KVCacheBlock
                or block.block_id >= self.num_blocks
                or self.blocks[block.block_id] is not block
            ):
                self.check_own_blocks("blocks", [block])  # raises the precise error
            if block.block_hash is not None or block.is_null:
                if block.is_null or block.block_hash == h:
                    return  # vLLM: null blocks and blocks already cached under this hash are skipped
                raise BlockStateError(
                    f"block {block.block_id} is already cached under another hash; cannot cache it again"
                )
            block.block_hash = h
            entry = cmap.get(h)
            if entry is None:
                cmap[h] = block
            elif entry.__class__ is KVCacheBlock:
                cmap[h] = {entry.block_id: entry, block.block_id: block}  # type: ignore[union-attr]
            else:
                entry[block.block_id] = block  # type: ignore[index]
            new_idx: range | list[int] = range(num_cached_blocks, num_full_blocks)
        else:
            span = self.check_own_blocks("blocks", blocks[num_cached_blocks:num_full_blocks])
            new_idx = []
            for i, block in enumerate(span, num_cached_blocks):
                if block.is_null:
                    continue
                if block.block_hash is not None:
                    if block.block_hash != hashes[i]:
                        raise BlockStateError(
                            f"block {block.block_id} is already cached under another hash; cannot cache it again"
                        )
                    continue
                new_idx.append(i)
            if len({id(blocks[i]) for i in new_idx}) != len(new_idx):
                raise BlockStateError("a block is listed twice in the range to cache")
            for i in new_idx:
                block = blocks[i]
                h = hashes[i]
                block.block_hash = h
                entry = cmap.get(h)
                if entry is None:
                    cmap[h] = block
                elif entry.__class__ is KVCacheBlock:
                    cmap[h] = {entry.block_id: entry, block.block_id: block}  # type: ignore[union-attr]
                else:
                    entry[block.block_id] = block  # type: ignore[index]
        if self.enable_kv_cache_events and new_idx:
            first, last = new_idx[0], new_idx[-1] + 1
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[hashes[i] for i in new_idx],
                    parent_block_hash=hashes[first - 1] if first else None,
                    token_ids=request.all_token_ids[first * block_size : last * block_size],
                    block_size=block_size,
                    lora_name=request.lora_name,
                    medium=self.medium,
                )
            )

    def cache_block_hashes(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash]) -> None:
        """Register ``blocks[i]`` under ``hashes[i]`` (all-or-nothing; no event).

        The tier manager uses this to register blocks whose content landed by
        copy (swap-out, onboarding, offload) rather than by the request's own
        ``cache_full_blocks``.
        """
        blocks = self.check_own_blocks("blocks", blocks)
        if not isinstance(hashes, list | tuple):
            raise InvalidArgumentError(f"hashes must be a list of block hashes, got {checks.describe(hashes)}")
        for h in hashes:
            if h.__class__ is not bytes and h.__class__ is not int:
                raise InvalidArgumentError(f"a block hash must be bytes or an int, got {checks.describe(h)}")
        if len(blocks) != len(hashes):
            raise InvalidArgumentError(f"{len(blocks)} blocks but {len(hashes)} hashes")
        for block in blocks:
            if block.block_hash is not None or block.is_null:
                raise BlockStateError(f"block {block.block_id} is already cached or null; cannot cache it again")
        if len({id(b) for b in blocks}) != len(blocks):
            raise BlockStateError("a block is listed twice")
        cmap = self.cached_block_hash_to_block
        for block, h in zip(blocks, hashes, strict=True):
            block.block_hash = h
            entry = cmap.get(h)
            if entry is None:
                cmap[h] = block
            elif entry.__class__ is KVCacheBlock:
                cmap[h] = {entry.block_id: entry, block.block_id: block}  # type: ignore[union-attr]
            else:
                entry[block.block_id] = block  # type: ignore[index]

    def reset_prefix_cache(self) -> bool:
        """Drop every hash.  Refuses (returns ``False``, changes nothing) while any block is held."""
        if self.num_blocks - self.get_num_free_blocks() != 1:  # the null block is always "used"
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared(self.medium))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return the queued events and start a new batch."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ------------------------------------------------------------- inspection
    def free_queue_ids(self) -> list[int]:
        """Free block ids in reuse order (front first)."""
        return [b.block_id for b in self.free_block_queue.get_all_free_blocks()]

    def check_invariants(self) -> None:
        """Assert the pool's invariants (O(num_blocks); for tests and debugging)."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.get_num_free_blocks(), "a block is in the free queue twice"
        assert 0 not in free_ids, "the null block is in the free queue"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but free={block.block_id in free_ids}"
            )
            if block.block_hash is not None:
                entry = self.cached_block_hash_to_block.get(block.block_hash)
                assert entry is block or (isinstance(entry, dict) and entry.get(block.block_id) is block), (
                    f"block {block.block_id} has a hash but is not in the cache map"
                )
        n_mapped = self.get_num_cached_blocks()
        n_hashed = sum(b.block_hash is not None for b in self.blocks)
        assert n_mapped == n_hashed, f"{n_mapped} blocks in the cache map but {n_hashed} carry a hash"
