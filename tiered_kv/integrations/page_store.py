"""tiered_kv's disk and Redis stores as a plain map from a key to one page of bytes, for engines' storage plug-ins.

SGLang's HiCache storage backends and LMCache's storage plug-ins both ask a
medium for the same thing: put these pages under these keys, tell me which keys
you hold, give me these pages back.  Neither hands the medium block slots or a
plan.  This module is that interface over tiered_kv's own stores, so each
engine's adapter is only a translation of its calls:

* :class:`PageStore`: one medium (a :class:`~tiered_kv.tiers.disk_store.DiskStore`
  with its :class:`~tiered_kv.tiers.disk_io.DiskIO`, or a
  :class:`~tiered_kv.tiers.redis_store.RedisStore` with its
  :class:`~tiered_kv.tiers.redis_io.RedisIO`), staging every page through a
  private buffer (a :class:`~tiered_kv.tiers.chunk_buffer.ChunkBuffer`).
* :class:`ChainedPageStore`: several of them in order (a local disk, then a
  shared Redis), written through and read from the highest tier that has a page.
* :func:`open_page_store`: either, from a configuration mapping an engine's
  configuration file carries.

What holds, because the stores underneath hold it: a page is written to a
temporary name and renamed whole (disk) or set in one command (Redis); every
stored page carries a header with the namespace, its key and a CRC-32 of the
payload, checked on every read; a corrupt or vanished page is a miss and is
forgotten; a Redis server that is down or dies in the middle of a call is a miss
(or a failed put), never an exception.  And because every page is staged:

* **no torn reads**: a page is read into the staging buffer, checked there, and
  only then copied into the caller's buffer, so a miss leaves the caller's
  buffer exactly as it was;
* **byte exactness**: what a put was given is what a get copies back, byte for
  byte, whatever the dtype or shape of the tensor it came from.

Keys: ``bytes`` of 1..64 and ``int`` name a page as they are (a file name, a
Redis key); a ``str`` (an engine's hex hash, a key's string form) is mapped to
its 32-byte BLAKE2b digest, so any engine key fits a file name.

Threads: every method may be called from any thread.  The store's bookkeeping
is touched under one lock; the I/O of a call runs outside it, on the rows of the
staging buffer that the call took, so a long put does not hold up a get.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.disk_io import FSYNC_POLICIES, DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_engine import BlockIOEngine, FaultHook
from tiered_kv.tiers.io_handle import BlockIOHandle, BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import MAX_KEY_BYTES, ChunkGeometry, KVNamespace
from tiered_kv.tiers.policies.factory import CACHE_POLICIES
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore, connect
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import TransferPlan

PageKey = str | bytes | int
"""A page's name as an engine gives it (see the module docstring for how each kind is stored)."""

DEFAULT_STAGING_BYTES = 64 << 20
"""Bytes of staging buffer a store keeps by default (at least one page): what one call moves at a time."""


def page_key(key: object) -> Key:
    """The key a medium stores ``key`` under: ``bytes`` and ``int`` as they are, a ``str`` as its BLAKE2b-256.

    Raises:
        InvalidArgumentError: ``key`` is none of those, an empty or over-long ``bytes``, or a ``bool``.
    """
    cls = key.__class__
    if cls is str:
        return hashlib.blake2b(key.encode(), digest_size=32).digest()  # type: ignore[attr-defined]
    if cls is bytes and 0 < len(key) <= MAX_KEY_BYTES:  # type: ignore[arg-type]
        return key  # type: ignore[return-value]
    if cls is int:
        return key  # type: ignore[return-value]
    raise InvalidArgumentError(
        f"a page key must be a str, bytes of 1..{MAX_KEY_BYTES} or an int, got {checks.describe(key)}"
    )


def leading(flags: Sequence[bool]) -> int:
    """How many of ``flags``, from the first, are true (a present prefix's length)."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def page_view(obj: Any, page_bytes: int, what: str, writable: bool) -> memoryview:
    """``obj``'s bytes as one flat view: a contiguous CPU tensor (any dtype) or a buffer-protocol object.

    Raises:
        InvalidArgumentError: not one of those, not C-contiguous, not on the CPU, read-only where
            ``writable``, or not exactly ``page_bytes`` bytes.
    """
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if obj.device.type != "cpu":
            raise InvalidArgumentError(f"{what} must be in CPU memory, got a tensor on {obj.device}")
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} must be a contiguous tensor")
        nbytes = obj.numel() * obj.element_size()
        if nbytes != page_bytes:
            raise InvalidArgumentError(f"{what} holds {nbytes} bytes, a page is {page_bytes}")
        return memoryview((ctypes.c_char * nbytes).from_address(obj.data_ptr())).cast("B")
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a CPU tensor or a buffer, got {checks.describe(obj)}") from None
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgumentError(f"{what} must be writable (a page is copied into it)")
    if view.nbytes != page_bytes:
        raise InvalidArgumentError(f"{what} holds {view.nbytes} bytes, a page is {page_bytes}")
    return view.cast("B")


@dataclass(slots=True)
class PageStoreStats:
    """Counters since the store was opened (pages, unless the name says bytes).

    Attributes:
        puts: Pages offered to :meth:`PageStore.put`.
        stored: Pages written whole (a page already held counts in ``puts`` only).
        gets: Pages asked of :meth:`PageStore.get`.
        hits: Pages copied into the caller's buffer.
        misses: Pages asked for and not given (absent, evicted, corrupt, a medium error).
        corrupt: Pages whose bytes failed a check or had vanished (then forgotten).
        bytes_in: Bytes written to the medium.
        bytes_out: Bytes given back to callers.
        evicted: Pages evicted to make room.
        num_pages: Pages held now (ready or being written).
        capacity_pages: Pages the store can hold.
    """

    puts: int = 0
    stored: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evicted: int = 0
    num_pages: int = 0
    capacity_pages: int = 0


class PageStore:
    """A thread-safe map from key to one page of exactly ``page_bytes`` bytes, over one tiered_kv medium.

    Build one with :meth:`open_disk`, :meth:`open_redis` or :func:`open_page_store`.

    Args:
        store: The medium's bookkeeping (a :class:`DiskStore` or a :class:`RedisStore`).
        io: The I/O engine over ``store``, staging through ``buffer``.
        buffer: The staging buffer: ``io``'s host, of pages of ``store``'s namespace.
        kind: ``"disk"`` or ``"redis"``.

    Invariants: the store is touched only under the lock; a staging row belongs to
    at most one call at a time, from its reservation until its page is copied out;
    every page a call reserved in the store is completed (stored or dropped, loaded
    and unpinned) before the call returns, so between calls nothing is pending or pinned.
    """

    def __init__(self, store: KeyedStore, io: BlockIOEngine, buffer: ChunkBuffer, kind: str) -> None:
        self.store, self.io, self.buffer, self.kind = store, io, buffer, kind
        self.page_bytes = buffer.block_bytes
        self.namespace: KVNamespace = store.namespace  # type: ignore[attr-defined]
        self._lock = threading.Condition()
        self._free_rows = list(range(buffer.num_chunks))
        self._plan_ids = iter(range(1, 1 << 62))
        self._stats = PageStoreStats()
        self._holds: dict[Key, int] = {}
        self._closed = False

    # ------------------------------------------------------------ building
    @classmethod
    def open_disk(
        cls,
        root: str,
        capacity_bytes: int,
        namespace: KVNamespace,
        *,
        fsync: str = "none",
        policy: str = "lru",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        load_workers: int = 4,
        store_workers: int = 2,
        fault_hook: FaultHook | None = None,
    ) -> PageStore:
        """A page store of one file per page under ``<root>/<namespace>/`` (:class:`DiskStore`).

        Raises:
            TieredKVError: a bad argument, or a directory that cannot be used; nothing is left open.
        """
        buffer = _staging(namespace.block_bytes, staging_bytes)
        store = DiskStore(root, namespace, capacity_bytes, policy=policy)
        try:
            io = DiskIO(buffer, store, fsync, load_workers, store_workers, fault_hook=fault_hook)
        except BaseException:
            store.close()
            raise
        return cls(store, io, buffer, "disk")

    @classmethod
    def open_redis(
        cls,
        url: str,
        namespace: KVNamespace,
        *,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        index_blocks: int = 65536,
        policy: str = "lru",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        load_workers: int = 4,
        store_workers: int = 2,
        fault_hook: FaultHook | None = None,
    ) -> PageStore:
        """A page store on a Redis or Valkey server shared by every process of the namespace (:class:`RedisStore`).

        The server need not be up: while it is down every get misses and every put fails.

        Raises:
            TieredKVError: a bad argument (nothing is left open).
        """
        buffer = _staging(namespace.block_bytes, staging_bytes)
        store = RedisStore(connect(url, timeout_s), namespace, index_blocks=index_blocks, ttl_s=ttl_s, policy=policy)
        io = RedisIO(buffer, store, load_workers=load_workers, store_workers=store_workers, fault_hook=fault_hook)
        return cls(store, io, buffer, "redis")

    # ------------------------------------------------------------ queries
    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        """Per key, whether a get would find the page now (a page being written is not there yet).

        A Redis store asks the server in one round trip, so it sees what other processes stored;
        a server that is down answers False for every key.
        """
        ks = self._keys(keys)
        with self._lock:
            self._check_open()
            if isinstance(self.store, RedisStore):
                return self.store.probe(ks)
            return [self.store.is_ready(k) for k in ks]

    def prefix_hits(self, keys: Sequence[PageKey]) -> int:
        """How many of ``keys``, from the first, a get would find (the length of the present prefix)."""
        return leading(self.exists(keys))

    # ------------------------------------------------------------ put
    def put(self, keys: Sequence[PageKey], pages: Sequence[Any]) -> list[bool]:
        """Store each page under its key; per key, whether the page is now held whole and checked.

        A key already held counts True and is not written again (a page's bytes are a function
        of its key).  False: not stored (no room that is not being read or written, a medium
        error, a server down); nothing of that page is left behind.  A key given twice is
        stored once, from its first page.

        Raises:
            InvalidArgumentError: ``keys`` and ``pages`` differ in length, a key is not a
                :data:`PageKey`, or a page is not exactly ``page_bytes`` of CPU memory; then
                nothing was stored.
        """
        ks = self._keys(keys)
        if len(pages) != len(ks):
            raise InvalidArgumentError(f"put() got {len(ks)} keys and {len(pages)} pages")
        views = [page_view(p, self.page_bytes, f"pages[{i}]", writable=False) for i, p in enumerate(pages)]
        first: dict[Key, memoryview] = {}
        for k, v in zip(ks, views, strict=True):
            first.setdefault(k, v)
        done: dict[Key, bool] = {}
        todo = list(first)
        with self._lock:
            self._check_open()
            self._stats.puts += len(ks)
        while todo:
            rows = self._take_rows(len(todo))
            batch, todo = todo[: len(rows)], todo[len(rows) :]
            done.update(self._put_batch(batch, [first[k] for k in batch], rows))
        return [done[k] for k in ks]

    def _put_batch(self, keys: list[Key], views: list[memoryview], rows: list[int]) -> dict[Key, bool]:
        with self._lock:
            todo: list[Key] = []
            slots: list[int] = []
            # All at once, or else key by key (first keys first) when not all of them fit.
            for group in [keys] if len(keys) == 1 else [keys, *([k] for k in keys)]:
                out = self._prepare_store(group)
                if out is not None:
                    todo += out.keys_to_store
                    slots += out.store_spec.block_ids
                    if group is keys:
                        break
        source = dict(zip(keys, views, strict=True))
        for row, key in zip(rows, todo, strict=False):
            self.buffer.row(row)[:] = source[key]
        staged = [ChunkBuffer.slot(r) for r in rows[: len(todo)]]
        handle = self._run(self.buffer.medium, self.store.medium, staged, slots)
        with self._lock:
            landed = set(handle.landed_keys()) if handle is not None else set()
            self.store.complete_store([k for k in todo if k in landed], True)
            self.store.complete_store([k for k in todo if k not in landed], False)
            self._stats.stored += len(landed)
            self._stats.bytes_in += len(landed) * self.page_bytes
            self._free(rows)
            return {k: self.store.is_ready(k) for k in keys}

    def _prepare_store(self, keys: list[Key]) -> Any:
        try:
            out = self.store.prepare_store(keys)
        except TieredKVError:  # a medium that refuses the reservation: nothing was reserved
            return None
        if out is not None:
            self._stats.evicted += len(out.evicted_keys)
        return out

    # ------------------------------------------------------------ get
    def get(self, keys: Sequence[PageKey], outs: Sequence[Any]) -> list[bool]:
        """Copy each held page into its buffer; per key, whether it was copied (byte-exact, checked).

        False is a miss: the page is absent, was evicted, failed its checks (it is forgotten),
        or the medium failed; that buffer is left exactly as it was.

        Raises:
            InvalidArgumentError: ``keys`` and ``outs`` differ in length, a key is not a
                :data:`PageKey`, or a buffer is not exactly ``page_bytes`` of writable CPU
                memory; then no buffer was written.
        """
        ks = self._keys(keys)
        if len(outs) != len(ks):
            raise InvalidArgumentError(f"get() got {len(ks)} keys and {len(outs)} buffers")
        views = [page_view(o, self.page_bytes, f"outs[{i}]", writable=True) for i, o in enumerate(outs)]
        with self._lock:
            self._check_open()
            self._stats.gets += len(ks)
        hit: list[bool] = []
        todo = list(range(len(ks)))
        while todo:
            rows = self._take_rows(len(todo))
            batch, todo = todo[: len(rows)], todo[len(rows) :]
            hit += self._get_batch([ks[i] for i in batch], [views[i] for i in batch], rows)
        with self._lock:
            n = sum(hit)
            self._stats.hits += n
            self._stats.misses += len(hit) - n
            self._stats.bytes_out += n * self.page_bytes
        return hit

    def _get_batch(self, keys: list[Key], views: list[memoryview], rows: list[int]) -> list[bool]:
        with self._lock:
            store = self.store
            unique = list(dict.fromkeys(keys))
            if isinstance(store, RedisStore):
                store.probe(unique)  # index what other processes stored, and drop what expired
            ready = [k for k in unique if store.is_ready(k)]
            slots = list(store.prepare_load(ready).block_ids) if ready else []
            if ready:
                store.touch(ready)  # a read makes a page recent, as vLLM's managers touch what they load
        row_of = dict(zip(ready, rows, strict=False))
        handle = self._run(store.medium, self.buffer.medium, slots, [ChunkBuffer.slot(row_of[k]) for k in ready])
        landed = set(handle.landed_keys()) if handle is not None else set()
        hit = [k in landed for k in keys]
        for view, key, ok in zip(views, keys, hit, strict=True):
            if ok:  # checked in the staging row; only now does the caller's buffer change
                view[:] = self.buffer.row(row_of[key])
        with self._lock:
            if ready:
                store.complete_load(ready)
            if handle is not None:
                bad = handle.keys_with(BlockOutcome.MISSING, BlockOutcome.CORRUPT)
                if bad:
                    self._stats.corrupt += len(bad)
                    store.forget(bad)
            self._free(rows)
        return hit

    # ------------------------------------------------------------ holds
    def hold(self, keys: Sequence[PageKey]) -> list[bool]:
        """Hold each present page against eviction until :meth:`release`; per key, whether it is held now.

        An engine that promised a page to a coming read (LMCache's ``pin``) holds it, so
        that puts filling the store cannot evict it first.  A held page still goes when it
        is removed, once its last hold is released.  A page absent or being written is not held.
        """
        ks = self._keys(keys)
        with self._lock:
            self._check_open()
            store = self.store
            if isinstance(store, RedisStore):
                store.probe(list(dict.fromkeys(ks)))
            held = []
            for k in ks:
                ok = store.is_ready(k)
                if ok:
                    store.prepare_load([k])  # a hold is a pin, as a read in flight is
                    self._holds[k] = self._holds.get(k, 0) + 1
                held.append(ok)
            return held

    def release(self, keys: Sequence[PageKey]) -> None:
        """Release one hold per key given (a key given twice releases two).

        Raises:
            InvalidArgumentError: a key has fewer holds than it is given; nothing is released.
        """
        ks = self._keys(keys)
        with self._lock:
            want: dict[Key, int] = {}
            for k in ks:
                want[k] = want.get(k, 0) + 1
            for k, n in want.items():
                if self._holds.get(k, 0) < n:
                    raise InvalidArgumentError(f"cannot release {n} hold(s) of {k!r}: it has {self._holds.get(k, 0)}")
            for k, n in want.items():
                self.store.complete_load([k] * n)
                left = self._holds[k] - n
                if left:
                    self._holds[k] = left
                else:
                    del self._holds[k]

    def num_holds(self, key: PageKey) -> int:
        """How many holds ``key``'s page has."""
        k = page_key(key)
        with self._lock:
            return self._holds.get(k, 0)

    # ------------------------------------------------------------ removal
    def remove(self, keys: Sequence[PageKey]) -> None:
        """Drop the pages of ``keys`` (from the server too, for Redis); absent keys are ignored.

        A page that a get is reading now is dropped when that read ends; one being written now is kept.
        """
        ks = list(dict.fromkeys(self._keys(keys)))
        with self._lock:
            self._check_open()
            store = self.store
            if isinstance(store, RedisStore):
                store.probe(ks)  # learn the pages other processes stored, so they are deleted too
            idle = [k for k in ks if store.is_ready(k) and not store.num_loads(k)]
            busy = [k for k in ks if store.is_ready(k) and store.num_loads(k)]
            if idle:
                store.remove(idle)
            if busy:
                store.forget(busy)

    def clear(self) -> None:
        """Drop every page of this namespace this store can name (for Redis, every server key of the namespace)."""
        with self._lock:
            self._check_open()
            self.remove([e.key for e in self.store.entries()])  # type: ignore[misc]
            store = self.store
            if isinstance(store, RedisStore) and store.health.available():
                try:
                    names = list(store.client.scan_iter(match=f"{self.namespace.redis_prefix}*", count=1000))
                    if names:
                        store.client.delete(*names)
                except store.server_errors as exc:
                    store.health.failure(exc)

    # ------------------------------------------------------------ life
    def stats(self) -> PageStoreStats:
        """A copy of the counters, with the store's size now."""
        with self._lock:
            s = self._stats
            size = {"num_pages": self.store.num_used, "capacity_pages": self.store.num_blocks - 1}
            return PageStoreStats(
                s.puts, s.stored, s.gets, s.hits, s.misses, s.corrupt, s.bytes_in, s.bytes_out, s.evicted, **size
            )

    def close(self) -> None:
        """Wait for the I/O in flight, stop the engine's threads and release the medium; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.io.close()
        if isinstance(self.store, DiskStore):
            self.store.close()
        self.buffer.release()

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PageStore(kind={self.kind!r}, page_bytes={self.page_bytes}, store={self.store!r})"

    # ------------------------------------------------------------ plumbing
    def _keys(self, keys: Sequence[PageKey]) -> list[Key]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(f"keys must be a sequence of page keys, got {checks.describe(keys)}")
        return [page_key(k) for k in keys]

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"the {self.kind} page store is closed")

    def _take_rows(self, want: int) -> list[int]:
        """Up to ``want`` staging rows, at least one, waiting while other calls hold them all."""
        with self._lock:
            while not self._free_rows:
                self._lock.wait()
            n = min(want, len(self._free_rows))
            rows, self._free_rows = self._free_rows[:n], self._free_rows[n:]
            return rows

    def _free(self, rows: list[int]) -> None:
        self._free_rows.extend(rows)
        self._lock.notify_all()

    def _run(self, src: str, dst: str, src_ids: list[int], dst_ids: list[int]) -> BlockIOHandle | None:
        """Submit one plan and wait for it (outside the lock); ``None`` when there is nothing to move."""
        if not src_ids:
            return None
        with self._lock:
            plan = TransferPlan(next(self._plan_ids), src, dst, tuple(src_ids), tuple(dst_ids))
            handle = self.io.submit(plan)
        handle.wait()
        return handle


def _staging(page_bytes: int, staging_bytes: int) -> ChunkBuffer:
    checks.count("staging_bytes", staging_bytes, 1)
    rows = max(1, staging_bytes // page_bytes)
    return ChunkBuffer(memoryview(bytearray(rows * page_bytes)), chunk_bytes=page_bytes)


class ChainedPageStore:
    """Page stores in order, highest first (a local disk, then a shared Redis), used as one.

    * :meth:`put` writes through to every tier; a key is True where at least one tier holds it.
    * :meth:`get` reads each page from the highest tier that has it and copies a page found
      lower into every tier above (promotion), so the next read is local.
    * :meth:`exists` and :meth:`prefix_hits`: a key counts if any tier holds it.

    Invariant: the tiers share one ``page_bytes`` and one namespace, so a page promoted from
    one tier to another is the same bytes under the same key.

    Raises:
        InvalidArgumentError: fewer than two tiers, or tiers of different page sizes or namespaces.
    """

    kind = "chain"

    def __init__(self, tiers: Sequence[PageStore]) -> None:
        if len(tiers) < 2 or not all(isinstance(t, PageStore) for t in tiers):
            raise InvalidArgumentError(f"a chain needs two or more PageStores, got {checks.describe(tiers)}")
        if len({(t.page_bytes, t.namespace) for t in tiers}) != 1:
            raise InvalidArgumentError("the tiers of a chain must share one page size and one namespace")
        self.tiers = list(tiers)
        self.page_bytes = tiers[0].page_bytes
        self.namespace = tiers[0].namespace
        self._lock = threading.Lock()
        self._holds: dict[Key, list[tuple[int, ...]]] = {}  # per key, the tiers of each hold, last first out

    def exists(self, keys: Sequence[PageKey]) -> list[bool]:
        """Per key, whether some tier would give the page now."""
        answer = [False] * len(keys)
        for tier in self.tiers:
            ask = [i for i, a in enumerate(answer) if not a]
            if not ask:
                break
            for i, present in zip(ask, tier.exists([keys[i] for i in ask]), strict=True):
                answer[i] = present
        return answer

    def prefix_hits(self, keys: Sequence[PageKey]) -> int:
        """How many of ``keys``, from the first, some tier holds."""
        return leading(self.exists(keys))

    def put(self, keys: Sequence[PageKey], pages: Sequence[Any]) -> list[bool]:
        """Store each page in every tier; per key, whether at least one tier now holds it."""
        held = [False] * len(keys)
        for tier in self.tiers:
            held = [h or ok for h, ok in zip(held, tier.put(keys, pages), strict=True)]
        return held

    def get(self, keys: Sequence[PageKey], outs: Sequence[Any]) -> list[bool]:
        """Copy each page from the highest tier that has it; pages found below the first tier move up."""
        hit = [False] * len(keys)
        for depth, tier in enumerate(self.tiers):
            ask = [i for i, h in enumerate(hit) if not h]
            if not ask:
                break
            got = tier.get([keys[i] for i in ask], [outs[i] for i in ask])
            found = [i for i, ok in zip(ask, got, strict=True) if ok]
            for i in found:
                hit[i] = True
            for upper in self.tiers[:depth]:
                if found:  # a failed promotion only costs the next read a trip down
                    upper.put([keys[i] for i in found], [outs[i] for i in found])
        return hit

    def hold(self, keys: Sequence[PageKey]) -> list[bool]:
        """Hold each page in every tier that has it; per key, whether some tier holds it now."""
        per_tier = [tier.hold(keys) for tier in self.tiers]
        with self._lock:
            for i, key in enumerate(keys):
                where = tuple(t for t, held in enumerate(per_tier) if held[i])
                if where:
                    self._holds.setdefault(page_key(key), []).append(where)
        return [any(held[i] for held in per_tier) for i in range(len(keys))]

    def release(self, keys: Sequence[PageKey]) -> None:
        """Release one hold per key given, in exactly the tiers that hold made.

        Raises:
            InvalidArgumentError: a key has fewer holds than it is given; nothing is released.
        """
        ks = [page_key(k) for k in keys]
        with self._lock:
            for k in set(ks):
                if len(self._holds.get(k, ())) < ks.count(k):
                    raise InvalidArgumentError(f"cannot release {ks.count(k)} hold(s) of {k!r}: it has fewer")
            for k in ks:
                for t in self._holds[k].pop():
                    self.tiers[t].release([k])
                if not self._holds[k]:
                    del self._holds[k]

    def num_holds(self, key: PageKey) -> int:
        """How many holds made through the chain ``key``'s page has."""
        with self._lock:
            return len(self._holds.get(page_key(key), ()))

    def remove(self, keys: Sequence[PageKey]) -> None:
        """Drop the pages from every tier."""
        for tier in self.tiers:
            tier.remove(keys)

    def clear(self) -> None:
        """Drop every page of the namespace from every tier."""
        for tier in self.tiers:
            tier.clear()

    def stats(self) -> list[PageStoreStats]:
        """Each tier's counters, highest tier first."""
        return [tier.stats() for tier in self.tiers]

    def close(self) -> None:
        """Close every tier; idempotent."""
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> ChainedPageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[PageStore]:
        return iter(self.tiers)


_TIER_KEYS = {
    "disk": ({"root", "capacity_bytes"}, {"fsync", "load_workers", "store_workers"}),
    "redis": ({"url"}, {"timeout_s", "ttl_s", "index_blocks", "load_workers", "store_workers"}),
}
STORE_CONFIG_KEYS = frozenset({"tiers", "policy", "staging_bytes"})
"""The top-level keys of a page store configuration (:func:`open_page_store`)."""


def check_page_store_config(config: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Check a page store configuration without opening anything; return each tier's (kind, arguments).

    An engine that builds its backend before it knows the page size (SGLang registers
    its host pool later) calls this at construction, so a bad configuration fails there
    and creates nothing; :func:`open_page_store` runs the same checks.

    Raises:
        InvalidArgumentError: an unknown or missing key, or a bad value.
    """
    if not isinstance(config, Mapping):
        raise InvalidArgumentError(f"a page store config must be a mapping, got {checks.describe(config)}")
    unknown = set(config) - STORE_CONFIG_KEYS
    if unknown:
        raise InvalidArgumentError(
            f"unknown page store config keys {sorted(unknown)} (known: {sorted(STORE_CONFIG_KEYS)})"
        )
    tiers = config.get("tiers")
    if not isinstance(tiers, Sequence) or isinstance(tiers, (str, bytes)) or not tiers:
        raise InvalidArgumentError(f"a page store config needs a non-empty list 'tiers', got {checks.describe(tiers)}")
    policy = config.get("policy", "lru")
    if policy not in CACHE_POLICIES:
        raise InvalidArgumentError(f"'policy' must be one of {sorted(CACHE_POLICIES)}, got {checks.describe(policy)}")
    if "staging_bytes" in config:
        _whole(config["staging_bytes"], "staging_bytes")
    return [_tier_args(i, t) for i, t in enumerate(tiers)]


def open_page_store(
    config: Mapping[str, Any],
    *,
    page_bytes: int,
    model: str,
    layout: str,
    hash_scheme: str = "sha256",
    fault_hook: FaultHook | None = None,
) -> PageStore | ChainedPageStore:
    """Open the page store a configuration describes: one tier, or a chain of them in the order given.

    ``config`` is what an engine's storage configuration carries::

        {"tiers": [{"type": "disk", "root": "/mnt/nvme/kv", "capacity_bytes": 200e9},
                   {"type": "redis", "url": "redis://kv-cache:6379/0", "ttl_s": 3600}],
         "policy": "lru"}

    Disk keys: ``root``, ``capacity_bytes`` (required), ``fsync``, ``load_workers``,
    ``store_workers``.  Redis keys: ``url`` (required), ``timeout_s``, ``ttl_s``,
    ``index_blocks``, ``load_workers``, ``store_workers``.  Top level: ``tiers``
    (required), ``policy`` (``"lru"`` or ``"arc"``), ``staging_bytes`` (per tier).

    ``model``, ``layout`` (how the engine lays out a page's bytes: dtype, geometry,
    tensor-parallel rank), ``hash_scheme`` and ``page_bytes`` make the namespace:
    only a process with equal values reads these pages.

    Raises:
        InvalidArgumentError: an unknown or missing key, a bad value; nothing is opened
            (a tier opened before a later one failed is closed again).
    """
    entries = check_page_store_config(config)
    checks.count("page_bytes", page_bytes, 1)
    namespace = KVNamespace(model, ChunkGeometry(page_bytes, layout), hash_scheme)
    common: dict[str, Any] = {"policy": config.get("policy", "lru"), "fault_hook": fault_hook}
    if "staging_bytes" in config:
        common["staging_bytes"] = _whole(config["staging_bytes"], "staging_bytes")
    opened: list[PageStore] = []
    try:
        for kind, args in entries:
            opener = PageStore.open_disk if kind == "disk" else PageStore.open_redis
            opened.append(opener(namespace=namespace, **args, **common))
    except BaseException:
        for store in opened:
            store.close()
        raise
    return opened[0] if len(opened) == 1 else ChainedPageStore(opened)


def _tier_args(i: int, tier: Any) -> tuple[str, dict[str, Any]]:
    """One tier entry checked against its kind's keys: (kind, keyword arguments of its opener)."""
    where = f"tiers[{i}]"
    if not isinstance(tier, Mapping):
        raise InvalidArgumentError(f"{where} must be a mapping, got {checks.describe(tier)}")
    kind = tier.get("type")
    if kind not in _TIER_KEYS:
        raise InvalidArgumentError(f"{where}.type must be one of {sorted(_TIER_KEYS)}, got {checks.describe(kind)}")
    required, optional = _TIER_KEYS[kind]
    given = set(tier) - {"type"}
    if required - given:
        raise InvalidArgumentError(f"{where} ({kind}) is missing {sorted(required - given)}")
    if given - required - optional:
        raise InvalidArgumentError(
            f"{where} ({kind}) has unknown keys {sorted(given - required - optional)} "
            f"(known: {sorted(required | optional)})"
        )
    args = {k: tier[k] for k in given}
    for name in ("capacity_bytes", "index_blocks", "load_workers", "store_workers"):
        if name in args:
            args[name] = _whole(args[name], f"{where}.{name}")
    for name in ("root", "url"):
        if name in args and (not isinstance(args[name], str) or not args[name]):
            raise InvalidArgumentError(f"{where}.{name} must be a non-empty string, got {checks.describe(args[name])}")
    if kind == "disk" and args.get("fsync", "none") not in FSYNC_POLICIES:
        raise InvalidArgumentError(f"{where}.fsync must be one of {list(FSYNC_POLICIES)}, got {args['fsync']!r}")
    if "timeout_s" in args:
        t = args["timeout_s"]
        if t.__class__ not in (int, float) or not 0 < t < math.inf:
            raise InvalidArgumentError(
                f"{where}.timeout_s must be a positive number of seconds, got {checks.describe(t)}"
            )
    return kind, args


def _whole(value: Any, name: str) -> int:
    """A positive whole number given as an int or an integral float (JSON writes 200e9)."""
    if value.__class__ is float and value.is_integer():
        value = int(value)
    checks.count(name, value, 1)
    return int(value)
