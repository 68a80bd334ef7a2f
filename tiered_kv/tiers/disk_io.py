"""Moves blocks between the CPU tier and block files, on a thread pool.

A store writes the header and the block's segments with one ``writev`` to a
temporary file in the block's shard directory, then renames it over the
block's name (``os.replace``: atomic within one file system).  A load reads
the header, checks it, reads the payload straight into the CPU slot with
``preadv`` and checks the payload's CRC there; a block that fails any check
is reported ``CORRUPT`` and its CPU slot must not be used (the caller fails
the CPU store of that key, so nothing can load the garbage).

**Durability (``fsync``)**, a trade of store bandwidth against what survives a
power loss; a process crash loses nothing written under any setting, because
the page cache outlives the process:

* ``"none"`` (default): no flush.  After a power loss a renamed file may hold
  stale or zero bytes; its checksum fails at load, it is counted and never
  served.  Right for a cache, whose contents can always be recomputed.
* ``"data"``: ``fdatasync`` before the rename, so a name never points at bytes
  that are not on the disk.
* ``"full"``: also ``fsync`` the shard directory after the rename, so the
  block itself survives a power loss.

Errors are per block: ``ENOSPC``/``EDQUOT``/``EFBIG`` are ``NO_SPACE``, a missing
file on load is ``MISSING``, a failed check is ``CORRUPT``, anything else
(``EACCES``, ``EIO``) is ``ERROR``.  A failed store leaves no file behind, not
even the temporary one.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from tiered_kv import checks
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tiers.block_format import MAX_HEADER_BYTES, BlockHeader, FormatError, payload_crc
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_engine import BlockIOEngine, FaultHook, Job, check_geometry, unique_suffix
from tiered_kv.tiers.io_handle import BlockOutcome

FSYNC_POLICIES = ("none", "data", "full")
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _writev_all(fd: int, bufs: list[memoryview | bytes]) -> None:
    """``writev`` until every byte is written (the kernel may write less than asked)."""
    views = [memoryview(b) for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _preadv_all(fd: int, bufs: list[memoryview], offset: int) -> bool:
    """``preadv`` into ``bufs`` from ``offset`` until they are full; False if the file ends first."""
    views = list(bufs)
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            return False
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return True


class DiskIO(BlockIOEngine):
    """The I/O engine of a :class:`DiskStore`.

    Args:
        host: The CPU tier's storage, or a raw buffer of chunks (see :class:`BlockIOEngine`).
        store: The disk store (paths, namespace, block size).
        fsync: ``"none"``, ``"data"`` or ``"full"`` (see the module docstring).
        load_workers, store_workers, batch_blocks, fault_hook: As :class:`BlockIOEngine`.
            The fault hook runs after a store has written the header to its
            temporary file (so an injected ``ENOSPC`` leaves a partial file to
            clean up, as a real one does) and after a load has opened the file.
    """

    def __init__(
        self,
        host: KVStorage | ChunkBuffer | memoryview | Any,
        store: DiskStore,
        fsync: str = "none",
        load_workers: int = 4,
        store_workers: int = 2,
        batch_blocks: int = 4,
        fault_hook: FaultHook | None = None,
    ) -> None:
        checks.instance("store", store, DiskStore)
        self.fsync = checks.choice("fsync", fsync, FSYNC_POLICIES)
        check_geometry(host, store.namespace, "disk")
        super().__init__(host, store, load_workers, store_workers, batch_blocks, fault_hook)
        self._disk = store
        self._ns = store.namespace.digest

    def _store_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        return [self._store_one(job) for job in batch]

    def _load_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        return [self._load_one(job) for job in batch]

    def _store_one(self, job: Job) -> BlockOutcome:
        path = self._disk.path_of(job.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{unique_suffix()}.tmp")
        segments = self.host.segments(job.host_block)
        header = BlockHeader.encode(self._ns, job.key, self.host.block_bytes, payload_crc(segments))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _writev_all(fd, [header])
                self._fault("store", job.key)
                _writev_all(fd, segments)
                if self.fsync != "none":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync == "full":
                dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return BlockOutcome.NO_SPACE if exc.errno in _FULL_ERRNOS else BlockOutcome.ERROR
        return BlockOutcome.OK

    def _load_one(self, job: Job) -> BlockOutcome:
        try:
            fd = os.open(self._disk.path_of(job.key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return BlockOutcome.MISSING
        except OSError:
            return BlockOutcome.ERROR
        try:
            self._fault("load", job.key)
            header = BlockHeader.decode(os.pread(fd, MAX_HEADER_BYTES, 0), self._ns, job.key, self.host.block_bytes)
            if os.fstat(fd).st_size != header.size + header.payload_bytes:
                return BlockOutcome.CORRUPT
            segments = self.host.segments(job.host_block)
            if not _preadv_all(fd, segments, header.size) or payload_crc(segments) != header.payload_crc:
                return BlockOutcome.CORRUPT
        except FormatError:
            return BlockOutcome.CORRUPT
        except OSError as exc:
            return BlockOutcome.MISSING if exc.errno == errno.ENOENT else BlockOutcome.ERROR
        finally:
            os.close(fd)
        return BlockOutcome.OK
