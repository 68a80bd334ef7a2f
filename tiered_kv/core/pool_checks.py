"""Argument checks of the block pool's public calls, and the error paths of its one-pass loops.

The pool's hot paths check their arguments inside the loop that does the work
(a block of this pool is ``own[b.block_id] is b``; anything else fails that
test or raises on the way).  When that fails, they undo what the loop did and
ask this module for the precise error, so the error path may be slow and
thorough while the common path pays for one identity test per block.

Why identity: a block of another pool has an id that may also exist here, and
accepting it would change the other pool's ref counts and corrupt both.
``own[b.block_id] is b`` holds exactly for the blocks of this pool, because
``own[i].block_id == i`` for each of them.  A block built outside any pool
(``in_pool`` unset) may only be cached, as vLLM caches one (see
``BlockPool.cache_full_blocks``); every other call refuses it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.request import Request
from tiered_kv.errors import BlockStateError, HashingError, InvalidArgumentError, TieredKVError

MEDIA = ("GPU", "CPU")
Blocks = list[KVCacheBlock]


def check_pool_args(
    num_blocks: object, enable_caching: object, enable_kv_cache_events: object, medium: object
) -> tuple[int, bool, bool, str]:
    """``BlockPool``'s arguments, checked and typed."""
    if type(num_blocks) is not int or num_blocks < 2:
        raise InvalidArgumentError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
    if type(medium) is not str or medium not in MEDIA:
        raise InvalidArgumentError(f"medium must be one of {MEDIA}, got {medium!r}")
    if type(enable_caching) is not bool:
        raise InvalidArgumentError(f"enable_caching must be True or False, got {checks.describe(enable_caching)}")
    if type(enable_kv_cache_events) is not bool:
        raise InvalidArgumentError(
            f"enable_kv_cache_events must be True or False, got {checks.describe(enable_kv_cache_events)}"
        )
    return num_blocks, enable_caching, enable_kv_cache_events, medium


def check_cache_args(
    request: object, blocks: object, num_cached_blocks: object, num_full_blocks: object, block_size: object
) -> tuple[Request, Sequence[KVCacheBlock], int, int, int] | None:
    """``cache_full_blocks``' arguments, checked and typed; ``None`` when the range is empty.

    The blocks themselves are checked by the caching loop (see ``pool_cache.cache_range``).
    """
    if (
        type(num_cached_blocks) is not int
        or type(num_full_blocks) is not int
        or type(block_size) is not int
        or block_size <= 0
    ):
        raise InvalidArgumentError(
            "num_cached_blocks and num_full_blocks must be ints and block_size an int > 0, got "
            f"{checks.describe(num_cached_blocks)}, {checks.describe(num_full_blocks)}, "
            f"{checks.describe(block_size)}"
        )
    if not isinstance(request, Request):
        raise InvalidArgumentError(f"request must be a Request, got {checks.describe(request)}")
    if type(blocks) is not list and type(blocks) is not tuple:
        raise InvalidArgumentError(f"blocks must be a list of KV blocks, got {checks.describe(blocks)}")
    if num_cached_blocks >= num_full_blocks:
        if num_cached_blocks < 0 or num_full_blocks < 0:
            raise InvalidArgumentError(f"negative block counts: {num_cached_blocks}, {num_full_blocks}")
        return None
    n_hashes = len(request.block_hashes)
    if num_cached_blocks < 0 or num_full_blocks > len(blocks):
        raise InvalidArgumentError(
            f"cannot cache blocks [{num_cached_blocks}, {num_full_blocks}) of a table of {len(blocks)}"
        )
    if num_full_blocks > n_hashes:
        raise HashingError(
            f"request {request.request_id!r}: block {n_hashes} is partial or not final "
            f"({request.num_tokens} tokens, block size {block_size}); only full blocks are cached"
        )
    return request, blocks, num_cached_blocks, num_full_blocks, block_size


def bad_count(name: str, value: object, minimum: int = 0) -> InvalidArgumentError:
    """The error for a count that is not a plain ``int >= minimum``."""
    bound = "> 0" if minimum == 1 else f">= {minimum}"
    return InvalidArgumentError(f"{name} must be an int {bound}, got {checks.describe(value)}")


def bad_hash(name: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name} must be bytes or an int, got {checks.describe(value)}")


def as_block_list(name: str, blocks: object) -> list[KVCacheBlock]:
    """``blocks`` as a list (items unchecked); a string, bytes or non-iterable is refused."""
    if isinstance(blocks, list):
        return blocks
    if isinstance(blocks, str | bytes) or not isinstance(blocks, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence of KV blocks, got {checks.describe(blocks)}")
    return list(blocks)


def is_own(block: object, own: list[KVCacheBlock]) -> bool:
    """Whether ``block`` is one of the blocks in ``own`` (by identity, in O(1))."""
    if not isinstance(block, KVCacheBlock):
        return False
    i = block.block_id
    return 0 <= i < len(own) and own[i] is block


def is_standalone(block: object) -> bool:
    """Whether ``block`` is a block that no pool made (built by hand, as vLLM's unit tests build them)."""
    return isinstance(block, KVCacheBlock) and not block.in_pool


def first_bad(blocks: Sequence[object], own: list[KVCacheBlock]) -> int:
    """Index of the first item that is not a block of ``own``; ``len(blocks)`` if none."""
    n = len(own)
    for i, b in enumerate(blocks):  # is_own, inlined: this runs once per prefix hit of every admission
        if not isinstance(b, KVCacheBlock):
            return i
        j = b.block_id
        if not (0 <= j < n and own[j] is b):
            return i
    return len(blocks)


def block_error(name: str, block: object, own: list[KVCacheBlock], medium: str) -> TieredKVError:
    """The error for one item of ``name`` that is not a block of this pool."""
    if not isinstance(block, KVCacheBlock):
        return InvalidArgumentError(f"{name} must hold KVCacheBlock objects, got {checks.describe(block)}")
    if not block.in_pool:
        return BlockStateError(
            f"block {block.block_id} was built outside any pool: this {medium} pool can cache it "
            "(cache_full_blocks) but not hold, free or register it; use the pool's own blocks"
        )
    return BlockStateError(f"block {block.block_id} does not belong to this {medium} pool (a foreign block)")


def diagnose_blocks(name: str, blocks: Sequence[object], own: list[KVCacheBlock], medium: str) -> TieredKVError | None:
    """The error for the first item of ``blocks`` that is not a block of this pool, or ``None``."""
    k = first_bad(blocks, own)
    return block_error(name, blocks[k], own, medium) if k < len(blocks) else None


def check_blocks(name: str, blocks: object, own: list[KVCacheBlock], medium: str) -> list[KVCacheBlock]:
    """``blocks`` as a list after checking every item is a block of this pool (else raise)."""
    items = as_block_list(name, blocks)
    err = diagnose_blocks(name, items, own, medium)
    if err is not None:
        raise err
    return items


def check_hashes(name: str, hashes: object) -> list[bytes | int]:
    """``hashes`` if it is a list or tuple of block hashes (bytes or plain ints), else raise."""
    if not isinstance(hashes, list | tuple):
        raise InvalidArgumentError(f"{name} must be a list of block hashes, got {checks.describe(hashes)}")
    out: list[bytes | int] = []
    for h in hashes:
        if type(h) is not bytes and type(h) is not int:
            raise bad_hash(f"a block hash in {name}", h)
        out.append(h)
    return out


def undo_touch(
    blocks: list[KVCacheBlock], own: list[KVCacheBlock], null: KVCacheBlock, medium: str
) -> TieredKVError | None:
    """Undo a ``touch`` loop stopped by a bad item; return that item's error (``None``: no bad item)."""
    k = first_bad(blocks, own)
    for block in reversed(blocks[:k]):  # last first, so that a repeated block unwinds exactly
        if block is not null:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                block.stale -= 1
    return diagnose_blocks("blocks", blocks, own, medium)


def undo_free(
    blocks: list[KVCacheBlock], own: list[KVCacheBlock], null: KVCacheBlock, medium: str
) -> TieredKVError | None:
    """Undo a ``free_blocks`` loop stopped by a bad item; return that item's error (``None``: no bad item)."""
    for block in blocks[: first_bad(blocks, own)]:
        if block is not null:
            block.ref_cnt += 1
    return diagnose_blocks("ordered_blocks", blocks, own, medium)


def undo_double_free(blocks: list[KVCacheBlock], null: KVCacheBlock, medium: str) -> BlockStateError:
    """Undo a whole ``free_blocks`` loop that took a block below zero owners; return the error."""
    for block in blocks:
        if block is not null:
            block.ref_cnt += 1
    culprits = sorted({b.block_id for b in blocks if b is not null and blocks.count(b) > b.ref_cnt})
    return BlockStateError(f"double free in the {medium} pool: block(s) {culprits} have no owner left")
