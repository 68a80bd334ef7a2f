"""The disk tier: one file per block, named by its key, under a directory per namespace.

Layout::

    <root>/<namespace dirname>/.lock            held (flock) by the one process that owns the directory
    <root>/<namespace dirname>/<ss>/<name>.kv   a block: header, key, payload (see block_format)
    <root>/<namespace dirname>/<ss>/.<name>.<pid>.<n>.tmp   a block being written

``<name>`` is :func:`~tiered_kv.tiers.namespace.key_name` of the key and
``<ss>`` one of 256 shard directories (the low byte of the name's CRC-32), so no
directory grows past a few thousand entries at realistic capacities.

**Writes are atomic.**  A block is written to a temporary name and renamed over
its final name once whole (:class:`~tiered_kv.tiers.disk_io.DiskIO`).  A crash
leaves at most a temporary file, which the next start deletes; it never leaves
a half-written file under a block's name.

**Restart.**  Building a store scans its directory.  Each block file's header is
read and checked *eagerly* (magic, namespace, key against the file name, and
file size against the header), so a store never indexes a torn, renamed or
foreign file; the payload's checksum is checked *lazily*, on every load,
because reading the whole tier at start-up would cost as much as the tier is
large.  A file that fails a check is ignored and counted, never loaded, and left
in place (it is overwritten if its key is stored again).  Valid files enter
the cache policy oldest first by modification time, so the policy's order
after a restart is the order in which blocks were written; if they exceed the
capacity, the oldest are evicted and deleted.

**Capacity** is given in bytes.  Every block file counts as its payload plus
the largest header, rounded up to 4 KiB (the file system's allocation unit),
so the tier holds ``capacity_bytes // slot_bytes`` blocks.

The store is bookkeeping plus file names; it deletes the files of entries that
leave it (evicted, removed, failed stores, forgotten corrupt blocks), which is
safe because an entry only leaves when no I/O touches it: pending and pinned
entries are never evicted or removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, StorageError
from tiered_kv.tiers.block_format import MAX_HEADER_BYTES, BlockHeader, FormatError
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import KVNamespace, key_name, parse_key_name
from tiered_kv.tiers.store import Key

ALLOCATION_BYTES = 4096
SUFFIX = ".kv"
SHARDS = frozenset(f"{i:02x}" for i in range(256))


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """What the start-up scan found, and what went wrong since (counters).

    Attributes:
        recovered: Valid block files indexed at start-up.
        invalid_files: Block-named files that failed a header or size check (ignored, never loaded).
        foreign_files: Files that are not named like a block (ignored).
        temp_files_removed: Temporary files of interrupted writes, deleted at start-up.
        unlink_errors: Files of departed entries that could not be deleted.
    """

    recovered: int = 0
    invalid_files: int = 0
    foreign_files: int = 0
    temp_files_removed: int = 0
    unlink_errors: int = 0


def shard_of(name: str) -> str:
    """The shard directory of a block name."""
    return f"{zlib.crc32(name.encode()) & 0xFF:02x}"


class DiskStore(KeyedStore):
    """A :class:`~tiered_kv.tiers.cpu_store.CPUStore` of block files in a local directory.

    Args:
        root: The directory that holds one subdirectory per namespace (created if missing).
        namespace: What the stored KV is compatible with.
        capacity_bytes: Bytes of disk the tier may use (see the module docstring).
        policy: Cache policy name (``"lru"`` or ``"arc"``).
        enable_events: Queue store/remove events (the blocks found at start-up are announced too).

    Raises:
        StorageError: the directory cannot be created or is in use by another store.
        InvalidArgumentError: a bad argument (a capacity below one block).
    """

    medium = "DISK"

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: KVNamespace,
        capacity_bytes: int,
        policy: str = "lru",
        enable_events: bool = False,
    ) -> None:
        checks.instance("root", root, (str, os.PathLike))
        checks.instance("namespace", namespace, KVNamespace)
        checks.count("capacity_bytes", capacity_bytes, 1)
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.slot_bytes = -(-(MAX_HEADER_BYTES + self.block_bytes) // ALLOCATION_BYTES) * ALLOCATION_BYTES
        if capacity_bytes < self.slot_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes must hold at least one block file ({self.slot_bytes} bytes), got {capacity_bytes}"
            )
        super().__init__(capacity_bytes // self.slot_bytes + 1, policy=policy, enable_events=enable_events)
        self.directory = Path(root) / namespace.dirname
        self._lock_fd = -1
        self._lock_fd = self._claim_directory()
        self._stats = DiskStoreStats()
        try:
            self._scan()
        except BaseException:
            self.close()
            raise

    def _claim_directory(self) -> int:
        try:
            for shard in range(256):
                (self.directory / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"disk tier: cannot use directory {self.directory}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StorageError(f"disk tier: directory {self.directory} is in use by another store") from None
            raise StorageError(f"disk tier: cannot lock {self.directory}: {exc}") from exc
        return fd

    def close(self) -> None:
        """Release the directory (the files stay, for the next start)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ paths
    def path_of(self, key: Key) -> Path:
        """Where ``key``'s block file is (whether or not it exists)."""
        name = key_name(key)
        return self.directory / shard_of(name) / f"{name}{SUFFIX}"

    @property
    def disk_stats(self) -> DiskStoreStats:
        """Start-up scan results and file errors (the hit/query counters are :attr:`stats`)."""
        return self._stats

    @property
    def capacity_bytes(self) -> int:
        """Bytes the tier's capacity accounts for: ``capacity * slot_bytes``."""
        return self.capacity * self.slot_bytes

    # ------------------------------------------------------------ restart
    def _scan(self) -> None:
        found: list[tuple[float, str, Key]] = []
        invalid = foreign = temps = 0
        for shard in sorted(os.listdir(self.directory)):
            shard_dir = self.directory / shard
            if shard not in SHARDS or not shard_dir.is_dir():
                foreign += shard != ".lock"
                continue
            for entry in os.scandir(shard_dir):
                name = entry.name
                if name.startswith(".") and name.endswith(".tmp"):
                    try:
                        os.unlink(entry.path)
                        temps += 1
                    except OSError:
                        self._count(unlink_errors=1)
                    continue
                key = parse_key_name(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None
                if key is None or not entry.is_file(follow_symlinks=False) or shard_of(key_name(key)) != shard:
                    foreign += 1
                elif self._valid(entry.path, key):
                    found.append((entry.stat().st_mtime, name, key))
                else:
                    invalid += 1
        found.sort(key=lambda f: (f[0], f[1]))
        for _, _, key in found:  # oldest first: a capacity overflow evicts (and deletes) the oldest
            self.prepare_store([key])
            self.complete_store([key])
        self._stats = replace(
            self._stats, recovered=self.num_used, invalid_files=invalid, foreign_files=foreign, temp_files_removed=temps
        )

    def _valid(self, path: str, key: Key) -> bool:
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(MAX_HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
            header = BlockHeader.decode(head, self.namespace.digest, key, self.block_bytes)
        except (OSError, FormatError):
            return False
        return size == header.size + header.payload_bytes

    # ------------------------------------------------------------ files of departed entries
    def _unlink(self, keys: Sequence[Key]) -> None:
        errors = 0
        for key in keys:
            try:
                os.unlink(self.path_of(key))
            except FileNotFoundError:
                pass
            except OSError:
                errors += 1
        if errors:
            self._count(unlink_errors=errors)

    def _count(self, unlink_errors: int = 0) -> None:
        self._stats = replace(self._stats, unlink_errors=self._stats.unlink_errors + unlink_errors)

    def _on_evicted(self, keys: list[Key]) -> None:
        self._unlink(keys)

    def _on_removed(self, keys: Sequence[Key]) -> None:
        self._unlink(keys)

    def _on_store_failed(self, keys: list[Key]) -> None:
        self._unlink(keys)  # a block that landed before its plan was cancelled

    def _on_forgotten(self, keys: list[Key]) -> None:
        self._unlink(keys)
