"""TorchCudaCopyEngine: copies on dedicated CUDA streams, ordered with compute by events.

* Separate streams for device-to-host and host-to-device (urgent swap-ins get a
  high-priority stream of their own), so PCIe runs both directions at once and a
  swap-in never queues behind a swap-out.
* A device-to-host copy first waits on an event recorded on the compute stream
  at submission, so it never reads KV a kernel is still writing.
* Every plan records an event; ``handle.done()`` polls it and ``wait()``
  synchronises on it.  ``make_compute_wait(handle)`` orders the compute stream
  after a swap-in on the device, with no host synchronisation.
* ``wait_for`` plans are ordered on the device too (stream waits on their events).
* Large plans are issued as chunks of bounded size so other streams' copies
  interleave with them on the copy engines.
* No ``torch.cuda.synchronize()`` anywhere.

Once issued, CUDA copies cannot be recalled, so ``cancel`` returns False.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.storage_engine import StorageEngineBase


class CudaTransferHandle(TransferHandle):
    """A handle whose completion is a CUDA event."""

    def attach(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start_ev = start
        self._end_ev = end
        self.status = TransferStatus.RUNNING

    @property
    def event(self) -> torch.cuda.Event:
        return self._end_ev

    def done(self) -> bool:
        if not self._event.is_set() and self._end_ev.query():
            self._settle()
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._event.is_set():
            self._end_ev.synchronize()
            self._settle()
        return self.ok

    def _settle(self) -> None:
        self._finish(TransferStatus.DONE)
        self.elapsed_s = self._start_ev.elapsed_time(self._end_ev) / 1000.0


class TorchCudaCopyEngine(StorageEngineBase):
    """CUDA-stream copy engine over torch tensors (GPU tier on the device, CPU tier pinned)."""

    fuse_strided_runs = False  # one cudaMemcpyAsync per contiguous segment, no staging

    def __init__(self, tiers: Mapping[str, KVStorage], max_blocks_per_chunk: int = 64, record: bool = False) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        if not torch.cuda.is_available():
            raise TransferError("TorchCudaCopyEngine needs CUDA")
        lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self.streams = {
            "h2d_urgent": torch.cuda.Stream(priority=hi),
            "h2d": torch.cuda.Stream(priority=lo),
            "d2h": torch.cuda.Stream(priority=lo),
            "local": torch.cuda.Stream(priority=lo),
        }
        self._events: dict[int, torch.cuda.Event] = {}

    def submit(self, plan: TransferPlan, compute_stream: torch.cuda.Stream | None = None) -> TransferHandle:
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        prep = self.prepare(plan)
        if plan.plan_id in self._events and not self._events[plan.plan_id].query():
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        stream = self.streams[prep.lane]
        handle = CudaTransferHandle(plan, num_bytes=prep.num_bytes)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        try:
            if plan.src_medium == "GPU":
                # Never read KV that compute is still writing.
                ready = torch.cuda.Event()
                ready.record(compute_stream or torch.cuda.current_stream())
                stream.wait_event(ready)
            for w in plan.wait_for:
                ev = self._events.get(w)
                if ev is not None:
                    stream.wait_event(ev)
            start.record(stream)
            with torch.cuda.stream(stream):
                for ci, chunk in enumerate(prep.chunks):
                    for run in chunk:
                        self._record(prep, ci, run)
                        self.copy_run(plan, run, non_blocking=True)
            end.record(stream)
        except Exception as exc:
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        handle.attach(start, end)
        self._events[plan.plan_id] = end
        if len(self._events) > 4096:  # forget completed plans
            self._events = {k: e for k, e in self._events.items() if not e.query()}
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: always False (after checking the argument)."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return False

    def make_compute_wait(self, handle: TransferHandle, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: current) after the plan on the device; the host does not block."""
        (stream or torch.cuda.current_stream()).wait_event(handle.event)  # type: ignore[attr-defined]
