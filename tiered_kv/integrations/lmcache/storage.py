"""tiered_kv's disk store, Redis store, or both chained, as an LMCache 0.5.6 storage plug-in.

LMCache's ``storage_plugin_launcher`` builds every name in ``storage_plugins`` from
``extra_config["storage_plugin.<name>.module_path"]`` and ``".class_name"``, passing
the engine configuration, its metadata, its event loop and its local CPU backend.
:class:`TieredKVStorage` is such a class.  Each LMCache memory object (one chunk's KV,
or one layer of it) becomes one page of a :mod:`~tiered_kv.integrations.page_store`
store under the key's ``CacheEngineKey.to_string()`` (which carries the model, the
world size, the worker's rank, the chunk hash, the dtype and any tags), framed by
:mod:`~tiered_kv.integrations.lmcache.page_format` so that a short last chunk comes
back exactly as short as it went in.

LMCache's contract, as its own backends keep it, and how this class keeps it:

* ``batched_submit_put_task`` returns at once; the writes run on this plug-in's put
  workers, and ``exists_in_put_tasks(key)`` is true from the submit until that key's
  write has ended (stored or failed).  The objects are held (``ref_count_up``) until then,
  because LMCache drops its own reference as soon as the submit returns.  Each object's
  bytes are framed into this plug-in's own page during the submit, on the caller's
  thread: a worker never reads LMCache's memory, which LMCache's ``StorageManager.close``
  frees (it closes the local CPU backend before this one) while writes may still run.
* ``get_blocking`` returns a new object from LMCache's local CPU backend (this plug-in's
  allocator backend) holding exactly the stored bytes, or ``None``.
* ``contains(key, pin=True)`` and ``pin`` hold a key for a coming retrieve; ``unpin``
  releases one hold; ``remove(key, force=False)`` (LMCache's own eviction) leaves a held
  key alone.
* A medium fault is never an exception in LMCache's threads: a corrupt or vanished page,
  a full disk, a Redis server that is down or dies mid-call are misses (``None``, ``False``,
  a shorter prefix) or a put that did not store.  Bad configuration is a
  :class:`~tiered_kv.errors.ConfigError` at construction, before anything is created.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from tiered_kv import checks
from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.integrations.lmcache import page_format
from tiered_kv.integrations.lmcache.page_format import HEADER_BYTES, ObjectLayout
from tiered_kv.integrations.lmcache.settings import PluginSettings, plugin_names, read_settings
from tiered_kv.integrations.page_store import ChainedPageStore, PageStore, PageStoreStats, leading, open_page_store

logger = logging.getLogger(__name__)

MODULE_PATHS = {"tiered_kv.integrations.lmcache", __name__}
WRITE_BATCH = 8
"""Pages staged and written per store call by a put worker: bounds the staging memory of one write."""


@dataclass(slots=True)
class PluginStats:
    """Counters since the plug-in was built (objects, unless the name says otherwise).

    Attributes:
        submitted: Objects handed to ``batched_submit_put_task`` (already held or in flight included).
        written: Objects a put worker wrote and the store now holds.
        failed: Objects a put worker could not store (no room, a medium error, a server down).
        refused: Objects that cannot be framed in a page (too large, a dtype or format the header
            cannot name, CacheBlend positions, not in CPU memory); never written.
        gets: Objects asked for by any get method.
        hits: Objects returned.
        misses: Objects asked for and not returned (absent, corrupt, medium fault, no CPU memory).
        bad_pages: Pages the store returned whose frame did not decode (then removed).
    """

    submitted: int = 0
    written: int = 0
    failed: int = 0
    refused: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    bad_pages: int = 0


def chunk_capacity(metadata: LMCacheMetadata) -> int:
    """Bytes of a full chunk's data as LMCache allocates it (every group's full-chunk shape)."""
    shapes = metadata.get_shapes()
    dtypes = metadata.get_dtypes()
    if len(dtypes) == 1 and len(shapes) > 1:
        dtypes = dtypes * len(shapes)
    return sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))


def layout_tag(config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> str:
    """What fixes a page's bytes besides its key: the frame version and the engine's KV geometry."""
    shape = "x".join(str(int(d)) for d in metadata.kv_shape)
    return (
        f"lmcache-page/v{page_format.VERSION};kv={shape};dtype={metadata.kv_dtype};"
        f"chunk={config.chunk_size};mla={int(bool(metadata.use_mla))};layerwise={int(bool(config.use_layerwise))}"
    )


class TieredKVStorage(StoragePluginInterface):
    """An LMCache storage plug-in over a tiered_kv page store (disk, Redis, or both chained).

    Built by LMCache's plug-in loader from the engine configuration; see the module docstring
    and ``docs/integrations.md`` for the keys.

    Invariants: a key is in ``exists_in_put_tasks`` exactly while a put worker still owes its
    write; every object this plug-in holds a reference to is released exactly once, when its
    write ends; a key's hold count (pins) is never negative and is dropped by a forced remove.

    Raises:
        ConfigError: no configuration or metadata, no ``storage_plugins`` entry naming this
            class (or more than one), a bad ``storage_plugin.<name>.*`` key, or no local CPU
            backend on a worker; nothing was created.
        InvalidArgumentError: the page store refused its configuration (a missing or bad tier
            key); nothing was created.
    """

    def __init__(
        self,
        dst_device: str = torch_device_type,
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device, config=config, metadata=metadata, local_cpu_backend=local_cpu_backend, loop=loop
        )
        if config is None or metadata is None:
            raise ConfigError("TieredKVStorage is built by LMCache's plug-in loader, with its config and metadata")
        names = plugin_names(config.extra_config, config.storage_plugins, MODULE_PATHS, type(self).__name__)
        if len(names) != 1:
            raise ConfigError(
                f"TieredKVStorage needs exactly one storage_plugins entry whose extra_config "
                f"storage_plugin.<name>.module_path is tiered_kv.integrations.lmcache and class_name is "
                f"{type(self).__name__}, found {names} (chain tiers inside one entry instead)"
            )
        self.settings: PluginSettings = read_settings(config.extra_config, names[0])
        if local_cpu_backend is None and metadata.role != "scheduler":
            raise ConfigError(
                "TieredKVStorage returns objects allocated by LMCache's local CPU backend: "
                "set max_local_cpu_size > 0 (local_cpu may stay false)"
            )
        self.capacity = chunk_capacity(metadata)
        self.page_bytes = page_format.page_bytes_for(self.capacity)
        hash_scheme = self.settings.hash_scheme or f"lmcache-{config.pre_caching_hash_algorithm}"
        self.store: PageStore | ChainedPageStore = open_page_store(
            self.settings.store_config,
            page_bytes=self.page_bytes,
            model=self.settings.model or metadata.model_name,
            layout=layout_tag(config, metadata),
            hash_scheme=hash_scheme,
            fault_hook=self.settings.fault_hook,
        )
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._stats = PluginStats()
        self._closed = False
        self._writers = ThreadPoolExecutor(self.settings.put_workers, thread_name_prefix="tiered-kv-lmcache-put")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="tiered-kv-lmcache-get")

    def __str__(self) -> str:
        return self.settings.name

    # ------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        """Whether a get would find ``key`` now (a write still in flight does not count); ``pin`` holds a hit."""
        k = self._name(key)
        checks.flag("pin", pin)
        present = self._exists([k])[0]
        if present and pin:
            self._hold([k])
        return present

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, a get would find; ``pin`` holds those."""
        names = [self._name(k) for k in keys]
        checks.flag("pin", pin)
        n = self._prefix(names)
        if pin:
            self._hold(names[:n])
        return n

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """:meth:`batched_contains` off the event loop's thread (the medium may be a network away)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self.batched_contains, keys, pin)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """Whether a put worker still owes ``key``'s write."""
        k = self._name(key)
        with self._lock:
            return k in self._in_flight

    # ------------------------------------------------------------ puts
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        """Queue the objects' writes and return at once: one future per queued write, ``None`` when none was queued.

        A key already being written is skipped.  An object that cannot be framed in a page is
        skipped (counted as ``refused``).  ``on_complete_callback(key)`` runs on the put worker
        after each key's write stored it; what it raises is logged.

        Raises:
            InvalidArgumentError: ``keys`` and ``objs`` differ in length, or an entry is not a
                ``CacheEngineKey`` / ``MemoryObj``; then nothing was queued.
        """
        if len(keys) != len(objs):
            raise InvalidArgumentError(f"batched_submit_put_task got {len(keys)} keys and {len(objs)} objects")
        names = [self._name(k) for k in keys]
        for i, obj in enumerate(objs):
            if not isinstance(obj, MemoryObj):
                raise InvalidArgumentError(f"objs[{i}] must be an LMCache MemoryObj, got {checks.describe(obj)}")
        if on_complete_callback is not None and not callable(on_complete_callback):
            raise InvalidArgumentError(
                f"on_complete_callback must be callable, got {checks.describe(on_complete_callback)}"
            )
        jobs: list[tuple[CacheEngineKey, str, MemoryObj, torch.Tensor]] = []
        refused = 0
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the TieredKVStorage plug-in is closed")
            self._stats.submitted += len(objs)
            for key, name, obj in zip(keys, names, objs, strict=True):
                if name in self._in_flight or any(j[1] == name for j in jobs):
                    continue
                layout = self._layout(obj)
                if layout is None:
                    refused += 1
                    continue
                jobs.append((key, name, obj, self._frame(obj, layout)))
            self._stats.refused += refused
            for _, name, obj, _ in jobs:
                self._in_flight[name] = 1
                obj.ref_count_up()  # LMCache drops its reference when this call returns
        if not jobs:
            return None
        futures = []
        for start in range(0, len(jobs), WRITE_BATCH):
            batch = jobs[start : start + WRITE_BATCH]
            futures.append(self._writers.submit(self._write, batch, on_complete_callback))
        return futures

    def _write(
        self,
        jobs: list[tuple[CacheEngineKey, str, MemoryObj, torch.Tensor]],
        on_complete: Callable[[CacheEngineKey], None] | None,
    ) -> list[bool]:
        """One put worker's batch: store the framed pages, release the objects."""
        stored = [False] * len(jobs)
        try:
            names = [j[1] for j in jobs]
            held = self._exists(names)
            todo = [i for i, h in enumerate(held) if not h]
            for i, h in enumerate(held):
                stored[i] = h
            if todo:
                pages = [jobs[i][3] for i in todo]
                try:
                    ok = self.store.put([names[i] for i in todo], pages)
                except Exception:  # the page store promises misses, not exceptions; a surprise is still a miss
                    logger.exception("tiered_kv: a put of %d pages failed", len(todo))
                    ok = [False] * len(todo)
                for i, o in zip(todo, ok, strict=True):
                    stored[i] = o
        finally:
            with self._lock:
                for (_, name, obj, _), s in zip(jobs, stored, strict=True):
                    self._in_flight.pop(name, None)
                    obj.ref_count_down()
                    if s:
                        self._stats.written += 1
                    else:
                        self._stats.failed += 1
        if on_complete is not None:
            for (key, _, _, _), s in zip(jobs, stored, strict=True):
                if s:
                    try:
                        on_complete(key)
                    except Exception:
                        logger.exception("tiered_kv: LMCache's on_complete_callback failed for %s", key)
        return stored

    def _layout(self, obj: MemoryObj) -> ObjectLayout | None:
        """The frame of ``obj``'s page, or ``None`` (logged) when a page cannot hold it exactly."""
        meta = obj.metadata
        why = None
        raw = getattr(obj, "raw_data", None)
        if not isinstance(raw, torch.Tensor) or raw.device.type != "cpu" or not raw.is_contiguous():
            why = "its data is not a contiguous CPU tensor"
        elif meta.cached_positions is not None:
            why = "it carries CacheBlend token positions, which a page does not keep"
        else:
            shapes = meta.shapes if meta.shapes is not None else [meta.shape]
            dtypes = meta.dtypes if meta.dtypes is not None else [meta.dtype]
            used = obj.get_size()
            layout = ObjectLayout(
                int(meta.fmt.value),
                tuple(tuple(int(d) for d in s) for s in shapes),
                tuple(dtypes),
                used,
                narrowed=False,
            )
            if used != layout.shapes_bytes:
                layout = replace(layout, narrowed=True)
            why = page_format.encodable(layout, self.capacity)
            if why is None:
                return layout
        logger.warning("tiered_kv: not storing an LMCache object: %s", why)
        return None

    def _frame(self, obj: MemoryObj, layout: ObjectLayout) -> torch.Tensor:
        page = torch.empty(self.page_bytes, dtype=torch.uint8)
        page[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(page_format.encode(layout)), dtype=torch.uint8))
        end = HEADER_BYTES + layout.used_bytes
        page[HEADER_BYTES:end].copy_(obj.raw_data.view(torch.uint8)[: layout.used_bytes])
        page[end:].zero_()  # a page's bytes are a function of the object alone
        return page

    # ------------------------------------------------------------ gets
    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """A new object from LMCache's local CPU backend holding exactly the bytes stored under ``key``, or ``None``."""
        return self._read([self._name(key)], prefix=False)[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """:meth:`get_blocking` for each key, in one store call."""
        return self._read([self._name(k) for k in keys], prefix=False)

    def get_non_blocking(self, key: CacheEngineKey, location: str | None = None) -> Future | None:
        """A future of :meth:`get_blocking`, or ``None`` when ``key`` is not held now."""
        k = self._name(key)
        if not self._exists([k])[0]:
            return None
        return self._readers.submit(lambda: self._read([k], prefix=False)[0])

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """The objects of the longest prefix of ``keys`` that could be read, off the event loop's thread.

        LMCache calls this after ``batched_async_contains(..., pin=True)``: the holds of ``keys``
        are released once they are read (or missed).  A shorter list is a miss of the rest,
        which LMCache's prefetch accepts.
        """
        names = [self._name(k) for k in keys]
        loop = asyncio.get_running_loop()
        try:
            objs = await loop.run_in_executor(self._readers, self._read, names, True)
        finally:
            self._release(names)
        return [o for o in objs if o is not None]

    def _read(self, names: list[str], prefix: bool) -> list[MemoryObj | None]:
        """Read pages and rebuild their objects; with ``prefix``, stop at the first miss (``None`` from there on)."""
        out: list[MemoryObj | None] = [None] * len(names)
        if not names:
            return out
        pages = [torch.empty(self.page_bytes, dtype=torch.uint8) for _ in names]
        try:
            hits = self.store.get(names, pages)
        except Exception:  # a surprise from the medium is still only a miss
            logger.exception("tiered_kv: a get of %d pages failed", len(names))
            hits = [False] * len(names)
        bad: list[str] = []
        for i, (name, page, hit) in enumerate(zip(names, pages, hits, strict=True)):
            if not hit:
                if prefix:
                    break
                continue
            obj, corrupt = self._rebuild(page)
            if corrupt:
                bad.append(name)
            if obj is None and prefix:
                break
            out[i] = obj
        if bad:
            self._forget(bad)
        n = sum(o is not None for o in out)
        with self._lock:
            self._stats.gets += len(names)
            self._stats.hits += n
            self._stats.misses += len(names) - n
            self._stats.bad_pages += len(bad)
        return out

    def _rebuild(self, page: torch.Tensor) -> tuple[MemoryObj | None, bool]:
        """The object a page holds, from LMCache's CPU allocator: (object or None, whether the frame was bad)."""
        layout = page_format.decode(page[:HEADER_BYTES].numpy().tobytes(), self.capacity)
        if layout is None:
            return None, True
        backend = self.local_cpu_backend
        if backend is None:  # LMCache's scheduler role has no CPU backend: it only looks keys up
            return None, False
        shapes = [torch.Size(s) for s in layout.shapes]
        dtypes = list(layout.dtypes)
        one = len(shapes) == 1
        try:
            fmt = MemoryFormat(layout.fmt)
        except ValueError:
            return None, True
        obj = backend.allocate(shapes[0] if one else shapes, dtypes[0] if one else dtypes, fmt)
        if obj is None:  # no CPU memory now: a miss, and LMCache recomputes
            return None, False
        if layout.narrowed:
            obj.set_used_size(layout.used_bytes)
        if obj.get_size() != layout.used_bytes:
            obj.ref_count_down()
            return None, True
        obj.raw_data.view(torch.uint8)[: layout.used_bytes].copy_(page[HEADER_BYTES : HEADER_BYTES + layout.used_bytes])
        return obj, False

    # ------------------------------------------------------------ holds and removal
    def pin(self, key: CacheEngineKey) -> bool:
        """Hold ``key`` for a coming retrieve; False when it is not held by the store."""
        k = self._name(key)
        if not self._exists([k])[0]:
            return False
        self._hold([k])
        return True

    def unpin(self, key: CacheEngineKey) -> bool:
        """Release one hold of ``key``; False when it had none."""
        k = self._name(key)
        with self._lock:
            if k not in self._pins:
                return False
        self._release([k])
        return True

    def is_pinned(self, key: CacheEngineKey) -> int:
        """How many holds ``key`` has (a fact for callers and tests; LMCache does not ask)."""
        k = self._name(key)
        with self._lock:
            return self._pins.get(k, 0)

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Drop ``key``'s page; True when the store held it.  ``force=False`` leaves a held key alone."""
        k = self._name(key)
        checks.flag("force", force)
        with self._lock:
            if not force and self._pins.get(k, 0):
                return False
        present = self._exists([k])[0]
        with self._lock:
            holds = self._pins.pop(k, 0)
        if holds:
            self.store.release([k] * holds)
        self._forget([k])
        return present

    def touch_cache(self) -> None:
        """Nothing to do: the store makes a page recent when it is read."""

    def get_allocator_backend(self) -> Any:
        """LMCache's local CPU backend: put objects come from it and get objects are allocated from it."""
        return self.local_cpu_backend

    # ------------------------------------------------------------ facts and life
    def stats(self) -> PluginStats:
        """A copy of the plug-in's counters."""
        with self._lock:
            return replace(self._stats)

    def store_stats(self) -> list[PageStoreStats]:
        """Each tier's page-store counters, highest tier first."""
        s = self.store.stats()
        return s if isinstance(s, list) else [s]

    def close(self) -> None:
        """Wait for every queued write, then close the store; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writers.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.store.close()

    # ------------------------------------------------------------ plumbing
    @staticmethod
    def _name(key: Any) -> str:
        if not isinstance(key, CacheEngineKey):
            raise InvalidArgumentError(f"a key must be an LMCache CacheEngineKey, got {checks.describe(key)}")
        return key.to_string()

    def _exists(self, names: list[str]) -> list[bool]:
        try:
            return self.store.exists(names)
        except Exception:
            logger.exception("tiered_kv: a lookup of %d keys failed", len(names))
            return [False] * len(names)

    def _prefix(self, names: list[str]) -> int:
        return leading(self._exists(names))

    def _forget(self, names: list[str]) -> None:
        try:
            self.store.remove(names)
        except Exception:
            logger.exception("tiered_kv: removing %d keys failed", len(names))

    def _hold(self, names: list[str]) -> None:
        # The store's hold keeps the page from being evicted by later puts until the unpin.
        try:
            held = self.store.hold(names)
        except Exception:
            logger.exception("tiered_kv: holding %d keys failed", len(names))
            held = [False] * len(names)
        with self._lock:
            for k, ok in zip(names, held, strict=True):
                if ok:
                    self._pins[k] = self._pins.get(k, 0) + 1

    def _release(self, names: list[str]) -> None:
        with self._lock:
            mine = [k for k in names if self._pins.get(k, 0)]
            for k in mine:
                n = self._pins[k]
                if n > 1:
                    self._pins[k] = n - 1
                else:
                    del self._pins[k]
        if mine:
            self.store.release(mine)
