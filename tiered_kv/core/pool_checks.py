"""Argument checks of the block pool's public calls, and the diagnosis of a bad argument.

The pool's hot paths check their arguments inside the loop that does the work
(a block of this pool is ``own[b.block_id] is b``; anything else fails that
test or raises on the way).  When that fails, they undo what the loop did and
ask this module for the precise error, so the error path may be slow and
thorough while the common path pays for one identity test per block.

Why identity: a block of another pool has an id that may also exist here, and
accepting it would change the other pool's ref counts and corrupt both.
``own[b.block_id] is b`` holds exactly for the blocks of this pool, because
``own[i].block_id == i`` for each of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.errors import BlockStateError, InvalidArgumentError, TieredKVError


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


def first_bad(blocks: Sequence[object], own: list[KVCacheBlock]) -> int:
    """Index of the first item that is not a block of ``own``; ``len(blocks)`` if none."""
    for i, b in enumerate(blocks):
        if not is_own(b, own):
            return i
    return len(blocks)


def block_error(name: str, block: object, own: list[KVCacheBlock], medium: str) -> TieredKVError:
    """The error for one item of ``name`` that is not a block of this pool."""
    if not isinstance(block, KVCacheBlock):
        return InvalidArgumentError(f"{name} must hold KVCacheBlock objects, got {checks.describe(block)}")
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
