"""The incremental block hasher: a request's chained block hashes, computed as its blocks fill.

:meth:`BlockHasher.update` packs the tokens of all the blocks that became full
since its last call into one little-endian int64 buffer and hashes each block
from a slice of it, so every token of a request is packed exactly once.  The
per-block functions of :mod:`tiered_kv.core.hashing` remain the definition: the
hasher's digests are byte-identical to calling them block by block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from tiered_kv.core.block import BlockHash
from tiered_kv.core.hashing import (
    ExtraKeys,
    HashFn,
    bad_tokens,
    block_extra_keys,
    fast_block_hash,
    get_hash_fn,
    head_bytes,
    key_as_int,
    load_xxh3_128,
    root_hash,
    sha256_block_hash,
    tail_bytes,
    xxh3_128_block_hash,
)
from tiered_kv.core.request import Request
from tiered_kv.errors import HashingError, InvalidArgumentError

# A chain is the pair of functions a hasher calls for one hash function and
# block size: ``one(parent, tokens, start)`` hashes the one block starting at
# ``start`` (no extra keys: a plain decode step); ``many(parent, tokens, first,
# num_full, extras)`` returns the hashes of blocks ``[first, num_full)``,
# ``extras`` holding one entry per block or ``None`` when none has extra keys.
# Both return before the caller appends anything, so a bad token changes nothing.
_One = Callable[[BlockHash, list[int], int], BlockHash]
_Many = Callable[[BlockHash, list[int], int, int, "list[ExtraKeys | None] | None"], list[BlockHash]]
_Chain = tuple[_One, _Many]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _digest_chain(block_size: int, digest_size: int, xxh3: Callable[[bytes], bytes] | None) -> _Chain:
    """The chain of SHA-256 (``xxh3`` is ``None``) or XXH3-128 for one block size.

    What depends only on the block size is bound here, once per hasher, so that
    a call pays for packing and hashing and little else.
    """
    bs = block_size
    header = struct.pack("<I", bs)
    block = struct.Struct(f"<{digest_size}sI{bs}q").pack  # a whole block's layout, parent included
    chunks = struct.Struct(f"{8 * bs}s").iter_unpack
    sha = hashlib.sha256
    digest = _sha256 if xxh3 is None else xxh3

    def one(parent: BlockHash, tokens: list[int], start: int) -> BlockHash:
        # A decode step fills one block: packing that block is all the packing there is.
        if type(parent) is not bytes or len(parent) != digest_size:
            parent = head_bytes(parent, digest_size)
        try:
            data = block(parent, bs, *tokens[start : start + bs])
        except struct.error as exc:
            raise bad_tokens(exc) from None
        return sha(data).digest() if xxh3 is None else xxh3(data)

    def many(
        parent: BlockHash, tokens: list[int], first: int, num_full: int, extras: list[ExtraKeys | None] | None
    ) -> list[BlockHash]:
        p = head_bytes(parent, digest_size)
        try:
            # One ``<Nq`` Struct from struct's own format cache; it is small whatever N is.
            packed = struct.pack(f"<{(num_full - first) * bs}q", *tokens[first * bs : num_full * bs])
        except struct.error as exc:
            raise bad_tokens(exc) from None
        # ``iter_unpack`` cuts the buffer into per-block bytes in C, cheaper than slicing
        # in the loop; concatenating beats a memoryview and several ``update`` calls here.
        blocks = chunks(packed)
        if extras is None:
            # The comprehension rebinds ``p``: each block's digest is the next one's parent.
            if xxh3 is None:
                return [p := sha(p + header + c).digest() for (c,) in blocks]
            return [p := xxh3(p + header + c) for (c,) in blocks]
        out: list[BlockHash] = []
        for extra, (c,) in zip(extras, blocks, strict=True):
            data = p + header + c
            p = digest(data if extra is None else data + tail_bytes(extra))
            out.append(p)
        return out

    return one, many


def _fast_chain(block_size: int) -> _Chain:
    """The tuple hash reads Python ints directly: nothing to pack, only per-block calls to save."""
    bs = block_size

    def one(parent: BlockHash, tokens: list[int], start: int) -> BlockHash:
        return hash((parent, bs, *tokens[start : start + bs]))

    def many(
        parent: BlockHash, tokens: list[int], first: int, num_full: int, extras: list[ExtraKeys | None] | None
    ) -> list[BlockHash]:
        starts = range(first * bs, num_full * bs, bs)
        if extras is None:
            return [parent := hash((parent, bs, *tokens[s : s + bs])) for s in starts]
        out: list[BlockHash] = []
        for extra, s in zip(extras, starts, strict=True):
            if extra is None:
                parent = hash((parent, bs, *tokens[s : s + bs]))
            else:
                parent = hash((parent, bs, *tokens[s : s + bs], -1, *map(key_as_int, extra)))
            out.append(parent)
        return out

    return one, many


def _call_chain(fn: HashFn, block_size: int) -> _Chain:
    """The chain of any other hash function: one call per block."""
    bs = block_size

    def one(parent: BlockHash, tokens: list[int], start: int) -> BlockHash:
        return fn(parent, tokens[start : start + bs], None)

    def many(
        parent: BlockHash, tokens: list[int], first: int, num_full: int, extras: list[ExtraKeys | None] | None
    ) -> list[BlockHash]:
        out: list[BlockHash] = []
        for i, s in enumerate(range(first * bs, num_full * bs, bs)):
            parent = fn(parent, tokens[s : s + bs], None if extras is None else extras[i])
            out.append(parent)
        return out

    return one, many


def _make_chain(fn: HashFn, block_size: int) -> _Chain:
    if fn is sha256_block_hash:
        return _digest_chain(block_size, 32, None)
    if fn is xxh3_128_block_hash:
        return _digest_chain(block_size, 16, load_xxh3_128())
    if fn is fast_block_hash:
        return _fast_chain(block_size)
    return _call_chain(fn, block_size)


# Extra keys of the keys derived from a request's given prefix hashes: an int marker (the fast
# hash reads ints as they are) that no token block carries, then the hashes' block size.
_PREFIX_KEY = 0x7072656669780001
_PREFIX_TAIL = 0x7072656669780002


def _check_hasher_args(block_size: object, hash_fn: object) -> None:
    if type(block_size) is not int or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    if not callable(hash_fn):
        raise InvalidArgumentError(f"hash_fn must be a hash-function name or a callable, got {hash_fn!r}")


class BlockHasher:
    """Computes a request's block hashes incrementally.

    ``update(request)`` hashes only the blocks that became full since the last
    call, appending to ``request.block_hashes``.  Only final tokens are in
    ``request.all_token_ids`` (lookahead/draft tokens are not), so a hash is
    never computed over a token that could still change.

    Each call packs the tokens of its newly full blocks once and hashes every
    block from that buffer (built-in hash functions; any other function is
    called block by block).  No packed tokens are kept between calls: every
    token is in exactly one call's range, so a per-request buffer would never
    be read twice; and tokens past the last full block, the only ones a caller
    may still take back, are never packed.

    ``block_size``, ``hash_fn`` and ``root`` are fixed at construction (the
    packing is specialised for them); ``num_hashed_blocks`` counts the blocks
    hashed so far, for statistics.
    """

    __slots__ = ("_block_size", "_hash_fn", "_many", "_one", "_root", "num_hashed_blocks")

    def __init__(self, block_size: int, hash_fn: HashFn, root: BlockHash, num_hashed_blocks: int = 0) -> None:
        _check_hasher_args(block_size, hash_fn)
        self._block_size = block_size
        self._hash_fn = hash_fn
        self._root = root
        self._one, self._many = _make_chain(hash_fn, block_size)
        self.num_hashed_blocks = num_hashed_blocks

    @classmethod
    def create(cls, block_size: int, hash_fn: str | HashFn = "sha256", seed: int = 0) -> BlockHasher:
        """A hasher for ``block_size``-token blocks whose root is derived from ``seed``."""
        fn = get_hash_fn(hash_fn) if isinstance(hash_fn, str) else hash_fn
        _check_hasher_args(block_size, fn)
        return cls(block_size, fn, root_hash(fn, seed))

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_fn(self) -> HashFn:
        return self._hash_fn

    @property
    def root(self) -> BlockHash:
        """The parent of every first block."""
        return self._root

    def update(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover every full block; return the list.

        All-or-nothing: when a token id cannot be hashed (``HashingError``), no
        hash is appended and the count is unchanged.
        """
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self._block_size
        num_full = len(tokens) // bs
        first = len(hashes)
        if first >= num_full:
            return hashes
        prefix = request.prefix_hashes
        if prefix is not None:
            return self._update_prefixed(request, prefix, first, num_full)
        parent = hashes[-1] if first else self._root
        # The chain functions are read into locals before the call: calling a callable
        # held in a slot straight from the attribute takes CPython's slow, unspecialised path.
        if request.lora_name is None and not request.mm_features and (first or request.cache_salt is None):
            # No block in range has extra keys (the salt keys block 0 only).
            if first + 1 == num_full:
                one = self._one
                hashes.append(one(parent, tokens, first * bs))
            else:
                many = self._many
                hashes += many(parent, tokens, first, num_full, None)
        else:
            extras = [block_extra_keys(request, s, s + bs) for s in range(first * bs, num_full * bs, bs)]
            many = self._many
            hashes += many(parent, tokens, first, num_full, extras)
        self.num_hashed_blocks += num_full - first
        return hashes

    def _update_prefixed(self, request: Request, prefix: tuple[int, ...], first: int, num_full: int) -> list[BlockHash]:
        """``update`` for a request built by :meth:`Request.from_hashes`: keys from its given hashes.

        Pool block ``k`` ends at token ``e = (k + 1) * block_size``, inside given
        block ``j = (e - 1) // S``; its key hashes ``(hashes[j], e - j * S)``.
        ``hashes[j]`` stands for the whole prefix up to the end of given block ``j``,
        so two requests share pool block ``k`` exactly when they share given block
        ``j`` (a 512-token hash becomes 32 keys of 16 tokens, none shared unless the
        512-token block is), and the keys are the same in every run and for every
        pool that uses this hash function and block size.  The first block past the
        prompt's full blocks (the prompt's partial tail, then output) chains from a
        key of the last given hash and the prompt length, since its prompt tokens
        are placeholders; the blocks after it chain from token ids as usual.
        """
        hashes = request.block_hashes
        bs = self._block_size
        size = request.prefix_block_size
        n_prompt = request.num_prompt_tokens
        prompt_full = n_prompt // bs
        fn = self._hash_fn
        root = self._root
        extra: tuple[object, ...] = (_PREFIX_KEY, size)
        new: list[BlockHash] = []
        for k in range(first, min(num_full, prompt_full)):
            e = (k + 1) * bs
            j = (e - 1) // size
            new.append(fn(root, (prefix[j], e - j * size), extra))
        start = first + len(new)
        if start < num_full:
            if start == prompt_full:
                parent = fn(root, (prefix[-1], n_prompt), (_PREFIX_TAIL, size))
            else:
                parent = new[-1] if new else hashes[-1]
            many = self._many
            new += many(parent, request.all_token_ids, start, num_full, None)
        hashes += new
        self.num_hashed_blocks += len(new)
        return hashes

    def hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> BlockHash:
        """Hash one block; refuses a partial block, whose tokens are not final."""
        if len(token_ids) != self._block_size:
            raise HashingError(f"cannot hash a partial block: {len(token_ids)} tokens, block size {self._block_size}")
        return self._hash_fn(self._root if parent is None else parent, token_ids, extra_keys)

    def __repr__(self) -> str:
        name = getattr(self._hash_fn, "__name__", repr(self._hash_fn))
        return f"BlockHasher(block_size={self._block_size}, hash_fn={name}, hashed={self.num_hashed_blocks})"
