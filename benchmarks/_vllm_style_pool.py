"""The speed anchor: a block pool with vLLM 0.33's per-call structure.

This is our re-implementation, written from ``vllm/v1/core/block_pool.py`` and
``kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``) of vLLM
0.33.0, and restricted to the configuration the benchmarks run: one KV-cache
group, hash block size equal to the block size, no metrics collector, KV
events off.  Within that configuration every public call does what vLLM's does,
step for step, so that the time it takes is the time vLLM's structure costs:

* blocks are ``@dataclass(slots=True)`` records with vLLM's fields (owning
  pool, hash and its token count, the two free-list links), ``eq=True`` as in
  vLLM, and the hash behind a property with an asserting setter;
* the free queue is an intrusive doubly linked list with two sentinels, with
  vLLM's single-block fast path in ``popleft_n``;
* hash keys carry the group id (hash bytes + 4 bytes), built by a function
  call on every lookup and insert, and the hash-to-block map is a class whose
  methods check the entry's type with ``isinstance``;
* ``get_new_blocks`` evicts through ``_maybe_evict_cached_block`` ->
  ``_remove_cached_block_hashes`` per block (with the secondary-hash index
  lookup), ``cache_full_blocks`` inserts through ``_insert_block_hash`` (with
  its ``contain`` check), ``get_cached_block`` returns one block per group,
  and ``touch``/``free_blocks`` test the null flag, the owning pool and the
  metrics collector per block, as vLLM does.

``benchmarks/bench_block_pool.py --vllm`` replays the same calls against vLLM's
own ``BlockPool`` when vLLM is importable, and reports both, so the anchor's
fidelity is itself measured.  It makes the decisions of ``tiered_kv.core``
(the benchmark checks identical block ids, free-queue order and cached set).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NewType

GroupKey = NewType("GroupKey", bytes)  # vLLM's BlockHashWithGroupId: a NewType called per key


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> GroupKey:
    return GroupKey(block_hash + group_id.to_bytes(4, "big", signed=False))


@dataclass(slots=True)
class LBlock:
    block_id: int
    ref_cnt: int = 0
    pool: LinkedBlockPool | None = field(default=None, repr=False, compare=False, kw_only=True)
    _block_hash: GroupKey | None = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: LBlock | None = None
    next_free_block: LBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> GroupKey | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: GroupKey, num_tokens: int | None = None) -> None:
        assert self.block_hash is None and self._block_hash_num_tokens is None, "block already hashed"
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None


class LinkedFreeQueue:
    """Free blocks as a doubly linked list threaded through the blocks, between two sentinels."""

    def __init__(self, blocks: list[LBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(self.num_free_blocks):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < self.num_free_blocks - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.head = LBlock(block_id=-1)
        self.tail = LBlock(block_id=-1)
        if self.num_free_blocks > 0:
            self.head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.head
            self.tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.tail
        else:
            self.head.next_free_block = self.tail
            self.tail.prev_free_block = self.head

    def popleft(self) -> LBlock:
        first = self.head.next_free_block
        if first is self.tail or first is None:
            assert self.num_free_blocks == 0, "free count out of sync"
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        if nxt is None:
            raise RuntimeError("a free block without a successor")
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[LBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        cur = self.head.next_free_block
        if n == 1:
            assert cur is not None
            nxt = cur.next_free_block
            cur.prev_free_block = None
            cur.next_free_block = None
            if nxt is not None:
                self.head.next_free_block = nxt
                nxt.prev_free_block = self.head
            return [cur]
        ret = []
        for _ in range(n):
            assert cur is not None
            ret.append(cur)
            last = cur
            cur = cur.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if cur is not None:
            self.head.next_free_block = cur
            cur.prev_free_block = self.head
        return ret

    def remove(self, block: LBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of a block that is not free: {block.block_id}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks: list[LBlock]) -> None:
        if len(blocks) == 0:
            return
        first = self.head.next_free_block
        assert first is not None
        prev = self.head
        for b in blocks:
            b.prev_free_block = prev
            prev.next_free_block = b
            prev = b
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[LBlock]) -> None:
        if not blocks:
            return
        last = self.tail.prev_free_block
        assert last is not None
        for b in blocks:
            b.prev_free_block = last
            last.next_free_block = b
            last = b
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def ids(self) -> list[int]:
        out = []
        cur = self.head.next_free_block
        while cur is not None and cur is not self.tail:
            out.append(cur.block_id)
            cur = cur.next_free_block
        return out


class HashToBlockMap:
    """Key -> one block, or ``{block_id: block}`` when several blocks carry the key."""

    def __init__(self) -> None:
        self._cache: dict[GroupKey, LBlock | dict[int, LBlock]] = {}

    def get_one_block(self, key: GroupKey) -> LBlock | None:
        blocks = self._cache.get(key)
        if blocks is not None:
            if isinstance(blocks, LBlock):
                return blocks
            if isinstance(blocks, dict):
                return next(iter(blocks.values()))
            raise AssertionError(f"bad entry {type(blocks)}")
        return None

    def contain(self, key: GroupKey, block_id: int) -> bool:
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if isinstance(blocks, LBlock):
            return blocks.block_id == block_id
        if isinstance(blocks, dict):
            return block_id in blocks
        raise AssertionError(f"bad entry {type(blocks)}")

    def insert(self, key: GroupKey, block: LBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, LBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            raise AssertionError(f"bad entry {type(blocks)}")

    def pop(self, key: GroupKey, block_id: int) -> LBlock | None:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, LBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        if isinstance(blocks, dict):
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        raise AssertionError(f"bad entry {type(blocks)}")

    def __len__(self) -> int:
        return len(self._cache)


class LinkedBlockPool:
    """vLLM's ``BlockPool`` calls: same arguments, same per-call work (see the module docstring)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True, hash_block_size: int = 16) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [LBlock(i, pool=self) for i in range(num_gpu_blocks)]
        self.free_block_queue = LinkedFreeQueue(self.blocks)
        self.cached_block_hash_to_block = HashToBlockMap()
        self.cached_block_hashes_by_block: dict[int, set[GroupKey]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_kv_cache_events = False
        self.metrics_collector = None
        self._reuse_watchers: dict[int, object] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[LBlock] | None:
        cached = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if not block:
                return None
            cached.append(block)
        return cached

    def cache_full_blocks(
        self,
        request,
        blocks: list[LBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert block_mask is None or len(block_mask) == len(new_full_blocks)
        block_hashes = _resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        new_block_hashes = block_hashes[num_cached_blocks:]
        new_hashes: list[bytes] | None = [] if self.enable_kv_cache_events else None
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            block_hash = new_block_hashes[i]
            num_hash_tokens = (num_cached_blocks + i + 1) * block_size
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            if blk.block_hash is not None:
                assert blk.block_hash_num_tokens is not None and blk.block_hash_num_tokens < num_hash_tokens
                self._remove_cached_block_hashes(blk)
            self._insert_block_hash(key, blk, num_tokens=num_hash_tokens)
            if new_hashes is not None:
                new_hashes.append(block_hash)

    def _remove_cached_block_hashes(self, block: LBlock) -> list[GroupKey]:
        block_hashes: list[GroupKey] = []
        if block.block_hash is not None:
            block_hashes.append(block.block_hash)
        block_hashes.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not block_hashes:
            return []
        removed: list[GroupKey] = []
        for key in block_hashes:
            if self.cached_block_hash_to_block.pop(key, block.block_id) is not None:
                removed.append(key)
        block.reset_hash()
        return removed

    def _emit_block_removed_events(self, block_hashes: list[GroupKey]) -> None:
        if not self.enable_kv_cache_events:
            return
        raise AssertionError("events are off in the benchmark")

    def _insert_block_hash(self, key: GroupKey, block: LBlock, num_tokens: int | None) -> None:
        if block.block_hash == key:
            return
        if self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens=num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def get_new_blocks(self, num_blocks: int) -> list[LBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            raise AssertionError("no reuse watchers in the benchmark")
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
        return ret

    def _maybe_evict_cached_block(self, block: LBlock) -> bool:
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        evicted = self._remove_cached_block_hashes(block)
        if not evicted:
            return False
        self._emit_block_removed_events(evicted)
        return True

    def touch(self, blocks: Sequence[LBlock]) -> None:
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[LBlock]) -> None:
        blocks_to_evict_last = []
        blocks_to_evict_first = []
        other_pools: dict[LinkedBlockPool, list[LBlock]] = {}
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.pool is not None and block.pool is not self:
                other_pools.setdefault(block.pool, []).append(block)
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    blocks_to_evict_first.append(block)
                else:
                    blocks_to_evict_last.append(block)
        self.free_block_queue.prepend_n(blocks_to_evict_first)
        self.free_block_queue.append_n(blocks_to_evict_last)
        for pool, blocks in other_pools.items():
            pool.free_blocks(blocks)

    # Inspection for the benchmark's equality checks (not timed).
    def free_ids(self) -> list[int]:
        return self.free_block_queue.ids()

    def cached_ids(self) -> list[int]:
        return sorted(b.block_id for b in self.blocks if b.block_hash is not None)


def _resolve_block_hashes(block_hashes: list[bytes], hash_block_size: int, block_size: int) -> list[bytes]:
    # vLLM re-views the hashes when a group's block size differs; here they are equal.
    if block_size == hash_block_size:
        return block_hashes
    raise AssertionError("one block size in the benchmark")


class LinkedManager:
    """A manager in vLLM v1's flow over the anchor pool (same decisions as ours).

    ``get_computed_blocks`` probes with ``get_cached_block`` per block, as vLLM's
    ``find_longest_cache_hit`` does; ``free`` passes the table last block first.
    """

    def __init__(self, num_blocks: int, block_size: int, pool: LinkedBlockPool | None = None) -> None:
        self.block_pool = pool if pool is not None else LinkedBlockPool(num_blocks, True, block_size)
        self.block_size = block_size
        self.req_to_blocks: dict = {}
        self.num_cached_block: dict = {}
        self.group_ids = [0]

    def get_computed_blocks(self, request):
        computed: list[LBlock] = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for h in islice(request.block_hashes, max_blocks):
            cached = self.block_pool.get_cached_block(h, self.group_ids)
            if not cached:
                break
            computed.append(cached[0])
        return computed, len(computed) * self.block_size

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
        computed = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        n_new = max(-(-total // self.block_size) - len(blocks) - len(computed), 0)
        n_evictable = sum(1 for b in computed if b.ref_cnt == 0 and not b.is_null)
        if n_new + n_evictable > self.block_pool.get_num_free_blocks():
            return None
        if rid not in self.req_to_blocks:  # first allocation: vLLM touches the hits, even none
            self.req_to_blocks[rid] = blocks
            self.block_pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_block[rid] = len(computed)
        new = self.block_pool.get_new_blocks(n_new) if n_new else []
        blocks.extend(new)
        num_full = min(total, request.num_tokens) // self.block_size
        n_cached = self.num_cached_block.get(rid, 0)
        if num_full > n_cached:
            self.block_pool.cache_full_blocks(request, blocks, n_cached, num_full, self.block_size, 0)
            self.num_cached_block[rid] = num_full
        return new

    def free(self, request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
