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
from tiered_kv.transfer.coalesce import CopyRun
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.storage_engine import LANES, PreparedPlan, StorageEngineBase


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
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record, copy_hook)
        self._queues: dict[str, queue.Queue] = {lane: queue.Queue() for lane in LANES}
        self._threads: dict[str, threading.Thread] = {}
        self._live: dict[int, TransferHandle] = {}
        self._cancel: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, plan: TransferPlan) -> TransferHandle:
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
        """Cancel if not final: at once when still queued, else at the next chunk boundary."""
        if handle.done():
            return False
        if handle._cancel_if_pending(TransferError(f"plan {handle.plan.plan_id}: cancelled")):
            self._forget(handle.plan.plan_id)
            return True
        with self._lock:  # running: the worker stops at the next chunk boundary
            self._cancel.add(handle.plan.plan_id)
        return True

    def _forget(self, plan_id: int) -> None:
        with self._lock:
            self._live.pop(plan_id, None)
            self._cancel.discard(plan_id)

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
        if not handle._start():
            return  # cancelled while queued
        try:
            for ci, chunk in enumerate(prep.chunks):
                if plan.plan_id in self._cancel:
                    handle._finish(TransferStatus.CANCELLED, TransferError(f"plan {plan.plan_id}: cancelled"))
                    return
                for run in chunk:
                    self._record(prep, ci, run)
                    self.copy_run(plan, run)
            handle._finish(TransferStatus.DONE)
        except Exception as exc:  # any copy failure fails the plan; the source is only read
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
        finally:
            self._forget(plan.plan_id)

    def close(self) -> None:
        """Finish queued work, then stop the workers."""
        self._closed = True
        for lane, t in list(self._threads.items()):
            self._queues[lane].put(None)
            t.join()
        self._threads.clear()

    def __enter__(self) -> CpuCopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
