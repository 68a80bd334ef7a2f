"""Chained block hashes for prefix caching.

The hash of block ``i`` covers the hash of block ``i - 1`` (the parent), the
block's token ids and its *extra keys*, so equal hashes mean equal whole
prefixes, not just equal blocks.  Extra keys are what else changes the KV of a
block: the LoRA adapter (every block), multimodal inputs overlapping the block
(identifier and offset), and a cache salt (first block only, so tenants that
salt differently never share anything).

Three hash functions are offered:

* ``"sha256"``: SHA-256 over a canonical, type-tagged byte encoding.  Stable
  across processes and machines and collision-resistant; the choice when
  requests from different tenants share one cache.
* ``"xxh3_128"``: XXH3-128 over the same byte layout, from the optional
  ``xxhash`` package (``pip install 'tiered-kv[xxhash]'``).  Deterministic,
  128 bit, much cheaper than SHA-256, but not collision-resistant against an
  adversary; :func:`xxh3_128_block_hash` gives the collision argument.
* ``"fast"``: CPython's tuple hash (xxHash-based, 64 bit) over integers only.
  Integers hash identically in every process, and strings in extra keys are
  first reduced to integers with BLAKE2b, so it is deterministic too.  It is not
  collision-resistant; use it for simulation and benchmarks.

All start from a root hash derived from a seed, so runs are reproducible
(vLLM's ``NONE_HASH`` plays the same role).

The per-block functions here (``sha256_block_hash`` ...) are the definition;
:class:`~tiered_kv.core.block_hasher.BlockHasher` computes a request's chain
incrementally, with byte-identical digests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
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


def head_bytes(parent: BlockHash, digest_size: int) -> bytes:
    """The parent as the layout starts: raw if it is a digest of this size, else tagged."""
    if type(parent) is bytes and len(parent) == digest_size:
        return parent
    buf = bytearray()
    _encode(parent, buf)
    return bytes(buf)


def tail_bytes(extra_keys: ExtraKeys) -> bytes:
    """``"X" || tagged encoding of the keys``, the end of a block with extra keys."""
    buf = bytearray(b"X")
    _encode(extra_keys, buf)
    return bytes(buf)


def bad_tokens(exc: struct.error) -> HashingError:
    return HashingError(f"token ids must be ints in the int64 range: {exc}")


_BODY_PACKERS: dict[int, Callable[..., bytes]] = {}  # token count -> packs ``uint32 n || n x int64``


def _body_packer(n: int) -> Callable[..., bytes]:
    pack = _BODY_PACKERS.get(n)
    if pack is None:
        pack = struct.Struct(f"<I{n}q").pack
        if len(_BODY_PACKERS) < 4096:  # block sizes are few; the bound guards odd direct callers
            _BODY_PACKERS[n] = pack
    return pack


def _layout(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None, digest_size: int) -> bytes:
    """The bytes one block hashes to (see :func:`sha256_block_hash`)."""
    n = len(token_ids)
    try:
        body = _body_packer(n)(n, *token_ids)
    except struct.error as exc:
        raise bad_tokens(exc) from None
    if extra_keys is None:
        return head_bytes(parent, digest_size) + body
    return head_bytes(parent, digest_size) + body + tail_bytes(extra_keys)


def sha256_block_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
    """SHA-256 over a canonical byte layout.

    Layout: ``parent || uint32 n || n x int64 tokens (little endian)``, then, only
    when there are extra keys, ``"X" || tagged encoding of the keys``.  A parent
    that is a 32-byte ``bytes`` (a digest: the previous block's, or the root hash
    for a first block) is written raw; any other parent, such as the ``0`` the
    root hash itself is computed from, in the tagged encoding, which for those
    is never 32 bytes long; so the layout is unambiguous.
    :meth:`BlockHasher.update` produces the same digests from tokens packed
    once per call.
    """
    return hashlib.sha256(_layout(parent, token_ids, extra_keys, 32)).digest()


def load_xxh3_128() -> Callable[[bytes], bytes]:
    """Import ``xxhash`` when asked for: the core itself needs only the standard library.

    Imported at each call, not cached here: after the first time it is a lookup
    in ``sys.modules``, and hashers bind the function once when they are built.
    """
    try:
        import xxhash
    except ImportError:
        raise InvalidArgumentError(
            "hash function 'xxh3_128' needs the optional xxhash package: pip install 'tiered-kv[xxhash]'"
        ) from None
    return xxhash.xxh3_128_digest


def xxh3_128_block_hash(parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None) -> bytes:
    """XXH3-128 over the layout of :func:`sha256_block_hash`, with a 16-byte parent.

    Needs the optional ``xxhash`` package (``pip install 'tiered-kv[xxhash]'``);
    without it this raises :class:`~tiered_kv.errors.InvalidArgumentError`.

    Collision argument.  XXH3-128 passes the SMHasher quality tests, so on
    inputs nobody chose in order to collide, its 128-bit outputs behave like
    random values.  A false prefix hit needs two different prefixes whose
    chained hashes are equal.  Over ``N`` distinct prefixes ever hashed, the
    chance that any two collide is at most ``N**2 / 2**129``: about ``1.5e-15``
    for ``N = 10**12`` blocks, far below the rate of undetected hardware memory
    errors.  The 64-bit ``"fast"`` hash gives ``N**2 / 2**65``: ``3e-8`` at a
    million blocks, but ``3%`` at a billion, which a long-running server
    reaches.  XXH3 is not cryptographic: whoever chooses token ids can search
    for colliding prefixes, and so read or poison another tenant's cached KV.
    Use ``"sha256"`` when untrusted tenants share a cache.  The layout is
    unambiguous for the same reason as SHA-256's: the parent is raw only when it
    is a 16-byte digest.
    """
    return load_xxh3_128()(_layout(parent, token_ids, extra_keys, 16))


_STR_INTS: dict[object, int] = {}


def key_as_int(key: object) -> int:
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
    return hash((parent, len(token_ids), *token_ids, -1, *map(key_as_int, extra_keys)))


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_block_hash, "fast": fast_block_hash}
"""The hash functions that need nothing beyond the standard library."""

OPTIONAL_HASH_FUNCTIONS: dict[str, str] = {"xxh3_128": "xxhash"}
"""Hash functions that need an optional extra: name -> extra (``pip install 'tiered-kv[extra]'``)."""


def get_hash_fn(name: str) -> HashFn:
    """Look a hash function up by name: ``"sha256"``, ``"fast"`` or ``"xxh3_128"``.

    Raises:
        InvalidArgumentError: The name is unknown, or it needs an optional extra
            that is not installed (the message names the extra).
    """
    fn = HASH_FUNCTIONS.get(name) if isinstance(name, str) else None
    if fn is not None:
        return fn
    if name == "xxh3_128":
        load_xxh3_128()
        return xxh3_128_block_hash
    names = sorted([*HASH_FUNCTIONS, *OPTIONAL_HASH_FUNCTIONS])
    raise InvalidArgumentError(f"unknown hash function {name!r}; choose from {names}")


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
