"""What makes stored KV compatible, and how a block key is spelled in a file name or a Redis key.

Two processes may share a block only if they would have computed the same
bytes for it: the same model weights, the same KV geometry and dtype, and the
same block-hash scheme (a key is only meaningful under the hash function and
seed that produced it).  :class:`KVNamespace` folds those facts into one
16-byte digest.  Disk files live under a directory named by it, Redis keys
carry it as a prefix, and every stored block's header repeats it, so KV of an
incompatible model is never served even if two namespaces' keys collide.

The layout of the CPU tensor is *not* part of the namespace: a stored block is
always written in the canonical segment order (layer 0 K, layer 0 V, layer 1 K,
...), which is what a block-contiguous block already is, and a layer-first tier
gathers its segments into that order.

A host that is not tiered_kv (vLLM's CPU offloading tier) hands the tiers
opaque chunks instead of blocks of a :class:`KVSpec`; its namespace takes a
:class:`ChunkGeometry` (bytes per chunk and a tag naming the host's layout),
and only a host that writes the same layout tag reads those chunks back.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.store import Key

MAX_KEY_BYTES = 64
"""Longest ``bytes`` key a medium accepts (SHA-256 keys are 32, XXH3-128 keys 16): file names stay short."""

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class ChunkGeometry:
    """What tiered_kv knows of a chunk it did not lay out: its size and the name of its layout.

    Attributes:
        bytes_per_chunk: Bytes of one chunk (the payload of one stored block).
        layout: A tag for how the host arranged the bytes (model geometry, dtype, layer order,
            tokens per chunk); two hosts share chunks only if their tags are equal.
    """

    bytes_per_chunk: int
    layout: str

    def __post_init__(self) -> None:
        checks.count("ChunkGeometry.bytes_per_chunk", self.bytes_per_chunk, 1)
        if self.layout.__class__ is not str or not self.layout:
            raise InvalidArgumentError(
                f"ChunkGeometry.layout must be a non-empty str, got {checks.describe(self.layout)}"
            )

    @property
    def bytes_per_block(self) -> int:
        """The same as :attr:`bytes_per_chunk` (a stored block is one chunk)."""
        return self.bytes_per_chunk


@dataclass(frozen=True, slots=True)
class KVNamespace:
    """The compatibility class of stored KV blocks.

    Attributes:
        model: The model's name or, better, a digest of its weights and revision.
        spec: The KV geometry and dtype (layers, KV heads, head dim, block size), or a
            :class:`ChunkGeometry` for chunks whose layout a foreign host owns.
        hash_scheme: The block-hash function and its version, with anything else that
            changes what a key means (for example ``"sha256/v1/seed=0"``).
    """

    model: str
    spec: KVSpec | ChunkGeometry
    hash_scheme: str

    def __post_init__(self) -> None:
        for name in ("model", "hash_scheme"):
            value = getattr(self, name)
            if value.__class__ is not str or not value:
                raise InvalidArgumentError(f"KVNamespace.{name} must be a non-empty str, got {checks.describe(value)}")
        checks.instance("KVNamespace.spec", self.spec, (KVSpec, ChunkGeometry))

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block's payload."""
        return self.spec.bytes_per_block

    @property
    def text(self) -> str:
        """The full description the digest is taken of (stable across releases: changing it orphans stored KV)."""
        s = self.spec
        if isinstance(s, ChunkGeometry):
            return f"model={self.model};chunk_bytes={s.bytes_per_chunk};layout={s.layout};hash={self.hash_scheme}"
        return (
            f"model={self.model};layers={s.num_layers};kv_heads={s.num_kv_heads};head_dim={s.head_dim};"
            f"block_size={s.block_size};dtype={s.dtype};hash={self.hash_scheme}"
        )

    @property
    def digest(self) -> bytes:
        """16 bytes that identify the namespace (BLAKE2b of :attr:`text`)."""
        return hashlib.blake2b(self.text.encode(), digest_size=16).digest()

    @property
    def dirname(self) -> str:
        """A directory name: the readable model name, then the digest that decides."""
        readable = _SAFE.sub("_", self.model)[:48].strip("._") or "model"
        return f"{readable}-{self.digest.hex()}"

    @property
    def redis_prefix(self) -> str:
        """The prefix of every Redis key of this namespace."""
        return f"tkv:{self.digest.hex()}:"


def encodable(key: object) -> bool:
    """Whether ``key`` is a block hash a shared medium can name: ``bytes`` (at most 64) or an ``int``."""
    cls = key.__class__
    return (cls is bytes and 0 < len(key) <= MAX_KEY_BYTES) or cls is int  # type: ignore[arg-type]


def key_name(key: Key) -> str:
    """The key as a file or Redis key name: hex for ``bytes``, ``i`` and the decimal for ``int``.

    Raises:
        InvalidArgumentError: ``key`` is neither (private request keys never leave the CPU tier).
    """
    if key.__class__ is bytes and 0 < len(key) <= MAX_KEY_BYTES:  # type: ignore[arg-type]
        return key.hex()  # type: ignore[attr-defined]
    if key.__class__ is int:
        return f"i{key}"
    raise InvalidArgumentError(
        f"a key stored below the CPU tier must be a block hash (bytes of 1..{MAX_KEY_BYTES}, or int), "
        f"got {checks.describe(key)}"
    )


def parse_key_name(name: str) -> Key | None:
    """The inverse of :func:`key_name`, or ``None`` if ``name`` is not one (a foreign file)."""
    try:
        if name.startswith("i"):
            key: Key = int(name[1:], 10)
            return key if key_name(key) == name else None  # refuses "i007", "i+7"
        raw = bytes.fromhex(name)
    except ValueError:
        return None
    return raw if raw and len(raw) <= MAX_KEY_BYTES and raw.hex() == name else None
