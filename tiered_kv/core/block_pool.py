"""BlockPool: vLLM 0.33.0's prefix-cached block pool, decision for decision, for one KV cache group.

Names and behaviour follow vLLM 0.33.0's ``vllm/v1/core/block_pool.py``, and are
checked against that code: ``tests/test_vllm_pool_diff.py`` replays seeded random
traces through vLLM's own ``BlockPool`` and this one side by side (every answer,
the free-queue order, owner counts, hashes and every event), and
``tests/test_vllm_unit_tests.py`` runs vLLM's own unit tests of the pool against it.
Several KV cache groups, partial-block entries and lookahead hashing are not built.

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

Events (opt-in) are vLLM 0.33's, emitted where vLLM emits them: see :mod:`.events`.

Every public method is all-or-nothing: misuse raises a
:class:`~tiered_kv.errors.TieredKVError` subclass and leaves the pool exactly
as it was.  The hot paths (``get_new_blocks``, ``touch``, ``free_blocks``,
``cache_full_blocks``, ``get_cached_prefix``) make one pass over their blocks:
each block is checked (``own[b.block_id] is b``, see :mod:`.pool_checks`) in the
loop that changes it, and a bad one makes the call undo its loop before it
raises.  Public methods take the arguments they check as ``object``: compiled
with mypyc, a narrower annotation would be enforced at the call, with a bare
``TypeError`` that names no argument, before the check could run.
"""

from __future__ import annotations

from collections.abc import Callable

from tiered_kv import checks
from tiered_kv.core import pool_checks as pc
from tiered_kv.core.block import BlockHash, KVCacheBlock
from tiered_kv.core.compile_hints import mypyc_attr
from tiered_kv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash
from tiered_kv.core.free_queue import FreeBlockQueue
from tiered_kv.core.pool_cache import (
    CacheMap,
    cache_range,
    check_state,
    event_extra_keys,
    num_cached_blocks,
    stored_event,
    uncache,
)
from tiered_kv.core.request import Request
from tiered_kv.errors import BlockStateError, InvalidArgumentError, NotEnoughFreeBlocksError

MEDIA = pc.MEDIA


@mypyc_attr(allow_interpreted_subclasses=True)
class BlockPool:
    """A fixed set of blocks, a free queue in reuse order, and a prefix-cache map.

    Args:
        num_blocks: Blocks in the pool, including the null block 0 (an int >= 2).
        enable_caching: Prefix caching; off makes the pool a LIFO allocator.
        enable_kv_cache_events: Queue :mod:`tiered_kv.core.events` for ``take_events``.
        medium: ``"GPU"`` or ``"CPU"``; the tier this pool stands for.
        kv_events_int_hashes: Publish event hashes as 64-bit ints (vLLM's default,
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or, with ``False``, as the
            pool holds them (see :func:`~tiered_kv.core.events.external_hash`).

    Invariants (checked by the tests after every operation):
        * free + held == num_blocks - 1 (the null block is neither).
        * a block is free iff ``ref_cnt == 0`` and it is not the null block.
        * every hashed block is in ``cached_block_hash_to_block`` under its hash.
    """

    def __init__(
        self,
        num_blocks: object,
        enable_caching: object = True,
        enable_kv_cache_events: object = False,
        medium: object = "GPU",
        kv_events_int_hashes: object = True,
    ) -> None:
        n, caching, events, tier = pc.check_pool_args(num_blocks, enable_caching, enable_kv_cache_events, medium)
        int_hashes = checks.flag("kv_events_int_hashes", kv_events_int_hashes)
        self.num_gpu_blocks: int = n  # vLLM's name, kept for adapters
        self.num_blocks: int = n
        self.enable_caching: bool = caching
        self.medium: str = tier
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i, in_pool=True) for i in range(n)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: CacheMap = {}
        self.null_block: KVCacheBlock = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events: bool = events
        self.kv_events_int_hashes: bool = int_hashes
        self.kv_event_queue: list[KVCacheEvent] = []
        #: Blocks evicted so far (handed out by ``get_new_blocks`` while still carrying a hash):
        #: the count a manager needs, without turning events on.
        self.num_evicted_blocks: int = 0
        # Called by get_new_blocks with (blocks, their old hashes) just evicted, after
        # the blocks are handed out; for a tier that saves what the GPU evicts.
        self.on_evict: Callable[[list[KVCacheBlock], list[BlockHash]], None] | None = None

    # ------------------------------------------------------------------ lookups
    def get_cached_block(self, block_hash: object) -> KVCacheBlock | None:
        """The first block cached under ``block_hash`` (bytes or an int), or ``None`` on a miss."""
        if type(block_hash) is not bytes and type(block_hash) is not int:
            raise pc.bad_hash("block_hash", block_hash)
        hit = self.cached_block_hash_to_block.get(block_hash)
        if hit is None or isinstance(hit, KVCacheBlock):
            return hit
        return next(iter(hit.values()))

    def get_cached_prefix(self, block_hashes: object, max_blocks: object = None) -> list[KVCacheBlock]:
        """The blocks cached under ``block_hashes[0]``, ``[1]``, ... up to the first miss.

        One call for a whole prefix probe (what a manager does on admission),
        instead of one ``get_cached_block`` per block; each hit is the first
        block cached under its hash, as ``get_cached_block`` returns.  Nothing
        changes: the hits are not touched.

        Args:
            block_hashes: A list or tuple of chained block hashes (bytes or ints).
                Items after the first miss are not examined.
            max_blocks: Probe at most this many hashes (an int >= 0), or ``None``.
        """
        if type(block_hashes) is not list and type(block_hashes) is not tuple:
            raise InvalidArgumentError(
                f"block_hashes must be a list of block hashes, got {checks.describe(block_hashes)}"
            )
        if max_blocks is not None:
            if type(max_blocks) is not int or max_blocks < 0:
                raise pc.bad_count("max_blocks", max_blocks)
            if max_blocks < len(block_hashes):
                block_hashes = block_hashes[:max_blocks]
        cmap = self.cached_block_hash_to_block
        out: list[KVCacheBlock] = []
        for h in block_hashes:
            # Checked before the probe: True, 1.0 and NumPy integers would find int keys.
            if type(h) is not bytes and type(h) is not int:
                raise pc.bad_hash("an item of block_hashes", h)
            hit = cmap.get(h)
            if hit is None:
                break
            # An entry is a block or a plain dict of blocks (pool_cache); a class test is cheaper than
            # isinstance here, one per probed block (lookups: 17% of the replay under cProfile, bench_block_pool.py).
            out.append(hit if hit.__class__ is not dict else next(iter(hit.values())))  # type: ignore[arg-type]
        return out

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
        return num_cached_blocks(self.cached_block_hash_to_block)

    # --------------------------------------------------------------- allocation
    # The loops take, evict and hand out each block in place: this runs for every allocation, and a
    # helper called per block would cost more than the loop's own work.
    def get_new_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        """Take ``num_blocks`` (an int >= 0) blocks from the front, each with ``ref_cnt`` 1.

        A block that still carries a hash loses it now (a ``BlockRemoved``
        event per such block is queued, in hand-out order, and
        ``num_evicted_blocks`` counts it): this is the only place cached data is
        discarded.
        Each block is taken, past the dead queue entries that ``touch`` leaves
        (see :mod:`.free_queue`), evicted and handed out in one pass.

        Raises:
            NotEnoughFreeBlocksError: more blocks than are free (nothing changes).
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise pc.bad_count("num_blocks", num_blocks)
        fq = self.free_block_queue
        free = fq.num_free_blocks
        if num_blocks > free:
            raise NotEnoughFreeBlocksError(
                f"cannot get {num_blocks} free blocks from the {self.medium} pool: {free} free of {self.num_blocks - 1}"
            )
        fq.num_free_blocks = free - num_blocks
        if num_blocks == 1:
            # One block, for a decode step: nearly every call (17 743 of 19 743 on the
            # 2000-request trace of bench_block_pool.py), so it runs without the loop's set-up.
            dq = fq._dq
            block = dq.popleft()
            while block.stale:  # a dead entry left by touch: drop it and take the next
                block.stale -= 1
                fq._num_stale -= 1
                block = dq.popleft()
            block.ref_cnt = 1
            if block.block_hash is None:
                return [block]
            old_hash = uncache(self.cached_block_hash_to_block, block)  # it held cached data: evicted now
            self.num_evicted_blocks += 1
            if self.enable_kv_cache_events or self.on_evict is not None:
                self._report_evicted([block], [old_hash])
            return [block]
        pop = fq._dq.popleft
        cmap = self.cached_block_hash_to_block
        # Only a consumer (events, on_evict) needs the evicted blocks listed: the hashed ones
        # among those handed out, in hand-out order, noted by the loop as it evicts them.
        doomed: list[KVCacheBlock] | None = None
        old_hashes: list[BlockHash] = []
        if self.enable_kv_cache_events or self.on_evict is not None:
            doomed = []
        ret: list[KVCacheBlock] = []
        skipped = 0
        evicted = 0
        for _ in range(num_blocks):
            block = pop()
            while block.stale:  # as above
                block.stale -= 1
                skipped += 1
                block = pop()
            h = block.block_hash
            if h is not None:
                evicted += 1
                if doomed is not None:
                    doomed.append(block)
                    old_hashes.append(h)
                entry = cmap[h]
                if entry is block:
                    del cmap[h]
                else:  # several blocks carry h
                    assert isinstance(entry, dict), f"block {block.block_id} is not under its hash"
                    del entry[block.block_id]
                    if not entry:
                        del cmap[h]
                block.block_hash = None
            block.ref_cnt = 1
            ret.append(block)
        if skipped:
            fq._num_stale -= skipped
        if evicted:
            self.num_evicted_blocks += evicted
        if doomed:
            self._report_evicted(doomed, old_hashes)
        return ret

    def _report_evicted(self, doomed: list[KVCacheBlock], old_hashes: list[BlockHash]) -> None:
        """Tell the consumers of evictions (events, ``on_evict``) about blocks just handed out."""
        if self.enable_kv_cache_events:
            # One event per block, as vLLM 0.33 emits them (consumers mirror block by block).
            as_int, medium, queue = self.kv_events_int_hashes, self.medium, self.kv_event_queue
            for h in old_hashes:
                queue.append(BlockRemoved([external_hash(h, as_int)], medium, 0))
        if self.on_evict is not None:
            self.on_evict(doomed, old_hashes)

    def touch(self, blocks: object) -> None:
        """A cache hit: add an owner to each block (a list or tuple of this pool's blocks).

        Free blocks leave the free queue (lazily: see :mod:`.free_queue`).
        Null blocks are skipped.

        Raises:
            InvalidArgumentError / BlockStateError: an item is not a block of
                this pool (nothing changes).
        """
        # Typed, so that compiled code reads each block's fields directly (and rejects a non-block).
        items: list[KVCacheBlock] = blocks if type(blocks) is list else pc.as_block_list("blocks", blocks)
        own = self.blocks
        null = self.null_block
        removed = 0
        try:
            for block in items:
                if own[block.block_id] is not block:
                    raise LookupError
                if block is null:
                    continue  # never owned, never in the free queue (vLLM skips it too)
                if block.ref_cnt == 0:
                    block.stale += 1  # lazy removal from the free queue
                    removed += 1
                block.ref_cnt += 1
        except (AttributeError, TypeError, LookupError):
            err = pc.undo_touch(items, own, null, self.medium)
            if err is None:
                raise
            raise err from None
        if removed:
            self.free_block_queue.note_removed(removed)

    def check_own_blocks(self, name: str, blocks: object) -> list[KVCacheBlock]:
        """``blocks`` as a list, after checking that every item is a block of this pool (else raise).

        A block of another pool is refused by identity, not by id (see :mod:`.pool_checks`).
        """
        return pc.check_blocks(name, blocks, self.blocks, self.medium)

    def free_blocks(self, ordered_blocks: object) -> None:
        """Drop one owner from each block (an iterable of this pool's blocks).

        Blocks reaching zero owners return to the queue: without a hash to the
        front, with a hash to the back, each group in the order given (pass a
        request's blocks last block first).  Null blocks are skipped.

        Raises:
            BlockStateError: a block would go below zero owners (double free) or
                belongs to another pool; nothing changes.
        """
        blocks: list[KVCacheBlock] = (
            ordered_blocks if type(ordered_blocks) is list else pc.as_block_list("ordered_blocks", ordered_blocks)
        )
        own = self.blocks
        null = self.null_block
        to_front: list[KVCacheBlock] = []
        to_back: list[KVCacheBlock] = []
        caching = self.enable_caching
        bad = False
        try:
            for block in blocks:
                if own[block.block_id] is not block:
                    raise LookupError
                if block is null:
                    continue  # skipped, as in vLLM: null blocks stand in for blocks outside a window
                rc = block.ref_cnt - 1
                block.ref_cnt = rc
                if rc == 0:
                    if block.block_hash is None or not caching:
                        to_front.append(block)
                    else:
                        to_back.append(block)
                elif rc < 0:
                    bad = True
        except (AttributeError, TypeError, LookupError):
            err = pc.undo_free(blocks, own, null, self.medium)
            if err is None:
                raise
            raise err from None
        if bad:
            raise pc.undo_double_free(blocks, null, self.medium)
        fq = self.free_block_queue
        if to_front:
            fq.prepend_n(to_front)
        if to_back:
            fq.append_n(to_back)

    def peek_free_blocks(self, num_blocks: object) -> list[KVCacheBlock]:
        """The blocks ``get_new_blocks(num_blocks)`` would hand out now (fewer if fewer are free).

        Nothing changes.  A tier manager looks here to save cached blocks to a
        lower tier before they reach the front and are evicted.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise pc.bad_count("num_blocks", num_blocks)
        return self.free_block_queue.peek(num_blocks)

    def release_in_place(self, blocks: object) -> None:
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
        items = self.check_own_blocks("blocks", blocks)
        for b in items:
            if b.is_null or b.ref_cnt - items.count(b) < 0:
                raise BlockStateError(f"block {b.block_id} of the {self.medium} pool has no owner to release")
        fq = self.free_block_queue
        for b in items:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                fq.restore(b)

    # ------------------------------------------------------------------ caching
    # The argument checks, the one-block decode fast path and the one-pass general path sit
    # together so that every path checks before it changes anything.
    def cache_full_blocks(
        self,
        request: object,
        blocks: object,
        num_cached_blocks: object,
        num_full_blocks: object,
        block_size: object,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes and cache them.

        Args:
            request: The :class:`Request` whose ``block_hashes`` cover every
                block being cached (a block is cached only when full with final
                tokens).
            blocks: The request's block table (a list or tuple of this pool's blocks).
            num_cached_blocks: Blocks of the table already cached (an int >= 0).
            num_full_blocks: Full blocks of the table after this call (an int).
            block_size: Tokens per block (an int > 0), for the event's token ids.

        A hash already in the map gets a second block (no de-dup).  As in vLLM,
        null blocks in the range are skipped, and so is a block that already
        carries the very hash it would get (a block restored by copy and then
        cached again by the request's own allocation).

        A block built outside any pool (``KVCacheBlock(i)``, as vLLM's own
        unit tests build them) is cached as vLLM caches it: it gets its hash
        and enters the map, where lookups find it.  No free queue holds it, so
        it is never evicted, and it cannot be held (``touch`` refuses it).  A
        block of *another* pool is refused: its own pool's map would not know
        the hash it got.

        Raises:
            HashingError: a block in range is not full / not hashed yet.
            BlockStateError: a block in range carries a different hash, is
                listed twice, or belongs to another pool (nothing changes).
        """
        if (
            type(blocks) is list
            and type(num_cached_blocks) is int
            and type(num_full_blocks) is int  # before the comparison: NumPy's == answers a numpy.bool
            and num_full_blocks == num_cached_blocks + 1
            and type(block_size) is int
            and isinstance(request, Request)
            and num_cached_blocks >= 0
            and block_size > 0
        ):
            # One block, filled by a decode step: nearly every call (17 768 of 19 768 on the
            # 2000-request trace of bench_block_pool.py), so it does its work inline, without the
            # general path's calls.  Anything unusual falls through to that path, which checks
            # everything again and raises the precise error.
            cmap = self.cached_block_hash_to_block
            try:
                # Each failure here means "not the plain case": an index out of range, an item
                # that is no block (compiled, the annotation's check raises TypeError), an id
                # that is no index of this pool, or an unhashable hash.
                block: KVCacheBlock = blocks[num_cached_blocks]
                h = request.block_hashes[num_cached_blocks]
                i = block.block_id
                # This pool's block (see pool_checks), not yet cached, and not the null block (own[0]),
                # under a hash of the type the map holds (a per-block check: see checks.py on __class__).
                plain = (
                    block.block_hash is None
                    and i != 0
                    and self.blocks[i] is block
                    and (h.__class__ is bytes or h.__class__ is int)
                )
                if plain:
                    # The first change, and the last thing that can fail: an unhashable h raises
                    # before the map changes.  One probe where the hash is new, as it mostly is.
                    entry = cmap.setdefault(h, block)
            except (IndexError, AttributeError, TypeError):
                plain = False
            if plain:
                block.block_hash = h
                if entry is not block:  # a hash already cached: its entry grows (see pool_cache)
                    if isinstance(entry, KVCacheBlock):
                        cmap[h] = {entry.block_id: entry, i: block}
                    else:
                        entry[i] = block
                if self.enable_kv_cache_events:  # the event the general path queues for this block
                    self.kv_event_queue.append(self._stored_one(request, num_cached_blocks, block_size))
                return
        args = pc.check_cache_args(request, blocks, num_cached_blocks, num_full_blocks, block_size)
        if args is None:
            return  # nothing to cache
        req, table, first, last, bs = args
        cmap = self.cached_block_hash_to_block
        skipped = cache_range(self.blocks, cmap, table, req.block_hashes, first, last, self.medium)
        if self.enable_kv_cache_events:
            event = stored_event(req, table, first, last, bs, skipped, self.medium, self.kv_events_int_hashes)
            if event is not None:
                self.kv_event_queue.append(event)

    def _stored_one(self, request: Request, index: int, block_size: int) -> BlockStored:
        """The ``BlockStored`` event of caching the one block ``index`` of ``request`` (the decode path)."""
        hashes = request.block_hashes
        as_int = self.kv_events_int_hashes
        start = index * block_size
        return BlockStored(
            block_hashes=[external_hash(hashes[index], as_int)],
            parent_block_hash=external_hash(hashes[index - 1], as_int) if index else None,
            token_ids=request.all_token_ids[start : start + block_size],
            block_size=block_size,
            lora_id=None,
            medium=self.medium,
            lora_name=request.lora_name,
            extra_keys=event_extra_keys(request, [index], block_size),
            group_idx=0,
        )

    def cache_block_hashes(self, blocks: object, hashes: object) -> None:
        """Register ``blocks[i]`` under ``hashes[i]`` (all-or-nothing; no event).

        The tier manager uses this to register blocks whose content landed by
        copy (swap-out, onboarding, offload) rather than by the request's own
        ``cache_full_blocks``.
        """
        items = self.check_own_blocks("blocks", blocks)
        keys = pc.check_hashes("hashes", hashes)
        if len(items) != len(keys):
            raise InvalidArgumentError(f"{len(items)} blocks but {len(keys)} hashes")
        for block in items:
            if block.block_hash is not None or block.is_null:
                raise BlockStateError(f"block {block.block_id} is already cached or null; cannot cache it again")
        if len({id(b) for b in items}) != len(items):
            raise BlockStateError("a block is listed twice")
        cache_range(self.blocks, self.cached_block_hash_to_block, items, keys, 0, len(items), self.medium)

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
        check_state(self.blocks, free, self.get_num_free_blocks(), self.cached_block_hash_to_block)
