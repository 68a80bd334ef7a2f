"""How one LMCache memory object lies in one fixed-size page: a self-describing header, then its bytes.

tiered_kv's page stores hold pages of one size, the size of a full LMCache chunk, but
LMCache's objects are not all full: the last chunk of a prompt holds fewer tokens, a
layer-wise object holds one layer, a narrowed binary object fewer bytes.  So every page
starts with a small header of its own that says what the object was (its memory format,
the shape and dtype of each of its tensor groups, the bytes it used and whether its size
was narrowed), and a get rebuilds an object of exactly that geometry around exactly those
bytes.  The store's own header and CRC-32 already guard the page as a whole; this header
is checked again on decode so that a page of another writer's making is a miss, never a
wrong object.

Layout (little-endian)::

    0   4s  magic b"TKVL"
    4   B   format version (1)
    5   B   LMCache MemoryFormat value
    6   B   number of tensor groups (1..MAX_GROUPS)
    7   B   flags (bit 0: the object's used size was narrowed below its shapes' size)
    8   Q   bytes used by the object's data
    16  per group: B dtype code (DTYPE_NAMES index), B number of dims (0..MAX_DIMS), then that many I
    ... zero padding up to HEADER_BYTES; the data starts at HEADER_BYTES; zero padding after it.

``DTYPE_NAMES`` is append-only: a code, once written to a medium, names that dtype forever.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from tiered_kv.errors import InvalidArgumentError

MAGIC = b"TKVL"
VERSION = 1
HEADER_BYTES = 256
"""Bytes before an object's data in a page; a multiple of every dtype's size, so the data stays aligned."""
MAX_GROUPS = 8
MAX_DIMS = 8
FLAG_NARROWED = 1

DTYPE_NAMES = (
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
_DTYPES: dict[int, torch.dtype] = {
    code: getattr(torch, name) for code, name in enumerate(DTYPE_NAMES) if hasattr(torch, name)
}
_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in _DTYPES.items()}

_FIXED = struct.Struct("<4sBBBBQ")
_GROUP = struct.Struct("<BB")


@dataclass(frozen=True, slots=True)
class ObjectLayout:
    """What a stored object was: enough to allocate an equal one and fill it with the stored bytes.

    Attributes:
        fmt: The value of the object's LMCache ``MemoryFormat``.
        shapes: The shape of each tensor group, in order.
        dtypes: The dtype of each tensor group, in order.
        used_bytes: Bytes of data the object holds (its ``get_size()``).
        narrowed: Whether ``used_bytes`` was set below the shapes' size (LMCache's ``set_used_size``).
    """

    fmt: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    used_bytes: int
    narrowed: bool

    @property
    def shapes_bytes(self) -> int:
        """Bytes the groups' shapes and dtypes make together."""
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))


def page_bytes_for(chunk_bytes: int) -> int:
    """The page size that holds any object of up to ``chunk_bytes`` bytes of data."""
    return HEADER_BYTES + chunk_bytes


def encodable(layout: ObjectLayout, capacity: int) -> str | None:
    """Why ``layout`` cannot be written into a page of ``capacity`` data bytes, or ``None`` when it can."""
    if not 1 <= len(layout.shapes) <= MAX_GROUPS or len(layout.shapes) != len(layout.dtypes):
        return f"{len(layout.shapes)} tensor groups (a page header holds 1..{MAX_GROUPS})"
    if not 0 <= layout.fmt <= 255:
        return f"memory format value {layout.fmt}"
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        if dtype not in _CODES:
            return f"dtype {dtype} (not one of {DTYPE_NAMES})"
        if len(shape) > MAX_DIMS or any(not 0 <= d < 1 << 32 for d in shape):
            return f"shape {tuple(shape)}"
    if layout.used_bytes > capacity:
        return f"{layout.used_bytes} bytes of data (a page holds {capacity})"
    if not layout.narrowed and layout.used_bytes != layout.shapes_bytes:
        return f"{layout.used_bytes} bytes of data for shapes of {layout.shapes_bytes}"
    return None


def encode(layout: ObjectLayout) -> bytes:
    """The header of a page holding an object of ``layout`` (exactly HEADER_BYTES bytes).

    Raises:
        InvalidArgumentError: the layout cannot be described (see :func:`encodable`; checked by the caller first).
    """
    parts = [
        _FIXED.pack(MAGIC, VERSION, layout.fmt, len(layout.shapes), FLAG_NARROWED * layout.narrowed, layout.used_bytes)
    ]
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        parts.append(_GROUP.pack(_CODES[dtype], len(shape)))
        parts.append(struct.pack(f"<{len(shape)}I", *shape))
    head = b"".join(parts)
    if len(head) > HEADER_BYTES:
        raise InvalidArgumentError(f"a page header of {len(head)} bytes does not fit in {HEADER_BYTES}")
    return head + bytes(HEADER_BYTES - len(head))


def decode(header: bytes | memoryview, capacity: int) -> ObjectLayout | None:
    """The layout a page's header describes, or ``None`` when it is not a header this format wrote.

    ``capacity`` is the page's data bytes: a header claiming more is refused, so a page can
    never make a get read past its end.
    """
    head = bytes(header[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        return None
    magic, version, fmt, groups, flags, used = _FIXED.unpack_from(head, 0)
    if magic != MAGIC or version != VERSION or not 1 <= groups <= MAX_GROUPS or flags & ~FLAG_NARROWED:
        return None
    at = _FIXED.size
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype] = []
    for _ in range(groups):
        code, ndim = _GROUP.unpack_from(head, at)
        at += _GROUP.size
        if code not in _DTYPES or ndim > MAX_DIMS or at + 4 * ndim > HEADER_BYTES:
            return None
        shapes.append(struct.unpack_from(f"<{ndim}I", head, at))
        at += 4 * ndim
        dtypes.append(_DTYPES[code])
    if any(head[at:]):
        return None
    layout = ObjectLayout(fmt, tuple(shapes), tuple(dtypes), used, bool(flags & FLAG_NARROWED))
    return layout if encodable(layout, capacity) is None else None
