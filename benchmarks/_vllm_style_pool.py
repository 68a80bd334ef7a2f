"""A block pool written in vLLM v1's structure, as the speed anchor.

This is *our* re-implementation of the structure described in
``shared/seeds/vllm-block-pool-internals.txt``: an intrusive doubly linked free
list with sentinels threaded through the block objects, a hash-to-block map
class with method calls per block, ``_maybe_evict_cached_block`` per handed-out
block, and a manager that calls the pool's methods.  It makes the same
decisions as ``tiered_kv.core`` (the benchmark checks that), so the ratio
between the two isolates the cost of the representation and of the hot loops.
It is not vLLM itself.  Structural costs of vLLM v1 that it reproduces:
the ``block_hash`` property with an asserting setter, group-id hash keys built
per lookup/insert (``make_block_hash_with_group_id``: hash bytes + 4-byte group
id), a metrics-collector check per block, and ``free_block_queue.remove`` as a
method call per hit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class LBlock:
    block_id: int
    ref_cnt: int = 0
    _block_hash: object = None
    prev_free_block: LBlock | None = None
    next_free_block: LBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> object:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: object) -> None:
        assert self._block_hash is None, "The block already has a hash. This should not happen."
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        self._block_hash = None


def make_block_hash_with_group_id(block_hash: object, group_id: int) -> object:
    if isinstance(block_hash, bytes):
        return block_hash + group_id.to_bytes(4, "big", signed=False)
    return (block_hash, group_id)


class LinkedFreeQueue:
    def __init__(self, blocks: list[LBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(len(blocks)):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < len(blocks) - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.head = LBlock(-1)
        self.tail = LBlock(-1)
        self.head.next_free_block = blocks[0]
        blocks[0].prev_free_block = self.head
        self.tail.prev_free_block = blocks[-1]
        blocks[-1].next_free_block = self.tail

    def popleft(self) -> LBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[LBlock]:
        if n == 0:
            return []
        self.num_free_blocks -= n
        cur = self.head.next_free_block
        ret = []
        for _ in range(n):
            ret.append(cur)
            last = cur
            cur = cur.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        self.head.next_free_block = cur
        cur.prev_free_block = self.head
        return ret

    def remove(self, block: LBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: list[LBlock]) -> None:
        if not blocks:
            return
        last = self.tail.prev_free_block
        for b in blocks:
            b.prev_free_block = last
            last.next_free_block = b
            last = b
        last.next_free_block = self.tail
        self.tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[LBlock]) -> None:
        if not blocks:
            return
        first = self.head.next_free_block
        prev = self.head
        for b in blocks:
            b.prev_free_block = prev
            prev.next_free_block = b
            prev = b
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def ids(self) -> list[int]:
        out = []
        cur = self.head.next_free_block
        while cur is not self.tail:
            out.append(cur.block_id)
            cur = cur.next_free_block
        return out


class HashToBlockMap:
    def __init__(self) -> None:
        self._cache: dict[object, LBlock | dict[int, LBlock]] = {}

    def get_one_block(self, key: object) -> LBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if isinstance(blocks, LBlock):
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: object, block: LBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, LBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: object, block_id: int) -> LBlock | None:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, LBlock):
            return blocks if blocks.block_id == block_id else None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block


class LinkedBlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = [LBlock(i) for i in range(num_blocks)]
        self.free_block_queue = LinkedFreeQueue(self.blocks)
        self.cached_block_hash_to_block = HashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.enable_caching = True
        self.metrics_collector = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: object, kv_cache_group_ids: tuple[int, ...] = (0,)) -> LBlock | None:
        cached = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if not block:
                return None
            cached.append(block)
        return cached[0]

    def _maybe_evict_cached_block(self, block: LBlock) -> bool:
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        block_hash = block.block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block.reset_hash()
        return True

    def get_new_blocks(self, n: int) -> list[LBlock]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(n)
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
                if self.metrics_collector:
                    self.metrics_collector.on_block_allocated(block)
        return ret

    def touch(self, blocks: list[LBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks) -> None:
        last, first = [], []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (first if block.block_hash is None else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def cache_full_blocks(
        self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id: int = 0
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert len(request.block_hashes) >= num_full_blocks
        new_block_hashes = request.block_hashes[num_cached_blocks:]
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null:
                continue
            assert blk.block_hash is None
            key = make_block_hash_with_group_id(new_block_hashes[i], kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.insert(key, blk)


class LinkedManager:
    """vLLM's KVCacheManager flow over the linked pool (same decisions as ours)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_pool = LinkedBlockPool(num_blocks)
        self.block_size = block_size
        self.req_to_blocks: dict = {}
        self.num_cached_block: dict = {}

    def get_computed_blocks(self, request):
        computed = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for h in request.block_hashes[:max_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            computed.append(b)
        return computed, len(computed) * self.block_size

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None):
        computed = new_computed_blocks or []
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total = num_computed + num_new_tokens
        n_new = max(-(-total // self.block_size) - len(blocks) - len(computed), 0)
        n_evictable = sum(1 for b in computed if b.ref_cnt == 0 and not b.is_null)
        if n_new + n_evictable > self.block_pool.get_num_free_blocks():
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        self.block_pool.touch(computed)
        if computed:
            blocks.extend(computed)
            self.num_cached_block[rid] = len(computed)
        new = self.block_pool.get_new_blocks(n_new)
        blocks.extend(new)
        num_full = min(total, request.num_tokens) // self.block_size
        n_cached = self.num_cached_block.get(rid, 0)
        if num_full > n_cached:
            self.block_pool.cache_full_blocks(request, blocks, n_cached, num_full, self.block_size)
            self.num_cached_block[rid] = num_full
        return new

    def free(self, request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))
