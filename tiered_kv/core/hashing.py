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

Speed: :meth:`BlockHasher.update` packs the tokens of all the blocks that
became full since its last call into one little-endian int64 buffer and hashes
each block from a slice of it, so every token of a request is packed exactly
once.  The per-block functions (``sha256_block_hash`` ...) remain the
definition: the hasher's digests are byte-identical to calling them block by
block.
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

# A chain is the pair of functions a hasher calls for one hash function and
# block size: ``one(parent, tokens, start)`` hashes the one block starting at
# ``start`` (no extra keys: a plain decode step); ``many(parent, tokens, first,
# num_full, extras)`` returns the hashes of blocks ``[first, num_full)``,
# ``extras`` holding one entry per block or ``None`` when none has extra keys.
# Both return before the caller appends anything, so a bad token changes nothing.
_One = Callable[[BlockHash, list[int], int], BlockHash]
_Many = Callable[[BlockHash, list[int], int, int, "list[ExtraKeys | None] | None"], list[BlockHash]]
_Chain = tuple[_One, _Many]


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


def _head(parent: BlockHash, digest_size: int) -> bytes:
    """The parent as the layout starts: raw if it is a digest of this size, else tagged."""
    if parent.__class__ is bytes and len(parent) == digest_size:  # type: ignore[arg-type]
        return parent  # type: ignore[return-value]
    buf = bytearray()
    _encode(parent, buf)
    return bytes(buf)


def _tail(extra_keys: ExtraKeys) -> bytes:
    """``"X" || tagged encoding of the keys``, the end of a block with extra keys."""
    buf = bytearray(b"X")
    _encode(extra_keys, buf)
    return bytes(buf)


def _bad_tokens(exc: struct.error) -> HashingError:
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
        raise _bad_tokens(exc) from None
    if extra_keys is None:
        return _head(parent, digest_size) + body
    return _head(parent, digest_size) + body + _tail(extra_keys)


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


def _load_xxh3_128() -> Callable[[bytes], bytes]:
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
    return _load_xxh3_128()(_layout(parent, token_ids, extra_keys, 16))


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
        if parent.__class__ is not bytes or len(parent) != digest_size:  # type: ignore[arg-type]
            parent = _head(parent, digest_size)
        try:
            data = block(parent, bs, *tokens[start : start + bs])
        except struct.error as exc:
            raise _bad_tokens(exc) from None
        return sha(data).digest() if xxh3 is None else xxh3(data)

    def many(
        parent: BlockHash, tokens: list[int], first: int, num_full: int, extras: list[ExtraKeys | None] | None
    ) -> list[BlockHash]:
        p = _head(parent, digest_size)
        try:
            # One ``<Nq`` Struct from struct's own format cache; it is small whatever N is.
            packed = struct.pack(f"<{(num_full - first) * bs}q", *tokens[first * bs : num_full * bs])
        except struct.error as exc:
            raise _bad_tokens(exc) from None
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
            p = digest(data if extra is None else data + _tail(extra))
            out.append(p)
        return out

    return one, many


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
                parent = hash((parent, bs, *tokens[s : s + bs], -1, *map(_as_int, extra)))
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
        return _digest_chain(block_size, 16, _load_xxh3_128())
    if fn is fast_block_hash:
        return _fast_chain(block_size)
    return _call_chain(fn, block_size)


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
        _load_xxh3_128()
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


def _check_hasher_args(block_size: object, hash_fn: object) -> None:
    if block_size.__class__ is not int or block_size <= 0:  # type: ignore[operator]
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
