"""The I/O engine of a store below the CPU tier: plans in, per-block outcomes out, on a thread pool.

A plan is an ordinary :class:`~tiered_kv.transfer.plan.TransferPlan` between the
CPU tier and the store's medium: ``CPU -> DISK`` stores, ``DISK -> CPU`` loads.
Its CPU side names slots of the CPU tensor; its other side names the store's
slots, from ``prepare_store``/``prepare_load``, which the engine resolves to
keys when the plan is submitted (on the caller's thread, so the store itself
stays single-threaded).

The handle, a :class:`BlockIOHandle` (:mod:`~tiered_kv.tiers.io_handle`), carries one
:class:`BlockOutcome` per block.  Its status sums them up: ``DONE`` only if every
block landed, ``FAILED`` if any did not, ``CANCELLED`` if it was cancelled.
Whatever the status, the outcomes say which blocks landed, and the caller
completes the store's verbs per block; a caller that reads only the status and
treats a ``FAILED`` plan as wholly failed still loses nothing, it only wastes
the blocks that did land.

Loads and stores run on separate pools, so a load a request waits for is
never queued behind a long write-back.

The staging area is either the CPU tier's :class:`KVStorage` (tiered_kv's own
stack) or a raw buffer of chunk bytes, a memoryview or a CPU tensor whose
rows are the chunks (:class:`~tiered_kv.tiers.chunk_buffer.ChunkBuffer`: a
host such as vLLM's CPU offloading tier that owns its memory).  Either way a
plan's CPU side names rows of it and the medium stores the same framed,
checksummed blocks.
"""

from __future__ import annotations

import abc
import ctypes
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import PlanError, StorageError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.io_handle import BlockIOHandle, BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import TransferPlan, TransferStatus

FaultHook = Callable[[str, Key], None]
"""Called as ``hook("store" | "load", key)`` in the worker before a block's I/O; what it raises is that I/O's error."""


@dataclass(frozen=True, slots=True)
class Job:
    """One block of a batch: its position in the plan, its key and its CPU slot."""

    index: int
    key: Key
    host_block: int


@dataclass(slots=True)
class IOStats:
    """Counters since the engine was built (blocks and bytes that landed, outcomes of every block)."""

    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


class HostBlocks:
    """Memoryviews of the blocks of a CPU-resident :class:`KVStorage`, for I/O without a copy.

    File reads and writes take Python buffers, so each block is exposed as
    memoryviews over the tensor's memory, in the canonical segment order (layer
    0 K, layer 0 V, layer 1 K, ...): one view for a block-contiguous tier,
    ``2 * num_layers`` for a layer-first one.  The views point into the
    tensor's memory, so this object keeps the storage alive; it must not
    outlive a ``close`` that frees the memory.

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


def staging_area(host: Any) -> HostBlocks | ChunkBuffer:
    """The byte views an engine stages through: a CPU :class:`KVStorage`'s blocks, or a raw buffer's rows.

    Raises:
        StorageError: ``host`` is a storage not in CPU memory, or a buffer a :class:`ChunkBuffer` refuses.
    """
    if isinstance(host, KVStorage):
        return HostBlocks(host)
    if isinstance(host, ChunkBuffer):
        return host
    return ChunkBuffer(host)


def host_block_bytes(host: Any) -> int:
    """Bytes per block (or chunk) of a staging area, as the engine would see it; for the engines' geometry checks."""
    return host.spec.bytes_per_block if isinstance(host, KVStorage) else staging_area(host).block_bytes


def check_geometry(host: Any, namespace: KVNamespace, what: str) -> None:
    """Refuse a staging area whose blocks the store's namespace does not describe.

    A :class:`KVStorage` must have the namespace's very :class:`KVSpec`; a raw buffer,
    whose layout is opaque, must have the namespace's bytes per block.

    Raises:
        StorageError: they differ (nothing is built).
    """
    if isinstance(host, KVStorage):
        if host.spec != namespace.spec:
            raise StorageError(f"the CPU tier's KV spec {host.spec} is not the {what} store's")
        return
    chunk = host_block_bytes(host)
    if chunk != namespace.block_bytes:
        raise StorageError(
            f"the staging buffer's chunks are {chunk} bytes, the {what} store's namespace says {namespace.block_bytes}"
        )


class BlockIOEngine(abc.ABC):
    """Executes plans between the CPU tier's memory and a :class:`KeyedStore`'s medium.

    Args:
        host: The staging area: the CPU tier's :class:`KVStorage`, or a raw buffer of
            chunk bytes (a memoryview, a CPU tensor or a :class:`ChunkBuffer`; row ``i``
            is CPU slot ``i``).
        store: The store whose medium the engine reads and writes.
        load_workers: Threads for loads.
        store_workers: Threads for stores.
        batch_blocks: Blocks per task (one pipeline for Redis, that many files for disk).
        fault_hook: See :data:`FaultHook` (fault injection in tests).
    """

    def __init__(
        self,
        host: KVStorage | ChunkBuffer | memoryview | Any,
        store: KeyedStore,
        load_workers: int = 4,
        store_workers: int = 2,
        batch_blocks: int = 8,
        fault_hook: FaultHook | None = None,
    ) -> None:
        checks.instance("store", store, KeyedStore)
        checks.count("load_workers", load_workers, 1)
        checks.count("store_workers", store_workers, 1)
        checks.count("batch_blocks", batch_blocks, 1)
        if fault_hook is not None and not callable(fault_hook):
            raise PlanError(f"fault_hook must be callable, got {checks.describe(fault_hook)}")
        self.host = staging_area(host)
        self._host_medium = host.medium if isinstance(host, KVStorage) else self.host.medium
        self.store = store
        self.batch_blocks = batch_blocks
        self.fault_hook = fault_hook
        name = type(self).__name__
        self._pools = {
            "load": ThreadPoolExecutor(load_workers, thread_name_prefix=f"{name}-load"),
            "store": ThreadPoolExecutor(store_workers, thread_name_prefix=f"{name}-store"),
        }
        self._lock = threading.Lock()
        self._live: dict[int, BlockIOHandle] = {}
        self._stats = IOStats()
        self._closed = False

    @property
    def medium(self) -> str:
        return self.store.medium

    # -------------------------------------------------------------- submit
    def submit(self, plan: TransferPlan) -> BlockIOHandle:
        """Check the plan, resolve its keys and queue its batches; return at once.

        Raises:
            PlanError: the plan does not go between the CPU tier and this medium, its ids are
                out of range, or its store-side slots are not reserved for this direction
                (pending for a store, ready for a load).  Nothing is queued.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {checks.describe(plan)}")
        if self._closed:
            raise PlanError(f"the {self.medium} I/O engine is closed")
        host_medium = self._host_medium
        if (plan.src_medium, plan.dst_medium) == (host_medium, self.medium):
            op, host_ids, slots = "store", plan.src_block_ids, plan.dst_block_ids
            plan.validate(self.host.num_blocks, self.store.num_blocks)
        elif (plan.src_medium, plan.dst_medium) == (self.medium, host_medium):
            op, host_ids, slots = "load", plan.dst_block_ids, plan.src_block_ids
            plan.validate(self.store.num_blocks, self.host.num_blocks)
        else:
            raise PlanError(
                f"plan {plan.plan_id}: the {self.medium} I/O engine moves {host_medium} <-> {self.medium}, "
                f"not {plan.src_medium} -> {plan.dst_medium}"
            )
        if len(set(host_ids)) != len(host_ids):
            raise PlanError(f"plan {plan.plan_id}: a CPU slot is listed twice")
        keys = self.store.plan_keys(plan.plan_id, op, slots)
        handle = BlockIOHandle(plan, num_bytes=plan.num_blocks * self.host.block_bytes, keys=keys)
        handle.outcomes = [BlockOutcome.CANCELLED] * len(keys)
        jobs = [Job(i, key, host_ids[i]) for i, key in enumerate(keys)]
        batches = [jobs[i : i + self.batch_blocks] for i in range(0, len(jobs), self.batch_blocks)]
        with self._lock:
            if plan.plan_id in self._live:
                raise PlanError(f"plan {plan.plan_id} is already in flight")
            self._live[plan.plan_id] = handle
            handle._batches_left = len(batches)
        if not batches:
            self._finish(handle)
        for batch in batches:
            self._pools[op].submit(self._run, handle, op, batch)
        return handle

    # -------------------------------------------------------------- cancel
    def cancel(self, handle: BlockIOHandle) -> bool:
        """Stop the batches that have not started; True exactly when the handle ends ``CANCELLED``.

        Batches already running finish, and their outcomes stand: a block that
        landed before the cancel is reported as landed.
        """
        if not isinstance(handle, BlockIOHandle):
            raise PlanError(f"cancel() takes a BlockIOHandle, got {checks.describe(handle)}")
        with self._lock:
            if handle.done() or self._live.get(handle.plan.plan_id) is not handle:
                return False
            handle._cancel_requested = True
            return True

    # -------------------------------------------------------------- workers
    def _run(self, handle: BlockIOHandle, op: str, batch: list[Job]) -> None:
        if handle._cancel_requested:
            outcomes = [BlockOutcome.CANCELLED] * len(batch)
        else:
            handle.mark_running()
            try:
                outcomes = self._store_batch(batch) if op == "store" else self._load_batch(batch)
                assert len(outcomes) == len(batch), "an I/O batch must report every block"
            except Exception as exc:  # a bug or an unforeseen error fails the batch, never the worker
                outcomes = [BlockOutcome.ERROR] * len(batch)
                with self._lock:
                    handle.error = handle.error or exc
        landed = sum(1 for o in outcomes if o.landed)
        with self._lock:
            for job, outcome in zip(batch, outcomes, strict=True):
                handle.outcomes[job.index] = outcome
                self._stats.outcomes[outcome.value] = self._stats.outcomes.get(outcome.value, 0) + 1
            if op == "store":
                self._stats.blocks_stored += landed
                self._stats.bytes_stored += landed * self.host.block_bytes
            else:
                self._stats.blocks_loaded += landed
                self._stats.bytes_loaded += landed * self.host.block_bytes
            handle._batches_left -= 1
            last = handle._batches_left == 0
        if last:
            self._finish(handle)

    def _finish(self, handle: BlockIOHandle) -> None:
        with self._lock:
            if self._live.get(handle.plan.plan_id) is handle:
                del self._live[handle.plan.plan_id]
            plan_id = handle.plan.plan_id
            if handle._cancel_requested:
                handle.finish(TransferStatus.CANCELLED, TransferError(f"plan {plan_id}: cancelled"))
            elif all(o.landed for o in handle.outcomes):
                handle.finish(TransferStatus.DONE)
            else:
                bad = sorted({o.value for o in handle.outcomes if not o.landed})
                count = sum(1 for o in handle.outcomes if not o.landed)
                cause = f" ({handle.error})" if handle.error is not None else ""
                err = TransferError(f"plan {plan_id}: {count} of {len(handle.outcomes)} blocks failed: {bad}{cause}")
                handle.finish(TransferStatus.FAILED, err)

    def _fault(self, op: str, key: Key) -> None:
        if self.fault_hook is not None:
            self.fault_hook(op, key)

    @abc.abstractmethod
    def _store_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        """Write each job's CPU block to the medium under its key; one outcome per job."""

    @abc.abstractmethod
    def _load_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        """Read each job's block from the medium into its CPU slot; one outcome per job."""

    # -------------------------------------------------------------- life
    @property
    def stats(self) -> IOStats:
        """A copy of the counters."""
        with self._lock:
            s = self._stats
            return IOStats(s.blocks_stored, s.bytes_stored, s.blocks_loaded, s.bytes_loaded, dict(s.outcomes))

    @property
    def num_in_flight(self) -> int:
        """Plans submitted and not final."""
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """Finish every queued plan, then stop the threads."""
        self._closed = True
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    def __enter__(self) -> BlockIOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ids = itertools.count()


def unique_suffix() -> str:
    """A process-unique token for temporary names (threads of one process never collide)."""
    return str(next(_ids))
