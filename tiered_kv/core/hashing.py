"""Chained block hashes for prefix caching.

The hash of block ``i`` covers the hash of block ``i - 1`` (the parent), the
block's token ids and its *extra keys*, so equal hashes mean equal whole
prefixes, not just equal blocks.  Extra keys are what else changes the KV of a
block: the LoRA adapter (every block), multimodal inputs overlapping the block
(identifier and offset), and a cache salt (first block only, so tenants that
salt differently never share anything).

Two hash functions are offered:

* ``"sha256"``: SHA-256 over a canonical, type-tagged byte encoding.  Stable
  across processes and machines and collision-resistant; the choice when
  requests from different tenants share one cache.
* ``"fast"``: CPython's tuple hash (xxHash-based, 64 bit) over integers only.
  Integers hash identically in every process, and strings in extra keys are
  first reduced to integers with BLAKE2b, so it is deterministic too.  It is not
  collision-resistant; use it for simulation and benchmarks.

Both start from a root hash derived from a seed, so runs are reproducible
(vLLM's ``NONE_HASH`` plays the same role).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered_kv.core.block import BlockHash
from tiered_kv.errors import HashingError, InvalidArgumentError

if TYPE_CHECKING:
    from tiered_kv.core.request import Request

ExtraKeys = tuple[object, ...]
HashFn = Callable[[BlockHash, Sequence[int], ExtraKeys | None], BlockHash]


def _encode(obj: object, out: bytearray) -> None:
    """Append a canonical, type-tagged encoding of ``obj`` (no ambiguity between types)."""
    if obj is None:
        out += b"N"
    elif isinstance(obj, bool):
        out += b"T" if obj else b"F"
    elif isinstance(obj, int):
        raw = obj.to_bytes((obj.bit_length() + 8) // 8 or 1, "little", signed=True)
        out += b"I" + len(raw).to_bytes(2, "little") + raw
    elif isinstance(obj, str):
        raw = obj.encode()
        out += b"S" + len(raw).to_bytes(4, "little") + raw
    elif isinstance(obj, bytes):
        out += b"B" + len(obj).to_bytes(4, "little") + obj
    elif isinstance(obj, tuple | list):
        out += b"L" + len(obj).to_bytes(4, "little")
        for item in obj:
            _encode(item, out)
    else:
        raise HashingError(f"cannot hash extra key of type {type(obj).__name__}: {obj!r}")


_PACKERS: dict[int, Callable[..., bytes]] = {}


def sha256_block_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
    """SHA-256 over a canonical byte layout.

    Layout: ``parent || uint32 n || n x int64 tokens (little endian)``, then, only
    when there are extra keys, ``"X" || tagged encoding of the keys``.  The parent
    is a 32-byte digest for every block but the first, whose parent (the root
    seed) is given in the tagged encoding, which never has 32 bytes; so the
    layout is unambiguous.
    """
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"<I{n}q").pack
    if parent.__class__ is bytes and len(parent) == 32:  # type: ignore[arg-type]
        head = parent
    else:
        buf = bytearray()
        _encode(parent, buf)
        head = bytes(buf)
    body = pack(n, *token_ids)
    if extra_keys is None:
        return hashlib.sha256(head + body).digest()  # type: ignore[operator]
    out = bytearray(head)  # type: ignore[arg-type]
    out += body
    out += b"X"
    _encode(extra_keys, out)
    return hashlib.sha256(out).digest()


_STR_INTS: dict[object, int] = {}


def _as_int(key: object) -> int:
    """Reduce an extra key to an int that is the same in every process."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    cached = _STR_INTS.get(key)
    if cached is None:
        buf = bytearray()
        _encode(key, buf)
        cached = int.from_bytes(hashlib.blake2b(buf, digest_size=8).digest(), "little")
        if len(_STR_INTS) < 65536:
            _STR_INTS[key] = cached
    return cached


def fast_block_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> int:
    """64-bit tuple hash of ``(parent, len, *tokens[, *extra])``; deterministic, not cryptographic."""
    if extra_keys is None:
        return hash((parent, len(token_ids), *token_ids))
    return hash((parent, len(token_ids), *token_ids, -1, *map(_as_int, extra_keys)))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "fast": fast_block_hash}


def get_hash_fn(name: str) -> HashFn:
    """Look a hash function up by name (``"sha256"`` or ``"fast"``)."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise InvalidArgumentError(f"unknown hash function {name!r}; choose from {sorted(HASH_FUNCTIONS)}") from None


def root_hash(hash_fn: HashFn, seed: int = 0) -> BlockHash:
    """The parent hash of every first block: a hash of the seed alone."""
    return hash_fn(0, (), ("tiered_kv-root", seed))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash,
    curr_block_token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash one full block given its parent's hash (vLLM's name and argument order)."""
    return hash_fn(parent_block_hash, curr_block_token_ids, extra_keys)


def block_extra_keys(request: Request, start: int, end: int) -> ExtraKeys | None:
    """Extra keys of the block covering tokens ``[start, end)`` of ``request``.

    * LoRA name on every block: KV depends on the adapter everywhere.
    * ``(identifier, offset)`` of each multimodal input overlapping the block.
    * The cache salt on the first block only; chaining carries it onward.
    """
    keys: list[object] = []
    if request.lora_name is not None:
        keys.append(request.lora_name)
    for mm in request.mm_features:
        if mm.offset < end and mm.offset + mm.length > start:
            keys.append((mm.identifier, mm.offset))
    if start == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


@dataclass(slots=True)
class BlockHasher:
    """Computes a request's block hashes incrementally.

    ``update(request)`` hashes only the blocks that became full since the last
    call, appending to ``request.block_hashes``.  Only final tokens are in
    ``request.all_token_ids`` (lookahead/draft tokens are not), so a hash is
    never computed over a token that could still change.
    """

    block_size: int
    hash_fn: HashFn
    root: BlockHash
    num_hashed_blocks: int = 0  # total blocks hashed by this hasher, for stats

    @classmethod
    def create(cls, block_size: int, hash_fn: str | HashFn = "sha256", seed: int = 0) -> BlockHasher:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
        fn = get_hash_fn(hash_fn) if isinstance(hash_fn, str) else hash_fn
        return cls(block_size, fn, root_hash(fn, seed))

    def update(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover every full block; return the list."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        num_full = len(tokens) // bs
        i = first = len(hashes)
        if i >= num_full:
            return hashes
        fn = self.hash_fn
        parent = hashes[-1] if hashes else self.root
        plain = request.lora_name is None and not request.mm_features and request.cache_salt is None
        while i < num_full:
            start = i * bs
            extra = None if plain else block_extra_keys(request, start, start + bs)
            parent = fn(parent, tokens[start : start + bs], extra)
            hashes.append(parent)
            i += 1
        self.num_hashed_blocks += num_full - first
        return hashes

    def hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
    ) -> BlockHash:
        """Hash one block; refuses a partial block, whose tokens are not final."""
        if len(token_ids) != self.block_size:
            raise HashingError(f"cannot hash a partial block: {len(token_ids)} tokens, block size {self.block_size}")
        return self.hash_fn(self.root if parent is None else parent, token_ids, extra_keys)
