"""Byte views of the CPU tier's blocks, for I/O that reads or writes them without a copy.

The CPU tier is the staging area of every tier below it: a block travels
between a file (or a Redis value) and its slot of the pinned CPU tensor.  File
reads and writes take Python buffers, so each block is exposed as memoryviews
over the tensor's memory, in the canonical segment order (layer 0 K, layer 0 V,
layer 1 K, ...): one view for a block-contiguous tier, ``2 * num_layers`` for a
layer-first one.
"""

from __future__ import annotations

import ctypes

from tiered_kv.errors import StorageError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets


class HostBlocks:
    """Memoryviews of the blocks of a CPU-resident :class:`KVStorage`.

    The views point into the tensor's memory, so this object keeps the
    storage alive; it must not outlive a ``close`` that frees the memory.

    Raises:
        StorageError: the storage is not in CPU memory.
    """

    def __init__(self, storage: KVStorage) -> None:
        if not isinstance(storage, KVStorage) or storage.kv.device.type != "cpu":
            raise StorageError(f"I/O below the CPU tier stages through a CPU KVStorage, got {storage!r}")
        self.storage = storage
        self.spec = storage.spec
        self.num_blocks = storage.num_blocks
        self.block_bytes = storage.spec.bytes_per_block
        raw = (ctypes.c_char * storage.nbytes).from_address(storage.kv.data_ptr())
        self._mv = memoryview(raw).cast("B")
        self._contiguous = storage.layout == "block_contiguous"

    def segments(self, block_id: int) -> list[memoryview]:
        """The block's bytes, as views in canonical order (they add up to ``block_bytes``)."""
        if self._contiguous:
            start = block_id * self.block_bytes
            return [self._mv[start : start + self.block_bytes]]
        seg = self.spec.segment_bytes
        offsets = segment_offsets(self.spec, self.storage.layout, self.num_blocks, block_id)
        return [self._mv[off : off + seg] for off in offsets]
