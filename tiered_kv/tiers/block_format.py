"""The framing of one stored block: a small header, the key, then the payload.

The same framing is used for a disk file and for a Redis value, so that a
reader can always tell a whole block of its own namespace from anything else::

    offset  size  field
    0       8     magic  b"TKVBLK" + format version (2 bytes)
    8       16    namespace digest (KVNamespace.digest)
    24      1     key kind: 0 bytes, 1 int
    25      1     key length (bytes)
    26      2     reserved, 0
    28      8     payload length (bytes)
    36      4     CRC-32 of the payload
    40      4     CRC-32 of bytes 0..40 and of the key
    44      n     key (bytes as is; int as signed little-endian)
    44 + n  ...   payload

Why each field:

* the magic and the namespace refuse foreign files and KV of another model;
* the key, checked against the name the block was found under, refuses a
  file that was renamed or copied to the wrong name;
* the payload length refuses a truncated (torn) block before reading it;
* the payload CRC refuses a block whose bytes changed after the header was
  written (a power loss before data reached the disk, a bit flip);
* the header CRC refuses a header that is itself damaged.

CRC-32 (``zlib.crc32``) is in the standard library, runs at several GB/s and
releases the GIL on large buffers, so checking every load costs little next to
the read itself; it detects corruption, not tampering (a shared medium is
trusted).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from tiered_kv.errors import TieredKVError
from tiered_kv.tiers.namespace import MAX_KEY_BYTES, key_name
from tiered_kv.tiers.store import Key

MAGIC = b"TKVBLK\x00\x01"
_FIXED = struct.Struct("<8s16sBBHQI")  # the header up to (not including) its own CRC
_CRC = struct.Struct("<I")
FIXED_BYTES = _FIXED.size + _CRC.size  # 44
MAX_HEADER_BYTES = FIXED_BYTES + MAX_KEY_BYTES
_KIND_BYTES, _KIND_INT = 0, 1


class FormatError(TieredKVError, ValueError):
    """A stored block is not a whole block of the expected namespace and key."""


def _key_bytes(key: Key) -> tuple[int, bytes]:
    key_name(key)  # refuses what a medium cannot name
    if key.__class__ is bytes:
        return _KIND_BYTES, key  # type: ignore[return-value]
    return _KIND_INT, key.to_bytes((key.bit_length() + 8) // 8 or 1, "little", signed=True)  # type: ignore[attr-defined]


def payload_crc(parts: Iterable[memoryview | bytes]) -> int:
    """CRC-32 of the concatenation of ``parts`` (the payload may be gathered from segments)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A decoded header.

    Attributes:
        namespace: The 16-byte namespace digest.
        key: The block's key.
        payload_bytes: Payload length.
        payload_crc: CRC-32 of the payload.
        size: Header length in bytes (where the payload starts).
    """

    namespace: bytes
    key: Key
    payload_bytes: int
    payload_crc: int
    size: int

    @staticmethod
    def encode(namespace: bytes, key: Key, payload_bytes: int, crc: int) -> bytes:
        """The header bytes for ``key``'s block of ``payload_bytes`` bytes whose CRC-32 is ``crc``."""
        kind, raw = _key_bytes(key)
        fixed = _FIXED.pack(MAGIC, namespace, kind, len(raw), 0, payload_bytes, crc)
        return fixed + _CRC.pack(zlib.crc32(raw, zlib.crc32(fixed))) + raw

    @staticmethod
    def decode(data: bytes | memoryview, namespace: bytes, key: Key, payload_bytes: int) -> BlockHeader:
        """Decode and check a header that should describe ``key``'s block in ``namespace``.

        ``data`` must hold at least the whole header (:data:`MAX_HEADER_BYTES`
        or the rest of the block); the payload CRC is checked by the caller
        once the payload is in memory.

        Raises:
            FormatError: Wrong magic, namespace, key or length, or a damaged header.
        """
        if len(data) < FIXED_BYTES:
            raise FormatError(f"block of key {key_name(key)}: {len(data)} bytes is shorter than a header")
        magic, ns, kind, klen, _, plen, crc = _FIXED.unpack_from(data, 0)
        if magic != MAGIC:
            raise FormatError(f"block of key {key_name(key)}: not a tiered_kv block (magic {bytes(magic)!r})")
        end = FIXED_BYTES + klen
        if len(data) < end:
            raise FormatError(f"block of key {key_name(key)}: header cut short")
        raw = bytes(data[FIXED_BYTES:end])
        (hcrc,) = _CRC.unpack_from(data, _FIXED.size)
        if hcrc != zlib.crc32(raw, zlib.crc32(data[: _FIXED.size])):
            raise FormatError(f"block of key {key_name(key)}: damaged header (CRC mismatch)")
        if ns != namespace:
            raise FormatError(f"block of key {key_name(key)}: namespace {bytes(ns).hex()} is not {namespace.hex()}")
        stored: Key = raw if kind == _KIND_BYTES else int.from_bytes(raw, "little", signed=True)
        if kind not in (_KIND_BYTES, _KIND_INT) or stored != key or stored.__class__ is not key.__class__:
            raise FormatError(f"block of key {key_name(key)}: header names another key")
        if plen != payload_bytes:
            raise FormatError(f"block of key {key_name(key)}: payload of {plen} bytes, expected {payload_bytes}")
        return BlockHeader(bytes(ns), stored, plen, crc, end)
