"""A thin adapter that lets vLLM 0.33.0's own unit tests of the pool and the free queue run against ours.

vLLM's tests (``tests/v1/core/test_kv_cache_utils.py``, ``test_prefix_caching.py``) are read
from vLLM's source distribution and each selected test function is compiled from vLLM's text,
unchanged, into a namespace where the names it imports from vLLM are bound to the objects
here.  The adapter only translates *calling conventions*; every answer comes from tiered_kv:

* vLLM's free queue threads ``prev_free_block``/``next_free_block`` links through the blocks
  between two sentinels; ours is a deque (see :mod:`tiered_kv.core.free_queue`).  The tests
  read those links, so :class:`QueueView` and :class:`LinkedBlock` *derive* them from our
  queue's order (``get_all_free_blocks``): a block's next link is the block after it in our
  order, or the tail sentinel.  Nothing is stored; a wrong order in our queue is a wrong link.
* vLLM's pool and manager take a ``kv_cache_group_id`` (always 0 here: one group) and keep
  hashes as ``hash + group id`` keys; ``get_block_hash``/``get_group_id`` unpack them, so here
  they are the identity and 0.
* vLLM's manager returns ``KVCacheBlocks`` (one list per group); :class:`Blocks` is that.
  Its per-group tables sit in ``coordinator.single_type_managers[0].req_to_blocks``; ours are
  ``KVCacheManager.req_to_blocks``.
* vLLM's requests hash their blocks when created; ``make_request`` does the same with our
  ``BlockHasher`` (sha256), the hasher our manager uses.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from tiered_kv.core import BlockHasher, BlockPool, FreeBlockQueue, KVCacheBlock, KVCacheManager, Request
from tiered_kv.core.events import external_hash


class _End:
    """One of the two sentinels of :class:`QueueView`; its links are read off our queue."""

    def __init__(self, view: QueueView, head: bool) -> None:
        self._view, self._head = view, head
        self.block_id = -1

    @property
    def next_free_block(self) -> object:
        return self._view._neighbour(self, +1) if self._head else None

    @property
    def prev_free_block(self) -> object:
        return None if self._head else self._view._neighbour(self, -1)


class QueueView:
    """vLLM's ``FreeKVCacheBlockQueue`` interface over our ``FreeBlockQueue``.

    ``wrap`` maps our blocks to the objects the test holds (``LinkedBlock`` for the queue's own
    tests, our blocks themselves for the pool's and manager's tests).
    """

    def __init__(self, queue: FreeBlockQueue, wrap: Callable[[KVCacheBlock], Any] = lambda b: b) -> None:
        self.queue = queue
        self._wrap = wrap
        self.fake_free_list_head = _End(self, True)
        self.fake_free_list_tail = _End(self, False)

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def _order(self) -> list[Any]:
        return [self.fake_free_list_head, *map(self._wrap, self.queue.get_all_free_blocks()), self.fake_free_list_tail]

    def _neighbour(self, item: object, step: int) -> object:
        order = self._order()
        for i, x in enumerate(order):
            if x is item:
                return order[i + step]
        return None  # not in the queue: vLLM clears the links of a block it takes out

    def get_all_free_blocks(self) -> list[Any]:
        return [self._wrap(b) for b in self.queue.get_all_free_blocks()]


class LinkedBlock:
    """vLLM's ``KVCacheBlock`` for the free queue's own tests: our block, plus links read off the queue."""

    def __init__(self, block_id: int) -> None:
        self.block = KVCacheBlock(block_id)
        self.view: QueueView | None = None

    @property
    def block_id(self) -> int:
        return self.block.block_id

    @property
    def next_free_block(self) -> object:
        return None if self.view is None else self.view._neighbour(self, +1)

    @property
    def prev_free_block(self) -> object:
        return None if self.view is None else self.view._neighbour(self, -1)


class LinkedQueue(QueueView):
    """vLLM's ``FreeKVCacheBlockQueue(blocks)`` for its own tests: our queue over ``LinkedBlock``s."""

    def __init__(self, blocks: list[LinkedBlock]) -> None:
        self._by_block: dict[int, LinkedBlock] = {}
        super().__init__(FreeBlockQueue(self._inner(blocks)), lambda b: self._by_block[id(b)])

    def _inner(self, blocks: Sequence[LinkedBlock]) -> list[KVCacheBlock]:
        for b in blocks:
            b.view = self
            self._by_block[id(b.block)] = b
        return [b.block for b in blocks]

    def popleft(self) -> LinkedBlock:
        return self._by_block[id(self.queue.popleft())]

    def popleft_n(self, n: int) -> list[LinkedBlock]:
        return [self._by_block[id(b)] for b in self.queue.popleft_n(n)]

    def remove(self, block: LinkedBlock) -> None:
        self.queue.remove(block.block)

    def append(self, block: LinkedBlock) -> None:
        self.queue.append(self._inner([block])[0])

    def append_n(self, blocks: list[LinkedBlock]) -> None:
        self.queue.append_n(self._inner(blocks))

    def prepend_n(self, blocks: list[LinkedBlock]) -> None:
        self.queue.prepend_n(self._inner(blocks))


class PoolAdapter:
    """vLLM's ``BlockPool`` calling convention over ours (one KV cache group, id 0)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks = pool.blocks
        self.null_block = pool.null_block
        self.free_block_queue = QueueView(pool.free_block_queue)

    @property
    def cached_block_hash_to_block(self) -> dict[Any, Any]:
        return self.pool.cached_block_hash_to_block

    @property
    def kv_event_queue(self) -> list[Any]:
        return self.pool.kv_event_queue

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return self.pool.get_new_blocks(num_blocks)

    def free_blocks(self, blocks: Any) -> None:
        self.pool.free_blocks(list(blocks))

    def touch(self, blocks: Any) -> None:
        self.pool.touch(list(blocks))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        assert kv_cache_group_id == 0, "one KV cache group"
        self.pool.cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        assert kv_cache_group_ids == [0], "one KV cache group"
        hit = self.pool.get_cached_block(block_hash)
        return None if hit is None else [hit]

    def take_events(self) -> list[Any]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.pool.get_usage()


def make_pool(
    num_gpu_blocks: int, enable_caching: bool, hash_block_size: int, enable_kv_cache_events: bool = False
) -> PoolAdapter:
    """vLLM's ``BlockPool(num_gpu_blocks, enable_caching, hash_block_size, ...)``."""
    return PoolAdapter(BlockPool(num_gpu_blocks, enable_caching, enable_kv_cache_events))


class Blocks:
    """vLLM's ``KVCacheBlocks`` for one group."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks = (blocks,)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.blocks[0]],)


class ManagerAdapter:
    """vLLM's ``KVCacheManager`` calling convention over ours (one full-attention group)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.block_pool = PoolAdapter(manager.block_pool)
        # vLLM's manager keeps each group's tables in a single-type manager under a coordinator;
        # ours is that single-type manager, so its tables are the same dict.
        group = types.SimpleNamespace(req_to_blocks=manager.req_to_blocks, num_cached_block=manager.num_cached_block)
        self.coordinator = types.SimpleNamespace(single_type_managers=[group])

    def get_computed_blocks(self, request: Request) -> tuple[Blocks, int, None]:
        blocks, n = self.manager.get_computed_blocks(request)
        return Blocks(blocks), n, None

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Blocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Blocks | None:
        hits = [] if new_computed_blocks is None else new_computed_blocks.blocks[0]
        new = self.manager.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens=num_lookahead_tokens
        )
        return None if new is None else Blocks(list(new))

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        return self.manager.take_events()


def make_kv_cache_config(block_size: int, num_blocks: int) -> tuple[int, int]:
    """vLLM's one-group full-attention config: here just (block size, blocks)."""
    return block_size, num_blocks


def make_kv_cache_manager(
    config: tuple[int, int],
    max_model_len: int = 8192,
    enable_caching: bool = True,
    enable_kv_cache_events: bool = False,
    hash_block_size: int | None = None,
    **unused: Any,
) -> ManagerAdapter:
    block_size, num_blocks = config
    assert hash_block_size in (None, block_size), "one block size"
    mgr = KVCacheManager(
        num_blocks,
        block_size,
        enable_caching=enable_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        max_model_len=max_model_len,
    )
    return ManagerAdapter(mgr)


def make_kv_cache_manager_from_config(
    kv_cache_config: tuple[int, int],
    max_model_len: int,
    enable_caching: bool = True,
    scheduler_block_size: int | None = None,
    hash_block_size: int | None = None,
    **unused: Any,
) -> ManagerAdapter:
    """vLLM's ``KVCacheManager(kv_cache_config=..., max_model_len=..., ...)`` for one full-attention group."""
    assert scheduler_block_size in (None, kv_cache_config[0]), "one block size"
    return make_kv_cache_manager(kv_cache_config, max_model_len, enable_caching, hash_block_size=hash_block_size)


def kv_cache_config(num_blocks: int, kv_cache_tensors: list[Any], kv_cache_groups: list[Any]) -> tuple[int, int]:
    """vLLM's ``KVCacheConfig`` of one group: (block size, blocks); the tensors are the worker's, not the pool's."""
    assert len(kv_cache_groups) == 1, "one KV cache group"
    return kv_cache_groups[0].kv_cache_spec.block_size, num_blocks


def new_kv_cache_spec(block_size: int = 16, **unused: Any) -> types.SimpleNamespace:
    """vLLM's test helper ``new_kv_cache_spec``: a full-attention spec; only its block size reaches the pool."""
    return types.SimpleNamespace(block_size=block_size)


def make_request(
    request_id: str, prompt_token_ids: list[int], block_size: int, hash_fn: object = None, **unused: Any
) -> Request:
    """vLLM's test helper: a request whose full blocks are hashed at creation (our sha256 hasher)."""
    features = {k: v for k, v in unused.items() if v not in (None, 0)}  # vLLM's defaults: no such feature
    assert not features, f"request features the adapter does not translate: {sorted(features)}"
    req = Request(request_id, prompt_token_ids, max_tokens=17)
    BlockHasher.create(block_size, "sha256").update(req)
    return req


def hash_block_tokens(hash_fn: object, parent: Any, tokens: Sequence[int]) -> Any:
    """vLLM's ``hash_block_tokens`` for a test that recomputes a block's hash: our sha256 hasher's."""
    return BlockHasher.create(len(tokens), "sha256").hash_block(parent, list(tokens))


kv_cache_utils = types.SimpleNamespace(maybe_convert_block_hash=lambda h: external_hash(h, True))
KVCacheSpecKind = types.SimpleNamespace(FULL_ATTENTION=types.SimpleNamespace(value="full_attention"))


def namespace() -> dict[str, Any]:
    """The names vLLM's selected tests import, bound to the adapter."""
    import pytest

    from tiered_kv.core import AllBlocksCleared, BlockRemoved, BlockStored

    return {
        "pytest": pytest,
        "KVCacheBlock": LinkedBlock,
        "FreeKVCacheBlockQueue": LinkedQueue,
        "BlockPool": make_pool,
        "make_request": make_request,
        "make_kv_cache_config": make_kv_cache_config,
        "make_kv_cache_manager": make_kv_cache_manager,
        "KVCacheManager": make_kv_cache_manager_from_config,
        "KVCacheConfig": kv_cache_config,
        "KVCacheTensor": lambda **fields: types.SimpleNamespace(**fields),  # the worker's tensors: not the pool's
        "KVCacheGroupSpec": lambda layer_names, kv_cache_spec: types.SimpleNamespace(kv_cache_spec=kv_cache_spec),
        "new_kv_cache_spec": new_kv_cache_spec,
        "hash_block_tokens": hash_block_tokens,
        "get_block_hash": lambda key: key,
        "get_group_id": lambda key: 0,
        "kv_cache_utils": kv_cache_utils,
        "KVCacheSpecKind": KVCacheSpecKind,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "sha256": "sha256",
    }
