"""TorchCudaCopyEngine: copies on dedicated CUDA streams, ordered with compute by events.

* Separate streams for device-to-host and host-to-device (urgent swap-ins get a
  high-priority stream of their own), so PCIe runs both directions at once and a
  swap-in never queues behind a swap-out.
* A device-to-host copy first waits on an event recorded on the compute stream
  at submission, so it never reads KV a kernel is still writing.
* Every plan records a start and an end event; its handle is an
  :class:`~tiered_kv.transfer.event_handle.EventTransferHandle` (``done()``
  polls the end event, ``wait(timeout)`` honours the timeout).
  ``make_compute_wait(handle)`` orders the compute stream after a swap-in on
  the device, with no host synchronisation.
* ``wait_for`` plans are ordered on the device too (stream waits on their events).
* Large plans are issued as chunks of bounded size so other streams' copies
  interleave with them on the copy engines.
* No ``torch.cuda.synchronize()`` anywhere.

Once issued, CUDA copies cannot be recalled, so ``cancel`` returns False.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tiered_kv import checks
from tiered_kv.errors import PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.availability import require
from tiered_kv.transfer.cudart import load_cuda_runtime
from tiered_kv.transfer.event_handle import EventTransferHandle, TorchEvents, fail_after_issued, issued_event
from tiered_kv.transfer.gated import GatedLayers, IssueJob
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.plan_events import DEFAULT_MAX_TRACKED_PLANS, PlanEvents
from tiered_kv.transfer.storage_engine import StorageEngineBase

TORCH_EVENTS = TorchEvents()


class TorchCudaCopyEngine(GatedLayers, StorageEngineBase):
    """CUDA-stream copy engine over torch tensors (GPU tier on the device, CPU tier pinned).

    Args:
        tiers: The storage of each tier.
        max_blocks_per_chunk: Chunk size (blocks).
        record: Keep every issued copy in ``trace``.
        max_tracked_plans: Plans whose end events are kept for ``wait_for`` and
            duplicate-id checks before completed ones are forgotten.
        copy_api: ``"runtime"``: one raw ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync``
            per run (:mod:`tiered_kv.transfer.cudart`); ``"torch"``: torch
            ``copy_`` calls, one per contiguous piece; ``"auto"``: the runtime
            when it loads, else torch.

    Raises:
        EngineUnavailableError: torch sees no CUDA device.
    """

    fuse_strided_runs = False  # torch copy_ path: one copy per contiguous segment, no staging

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        record: bool = False,
        max_tracked_plans: int = DEFAULT_MAX_TRACKED_PLANS,
        copy_api: str = "auto",
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        self._events = PlanEvents(TORCH_EVENTS, max_tracked_plans)
        self._gated = {}
        checks.choice("copy_api", copy_api, ("auto", "runtime", "torch"))
        require("cuda", "TorchCudaCopyEngine")
        self.runtime = load_cuda_runtime() if copy_api != "torch" else None
        if copy_api == "runtime" and self.runtime is None:
            raise TransferError("copy_api='runtime': neither cupy nor libcudart could be loaded")
        self.copy_api = "runtime" if self.runtime is not None else "torch"
        lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self.streams = {
            "h2d_urgent": torch.cuda.Stream(priority=hi),
            "h2d": torch.cuda.Stream(priority=lo),
            "d2h": torch.cuda.Stream(priority=lo),
            "local": torch.cuda.Stream(priority=lo),
        }

    @property
    def max_tracked_plans(self) -> int:
        """Plans whose end events are kept before completed ones are forgotten."""
        return self._events.limit

    @property
    def tracked_plans(self) -> int:
        """Plans whose end events the engine holds now (at most ``max_tracked_plans`` unless many are in flight)."""
        return len(self._events)

    def submit(self, plan: TransferPlan, compute_stream: torch.cuda.Stream | None = None) -> TransferHandle:
        """Issue the plan's copies on its lane's stream and return at once.

        Args:
            plan: The plan.
            compute_stream: The stream whose kernels write the KV a GPU-to-CPU
                plan reads (default: the current stream).

        Raises:
            PlanError: the plan is malformed or its id is still in flight.
            InvalidArgumentError: ``compute_stream`` is not a CUDA stream.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if compute_stream is not None:
            checks.instance("compute_stream", compute_stream, torch.cuda.Stream)
        prep = self.prepare(plan)
        if self._events.in_flight(plan.plan_id) or plan.plan_id in self._gated:
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        stream = self.streams[prep.lane]
        handle = EventTransferHandle(plan, num_bytes=prep.num_bytes)
        job = IssueJob(prep, stream, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        issued = False  # whether copies may be on the stream
        try:
            if plan.src_medium == "GPU" and not plan.gated:  # a gated plan orders each layer itself
                self._order_after_compute(job, compute_stream)  # never read KV that compute is still writing
            for w in plan.wait_for:
                ev = self._events.get(w)
                if ev is not None:
                    stream.wait_event(ev)
            job.start.record(stream)
            if plan.gated:
                return self._hold(handle, job)
            issued = True
            if plan.num_layers:
                for layer in range(plan.num_layers):
                    self._issue_layer(job, layer)
            else:
                self._issue_whole(job)
        except Exception as exc:
            if issued:
                self._fail_issue(handle, job, exc)
            else:
                handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        self._end_issue(handle, job)
        return handle

    def _issue_whole(self, job: IssueJob) -> None:
        prep, stream = job.prep, job.stream
        plan, runtime, raw = prep.plan, self.runtime, stream.cuda_stream
        with torch.cuda.stream(stream):
            for ci, chunk in enumerate(prep.chunks):
                for run in chunk:
                    self._record(prep, ci, run)
                    if runtime is not None:
                        self.copy_run_raw(runtime, plan, run, raw)
                    else:
                        self.copy_run(plan, run, non_blocking=True)

    def _issue_layer(self, job: IssueJob, layer: int) -> None:
        """Every run's layer ``layer``, then an event compute on that layer may wait for."""
        prep, stream = job.prep, job.stream
        plan, runtime, raw = prep.plan, self.runtime, stream.cuda_stream
        with torch.cuda.stream(stream):
            for ci, chunk in enumerate(prep.chunks):
                for run in chunk:
                    self._record(prep, ci, run)
                    if runtime is not None:
                        self.copy_run_layer_raw(runtime, plan, run, layer, raw)
                    else:
                        self.copy_run_layer(plan, run, layer, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        job.layer_events.append(ev)

    def _order_after_compute(self, job: IssueJob, compute_stream: object) -> None:
        if compute_stream is not None:
            checks.instance("stream", compute_stream, torch.cuda.Stream)
        ready = torch.cuda.Event()
        ready.record(compute_stream or torch.cuda.current_stream())
        job.stream.wait_event(ready)

    def _end_issue(self, handle: EventTransferHandle, job: IssueJob) -> None:
        job.end.record(job.stream)
        handle.attach(TORCH_EVENTS, job.start, job.end, tuple(job.layer_events))
        self._events.add(handle.plan.plan_id, job.end)

    def _fail_issue(self, handle: EventTransferHandle, job: IssueJob, exc: BaseException) -> None:
        if not fail_after_issued(handle, TORCH_EVENTS, job.stream, job.start, job.end, job.layer_events, exc):
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {handle.plan.plan_id}: {exc}"))

    def close(self) -> None:
        """Wait for every plan still in flight (teardown only: a host wait, never in a serving step)."""
        self._abandon_gated()
        self._events.wait_all()

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: False, except for a gated plan none of whose layers opened."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return self._cancel_gated(handle)

    def make_compute_wait(
        self, handle: TransferHandle, stream: torch.cuda.Stream | None = None, layer: int | None = None
    ) -> None:
        """Order ``stream`` (default: current) after the plan, or after one of its layers, on the device.

        The host does not block.  ``layer``: wait only for that layer of a
        layer-wise plan, so compute on it overlaps the copy of later layers.

        Raises:
            PlanError: ``handle`` is not an issued plan of a CUDA engine.
            InvalidArgumentError: ``stream`` is not a CUDA stream.
        """
        end = issued_event(handle, "make_compute_wait")
        if stream is not None:
            checks.instance("stream", stream, torch.cuda.Stream)
        if layer is not None:
            end = handle.layer_event(layer)  # type: ignore[attr-defined]
        (stream or torch.cuda.current_stream()).wait_event(end)
