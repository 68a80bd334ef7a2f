"""A raw staging buffer for the I/O below the CPU tier: chunk ``i`` is row ``i`` of a byte region.

The tier I/O engines stage through the CPU tier's memory.  In tiered_kv's own
stack that memory is a :class:`~tiered_kv.storage.kv_storage.KVStorage` and a
block is gathered from its segments (:class:`~tiered_kv.tiers.io_engine.HostBlocks`).
A host that owns its CPU memory itself (vLLM's CPU offloading tier, whose
region is a shared ``mmap``) hands over only bytes: a two-dimensional
memoryview of ``num_chunks`` rows, or a CPU tensor of the same shape.  This
class exposes such a region with the same three facts an I/O engine reads
(``num_blocks``, ``block_bytes``, ``segments``), so the engines stay one
implementation for both hosts.

The chunk's bytes are opaque here: whatever layout the host writes is what
the medium stores and gives back, byte for byte.

**Slots.**  Every plan keeps id 0 for the null block (``TransferPlan.validate``
refuses it), while a host's chunk ids start at 0.  So CPU slot ``s`` of a plan
is row ``s - 1`` of the buffer: :meth:`ChunkBuffer.slot` turns a row into the slot
a plan names, and ``num_blocks`` is one more than the rows.
"""

from __future__ import annotations

import ctypes
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, StorageError

RAW_MEDIUM = "CPU"
"""The medium a raw buffer stands for in a plan: the CPU tier, like a CPU ``KVStorage``."""


class ChunkBuffer:
    """Writable byte views of the rows of a C-contiguous CPU buffer.

    Args:
        buffer: A memoryview (or any object exporting the buffer protocol) whose first
            dimension counts the chunks, or a CPU torch tensor of that shape.  A
            one-dimensional buffer needs ``chunk_bytes``.
        chunk_bytes: Bytes per chunk; for a buffer of two or more dimensions it must
            equal the size of one row, or be ``None`` (then it is that size).

    The views point into the buffer's memory; this object holds a reference to the
    buffer, and must not outlive the memory itself (an ``mmap`` closed underneath).

    Raises:
        StorageError: the buffer is read-only, not C-contiguous, not on the CPU, empty,
            or not a whole number of chunks of ``chunk_bytes``.
    """

    medium = RAW_MEDIUM

    def __init__(self, buffer: Any, chunk_bytes: int | None = None) -> None:
        if chunk_bytes is not None:
            checks.count("chunk_bytes", chunk_bytes, 1)
        self.buffer = buffer
        if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
            rows, nbytes, view = self._tensor_view(buffer)
        else:
            rows, nbytes, view = self._buffer_view(buffer)
        if nbytes == 0 or rows == 0:
            raise StorageError("a chunk buffer must hold at least one chunk, got an empty buffer")
        if rows == -1:  # one-dimensional: the chunk size decides the rows
            if chunk_bytes is None:
                raise StorageError(f"a one-dimensional chunk buffer of {nbytes} bytes needs chunk_bytes")
            row_bytes = chunk_bytes
        else:
            row_bytes = nbytes // rows
            if chunk_bytes is not None and chunk_bytes != row_bytes:
                raise StorageError(f"chunk_bytes={chunk_bytes} is not the buffer's row size ({row_bytes} bytes)")
        if nbytes % row_bytes:
            raise StorageError(f"a buffer of {nbytes} bytes is not a whole number of {row_bytes}-byte chunks")
        self.num_chunks = nbytes // row_bytes
        self.num_blocks = self.num_chunks + 1  # slot 0 is the null block of every plan
        self.block_bytes = row_bytes
        self._mv = view

    @staticmethod
    def _buffer_view(buffer: Any) -> tuple[int, int, memoryview]:
        try:
            mv = memoryview(buffer)
        except TypeError:
            raise StorageError(
                f"a chunk buffer must be a memoryview or a CPU tensor, got {checks.describe(buffer)}"
            ) from None
        if mv.readonly:
            raise StorageError("a chunk buffer must be writable (loads land in it), got a read-only buffer")
        if not mv.c_contiguous:
            raise StorageError(f"a chunk buffer must be C-contiguous, got shape {mv.shape} strides {mv.strides}")
        rows = mv.shape[0] if mv.ndim >= 2 else -1
        # cast("B") flattens a contiguous N-dimensional view to bytes, so row i is a plain byte range.
        return rows, mv.nbytes, mv.cast("B")

    @staticmethod
    def _tensor_view(tensor: Any) -> tuple[int, int, memoryview]:
        if tensor.device.type != "cpu":
            raise StorageError(f"a chunk buffer must be in CPU memory, got a tensor on {tensor.device}")
        if not tensor.is_contiguous():
            raise StorageError("a chunk buffer tensor must be contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        rows = tensor.shape[0] if tensor.dim() >= 2 else -1
        if nbytes == 0:
            return rows, 0, memoryview(b"")
        raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
        return rows, nbytes, memoryview(raw).cast("B")

    def release(self) -> None:
        """Release this object's views of the buffer.

        An owner that unmaps its memory (vLLM's shared region at shutdown) can do so
        only once no view of it is exported; after this, :meth:`segments` must not be called.
        """
        self._mv.release()

    @staticmethod
    def slot(row: int) -> int:
        """The CPU slot a plan names for ``row`` of the buffer (``row + 1``: slot 0 is the null block)."""
        return row + 1

    def row(self, row: int) -> memoryview:
        """Row ``row``'s bytes (a writable view into the buffer).

        Raises:
            InvalidArgumentError: ``row`` is not in ``[0, num_chunks)``.
        """
        checks.count("row", row, 0)
        if row >= self.num_chunks:
            raise InvalidArgumentError(f"row {row} is out of range [0, {self.num_chunks})")
        start = row * self.block_bytes
        return self._mv[start : start + self.block_bytes]

    def segments(self, block_id: int) -> list[memoryview]:
        """Slot ``block_id``'s bytes (row ``block_id - 1``) as one view: a raw chunk has no segments of its own."""
        start = (block_id - 1) * self.block_bytes
        return [self._mv[start : start + self.block_bytes]]

    def __repr__(self) -> str:
        return f"ChunkBuffer(num_chunks={self.num_chunks}, chunk_bytes={self.block_bytes})"
