"""tiered_kv's page stores behind SGLang 0.5's ``HiCacheStorage`` interface.

SGLang's cache controller moves pages between its host memory pool and a storage
backend from its prefetch and backup threads.  It calls one of two families:

* the generic one (``batch_exists``, ``batch_get`` into flat pages it allocated,
  ``batch_set`` of flat pages it copied out of the host pool), and
* with ``"interface_v1": 1`` in the extra config, the page methods
  (``batch_exists``, ``batch_get_v1``, ``batch_set_v1``) that name pages by their
  slots in the host pool (``host_indices``, ``page_size`` slots per page).

Both families store the same bytes: a page is what the host pool's own
``get_data_page(index, flat=True)`` gives and ``set_from_flat_data_page`` takes
back, so pages written by one family are read by the other, whatever the pool's
layout (layer-first, page-first, MLA).  Page views that are contiguous in the host
pool are read into and written from in place; the others go through flat pages of
a per-thread scratch, reused from call to call.

What holds, from :mod:`tiered_kv.integrations.page_store`: every page is written
whole (a file renamed once complete, or one Redis command) with a header naming
the namespace and the key and a CRC-32 checked on every read; a corrupt or vanished
page, a full medium, a Redis that is down or dies mid-call are misses (``None`` /
``False`` / a shorter prefix), never an exception into SGLang's threads; a miss
leaves the destination exactly as it was.  Misuse (a destination of the wrong size,
``host_indices`` that do not cover the keys) raises
:class:`~tiered_kv.errors.InvalidArgumentError` before anything is read or written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.integrations.page_store import ChainedPageStore, PageStore, open_page_store
from tiered_kv.integrations.sglang._sglang import HiCacheStorage, HiCacheStorageExtraInfo
from tiered_kv.integrations.sglang.backend_config import BackendConfig

logger = logging.getLogger(__name__)

SCRATCH_PAGES = 16
"""Flat pages a thread's page-method call stages at a time (pages not contiguous in the host pool)."""

CONSTRUCTOR_KWARGS = frozenset({"fault_hook"})
"""What ``StorageBackendFactory.create_backend(..., **kwargs)`` may pass on (a test's fault hook)."""


def host_layout(pool: Any) -> str:
    """The layout tag's host part: how the host pool arranges a flat page's bytes.

    A flat page's byte order follows the pool's class and layout (layer-first pages
    hold every layer's K, then every layer's V, page by page; page-first pages the
    reverse nesting), its dtype and its tokens per page, and a pool with a page
    format of its own names it (``storage_format_tag``): pages stored under another
    arrangement must miss, not load.
    """
    parts = [type(pool).__name__, str(getattr(pool, "layout", "?")), str(pool.dtype), f"page{pool.page_size}"]
    tag = getattr(pool, "storage_format_tag", None)
    if tag:
        parts.append(str(tag))
    return ";".join(parts)


class TieredKVHiCacheStorage(HiCacheStorage):
    """An SGLang HiCache storage backend over tiered_kv's disk store, Redis store, or both chained.

    Built by SGLang's ``StorageBackendFactory`` as ``cls(storage_config, kwargs)``; the store
    opens when SGLang registers its host memory pool (:meth:`register_mem_pool_host`), whose
    page geometry gives the page size.  Until then every lookup misses and every write fails.

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig``; its ``extra_config`` holds the
            page store's ``tiers`` (and ``policy``, ``staging_bytes``), optionally ``model``
            and ``hash_scheme`` (see ``docs/integrations.md``), beside SGLang's own keys.
        kwargs: What the factory passes on; only ``fault_hook`` (tests) is known.

    Raises:
        InvalidArgumentError: a bad configuration (an unknown key, a tier without its required
            keys, a negative size, no model name); nothing is opened or created.

    Invariants: keys are SGLang's page hash strings; the namespace (model, host layout,
    parallel shard, hash scheme, page bytes) keeps tensor-parallel ranks that hold different
    heads apart, while MLA's replicated pages are one object per page for every rank.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        kwargs = dict(kwargs or {})
        unknown = set(kwargs) - CONSTRUCTOR_KWARGS
        if unknown:
            raise InvalidArgumentError(
                f"unknown keyword arguments {sorted(unknown)} for tiered_kv's HiCache backend "
                f"(known: {sorted(CONSTRUCTOR_KWARGS)})"
            )
        self.config = BackendConfig.from_sglang(storage_config)
        self.storage_config = storage_config
        self.fault_hook = kwargs.get("fault_hook")
        self.mem_pool_host: Any = None
        self.store: PageStore | ChainedPageStore | None = None
        self.layout: str | None = None
        self._lock = threading.Lock()
        self._local = threading.local()

    # ------------------------------------------------------------ the host pool
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for ``mem_pool_host``'s pages (a second registration closes the first store and reopens).

        Raises:
            TieredKVError: the medium cannot be opened (a root that cannot be created, ...); then no
                store is open and every call misses.
        """
        dummy = mem_pool_host.get_dummy_flat_data_page()
        page_bytes = dummy.numel() * dummy.element_size()
        layout = f"sglang;{host_layout(mem_pool_host)};{self.config.rank_layout}"
        self.close()  # first: a disk tier's directory has one owner, and the new store may need the same one
        store = open_page_store(
            self.config.store,
            page_bytes=page_bytes,
            model=self.config.model,
            layout=layout,
            hash_scheme=self.config.hash_scheme,
            fault_hook=self.fault_hook,
        )
        with self._lock:
            self.store, self.mem_pool_host, self.layout = store, mem_pool_host, layout
            self._local = threading.local()  # scratch pages of the new pool's geometry

    @property
    def page_bytes(self) -> int | None:
        """Bytes of one stored page (the host pool's flat page), ``None`` before a pool is registered."""
        store = self.store
        return None if store is None else store.page_bytes

    # ------------------------------------------------------------ generic interface
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """The page of ``key`` copied into ``target_location`` (a flat page if ``None``), or ``None`` on a miss.

        On a miss ``target_location`` is left exactly as it was.
        """
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Per key, its destination holding the page, or ``None`` (a miss; that destination is unchanged)."""
        keys = _key_list(keys)
        pool = self.mem_pool_host
        if target_locations is None:
            if pool is None:
                return [None] * len(keys)
            target_locations = [pool.get_dummy_flat_data_page() for _ in keys]
        outs = list(target_locations)
        hits = self._get(keys, outs)
        return [out if ok else None for out, ok in zip(outs, hits, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (one flat page) under ``key``; whether it is now stored whole and checked."""
        return all(self._put([key], [value]))

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store each page under its key; whether all of them are now stored (SGLang's generic path asks that)."""
        keys = _key_list(keys)
        if values is None:
            raise InvalidArgumentError("batch_set() needs the pages to store (values)")
        return all(self._put(keys, list(values)))

    def exists(self, key: str) -> bool:
        """Whether a get of ``key`` would find its page now."""
        store = self.store
        if store is None:
            return False
        return self._guard(lambda: store.exists([key])[0], False)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, are stored (SGLang loads that prefix)."""
        keys = _key_list(keys)
        store = self.store
        if store is None:
            return 0
        return self._guard(lambda: store.prefix_hits(keys), 0)

    # ------------------------------------------------------------ page interface (interface_v1)
    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load each key's page into the host pool's slots ``host_indices[i * page_size:(i + 1) * page_size]``.

        Per key, whether its page landed; a page that missed leaves its slots as they were.

        Raises:
            InvalidArgumentError: no host pool is registered, or ``host_indices`` does not hold
                ``page_size`` slots per key; nothing was read.
        """
        keys = _key_list(keys)
        pool, starts = self._page_starts(keys, host_indices)
        views = [pool.get_data_page(start, flat=False) for start in starts]
        hits = [False] * len(keys)
        direct = [i for i, v in enumerate(views) if v.is_contiguous()]
        if direct:  # contiguous pages are read in place: a miss leaves them untouched
            for i, ok in zip(direct, self._get([keys[i] for i in direct], [views[i] for i in direct]), strict=True):
                hits[i] = ok
        staged = [i for i, v in enumerate(views) if not v.is_contiguous()]
        for at in range(0, len(staged), SCRATCH_PAGES):
            chunk = staged[at : at + SCRATCH_PAGES]
            flats = self._scratch(len(chunk))
            for i, flat, ok in zip(chunk, flats, self._get([keys[i] for i in chunk], flats), strict=True):
                if ok:
                    pool.set_from_flat_data_page(starts[i], flat)
                hits[i] = ok
        return hits

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages in the host pool's slots ``host_indices`` under ``keys``; per key, whether it is stored.

        Raises:
            InvalidArgumentError: as :meth:`batch_get_v1`; nothing was written.
        """
        keys = _key_list(keys)
        pool, starts = self._page_starts(keys, host_indices)
        stored: list[bool] = []
        for at in range(0, len(keys), SCRATCH_PAGES):
            views = [pool.get_data_page(start, flat=False) for start in starts[at : at + SCRATCH_PAGES]]
            flats = self._scratch(len(views))
            pages = []
            for view, flat in zip(views, flats, strict=False):
                if view.is_contiguous():
                    pages.append(view)  # stored from the pool itself
                else:  # gathered in the flat page's order (what get_data_page(flat=True) gives)
                    flat.view(view.shape).copy_(view)
                    pages.append(flat)
            stored += self._put(keys[at : at + SCRATCH_PAGES], pages)
        return stored

    # ------------------------------------------------------------ the rest
    def delete(self, key: str) -> None:
        """Drop the page of ``key`` from every tier; an absent key is ignored."""
        store = self.store
        if store is not None:
            self._guard(lambda: store.remove([key]), None)

    def clear(self) -> None:
        """Drop every page of this backend's namespace from every tier (other namespaces are untouched)."""
        store = self.store
        if store is not None:
            self._guard(store.clear, None)

    def close(self) -> None:
        """Close the store (SGLang calls this when it detaches the backend); idempotent."""
        with self._lock:
            store, self.store = self.store, None
        if store is not None:
            store.close()

    # ------------------------------------------------------------ plumbing
    def _page_starts(self, keys: list[str], host_indices: Any) -> tuple[Any, list[int]]:
        pool = self.mem_pool_host
        if pool is None:
            raise InvalidArgumentError("no host memory pool is registered (register_mem_pool_host)")
        page_size = pool.page_size
        flat = host_indices.reshape(-1)
        if flat.numel() != len(keys) * page_size:
            raise InvalidArgumentError(
                f"host_indices holds {flat.numel()} slots; {len(keys)} pages of {page_size} slots need "
                f"{len(keys) * page_size}"
            )
        return pool, [int(i) for i in flat[::page_size].tolist()]

    def _scratch(self, n: int) -> list[Any]:
        """``n`` flat pages of this thread's scratch (allocated once per thread and pool, then reused).

        SGLang's prefetch and backup threads call the page methods concurrently, so each thread
        has its own; reusing them spares every call the allocation and first touch of its pages.
        """
        local = self._local
        pages: list[Any] = getattr(local, "pages", [])
        while len(pages) < n:
            pages.append(self.mem_pool_host.get_dummy_flat_data_page())
        local.pages = pages
        return pages[:n]

    def _get(self, keys: list[str], outs: list[Any]) -> list[bool]:
        store = self.store
        if store is None:
            return [False] * len(keys)
        return self._guard(lambda: store.get(keys, outs), [False] * len(keys))

    def _put(self, keys: list[str], pages: list[Any]) -> list[bool]:
        if any(p is None for p in pages):
            raise InvalidArgumentError("set() needs the page to store (value)")
        pages = [p if not hasattr(p, "is_contiguous") or p.is_contiguous() else p.contiguous() for p in pages]
        store = self.store
        if store is None:
            return [False] * len(keys)
        return self._guard(lambda: store.put(keys, pages), [False] * len(keys))

    def _guard(self, call: Any, on_fault: Any) -> Any:
        """``call()``, with a medium fault that escaped the store turned into ``on_fault`` (misuse still raises).

        SGLang runs storage calls on its prefetch and backup threads, where an exception ends
        the whole batch; a page that cannot be read or written is a miss there, not an error.
        """
        try:
            return call()
        except InvalidArgumentError:
            raise
        except (TieredKVError, OSError) as exc:
            logger.warning("tiered_kv HiCache backend: a medium fault is a miss: %s", exc)
            return on_fault


def _key_list(keys: Any) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(f"keys must be a list of SGLang page hashes, got {checks.describe(keys)}")
    return list(keys)
