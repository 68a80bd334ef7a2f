"""CpuCopyEngine: real asynchrony on machines without a GPU.

One worker thread per lane executes plans chunk by chunk with ``torch`` copies,
which release the GIL, so copies overlap the caller's work and each other.
Handles behave exactly as with the CUDA engines, so everything above runs
unchanged.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.plan import CopyRun, TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.storage_engine import LANES, PreparedPlan, StorageEngineBase

#: How often a worker waiting for a gated layer checks for a cancel.
GATE_POLL_S = 0.05


class CpuCopyEngine(StorageEngineBase):
    """Thread-per-lane copy engine.

    ``cancel`` stops a plan before it starts, or between two chunks; a cancelled
    or failed plan's destination must not be read (the manager never does:
    only a DONE plan's destination is registered or made runnable).
    """

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        record: bool = False,
        copy_hook: Callable[[TransferPlan, CopyRun], None] | None = None,
        layer_hook: Callable[[TransferPlan, int], None] | None = None,
        layer_order: Callable[[int], list[int]] | None = None,
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record, copy_hook)
        # Fault injection and reordering for tests: called before each layer of a layer-wise plan,
        # and the order in which its layers are copied.
        self.layer_hook = layer_hook
        self.layer_order = layer_order or (lambda n: list(range(n)))
        self._queues: dict[str, queue.Queue] = {lane: queue.Queue() for lane in LANES}
        self._threads: dict[str, threading.Thread] = {}
        self._live: dict[int, TransferHandle] = {}
        self._cancelled: set[int] = set()  # id() of running handles whose cancel was registered
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, plan: TransferPlan) -> TransferHandle:
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if self._closed:
            raise PlanError("engine is closed")
        prep = self.prepare(plan)
        with self._lock:
            if plan.plan_id in self._live:
                raise PlanError(f"plan {plan.plan_id} is already in flight")
            handle = TransferHandle(plan, num_bytes=prep.num_bytes)
            self._live[plan.plan_id] = handle
            if prep.lane not in self._threads:
                t = threading.Thread(target=self._worker, args=(prep.lane,), name=f"tiered-kv-{prep.lane}", daemon=True)
                self._threads[prep.lane] = t
                t.start()
        self._queues[prep.lane].put((handle, prep))
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        """Cancel a plan that is not final; True exactly when the handle ends CANCELLED.

        A queued plan is cancelled at once.  A running plan is marked under the
        engine's lock; the worker checks the mark under the same lock at every
        chunk boundary, the last one included, so a True answer can never be
        followed by a DONE handle, and a plan that finished first answers False.
        The mark lives on the handle, so nothing stale can touch a later plan
        that reuses the plan id.
        """
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        if handle.cancel_if_pending(TransferError(f"plan {handle.plan.plan_id}: cancelled")):
            self._forget(handle)
            return True
        with self._lock:
            if handle.done() or self._live.get(handle.plan.plan_id) is not handle:
                return False
            self._cancelled.add(id(handle))
        return True

    def _forget(self, handle: TransferHandle) -> None:
        with self._lock:
            if self._live.get(handle.plan.plan_id) is handle:
                del self._live[handle.plan.plan_id]
            self._cancelled.discard(id(handle))

    def _end(self, handle: TransferHandle, status: TransferStatus, error: BaseException | None = None) -> None:
        """Finish the handle, unless a cancel was registered first (checked under the lock)."""
        plan_id = handle.plan.plan_id
        with self._lock:
            if id(handle) in self._cancelled and status is TransferStatus.DONE:
                status, error = TransferStatus.CANCELLED, TransferError(f"plan {plan_id}: cancelled")
            handle.finish(status, error)
            if self._live.get(plan_id) is handle:
                del self._live[plan_id]
            self._cancelled.discard(id(handle))

    def _worker(self, lane: str) -> None:
        q = self._queues[lane]
        while True:
            item = q.get()
            if item is None:
                return
            handle, prep = item
            self._run(handle, prep)

    def _run(self, handle: TransferHandle, prep: PreparedPlan) -> None:
        plan = prep.plan
        for w in plan.wait_for:  # writes to the destination follow these plans
            with self._lock:
                other = self._live.get(w)
            if other is not None:
                other.wait()
        if not handle.mark_running():
            return  # cancelled while queued
        try:
            if plan.num_layers:
                self._run_layers(handle, prep)
                return
            for ci, chunk in enumerate(prep.chunks):
                if id(handle) in self._cancelled:
                    self._end(handle, TransferStatus.CANCELLED, TransferError(f"plan {plan.plan_id}: cancelled"))
                    return
                for run in chunk:
                    self._record(prep, ci, run)
                    self.copy_run(plan, run)
            self._end(handle, TransferStatus.DONE)
        except Exception as exc:  # any copy failure fails the plan; the source is only read
            self._end(handle, TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))

    def _run_layers(self, handle: TransferHandle, prep: PreparedPlan) -> None:
        """A layer-wise plan: every run's layer ``i``, then announce layer ``i``; cancel at layer boundaries."""
        plan = prep.plan
        for layer in self.layer_order(plan.num_layers):
            while not handle._wait_gate(layer, GATE_POLL_S) and id(handle) not in self._cancelled:
                pass  # a gated plan: compute has not finished this layer yet
            if id(handle) in self._cancelled:
                self._end(handle, TransferStatus.CANCELLED, TransferError(f"plan {plan.plan_id}: cancelled"))
                return
            if self.layer_hook is not None:
                self.layer_hook(plan, layer)
            for ci, chunk in enumerate(prep.chunks):
                for run in chunk:
                    self._record(prep, ci, run)
                    self.copy_run_layer(plan, run, layer)
            handle.finish_layer(layer)
        self._end(handle, TransferStatus.DONE)

    def close(self) -> None:
        """Finish queued work, then stop the workers.

        A gated plan whose layers were never all opened would wait forever:
        it is cancelled (its destination was never published).
        """
        self._closed = True
        with self._lock:
            stuck = [h for h in self._live.values() if h.num_opened < h.plan.num_layers]
        for h in stuck:
            self.cancel(h)
        for lane, t in list(self._threads.items()):
            self._queues[lane].put(None)
            t.join()
        self._threads.clear()

    def __enter__(self) -> CpuCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
