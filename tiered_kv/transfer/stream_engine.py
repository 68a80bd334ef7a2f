"""StreamCopyEngine: how both CUDA engines (torch streams, cupy streams) issue a plan.

The torch and the cupy engine differ only in the library they speak: how an
event or a stream is made and named, and how one run is copied.  Everything
else is here, once:

* **lanes**: each lane (:data:`~tiered_kv.transfer.storage_engine.LANES`) has
  its own stream, so PCIe runs both directions at once and a swap-in never
  queues behind a swap-out;
* **never read KV compute is still writing**: a device-to-host plan first makes
  its stream wait for an event recorded on the compute stream(s) at submission;
* **events, not host waits**: every plan records a start and an end event; its
  handle is an :class:`~tiered_kv.transfer.event_handle.EventTransferHandle`,
  ``wait_for`` plans are ordered by stream waits on their end events (kept in a
  bounded :class:`~tiered_kv.transfer.event_handle.PlanEvents` table), and
  ``make_compute_wait`` orders compute after a plan (or one of its layers) on
  the device.  No device-wide synchronisation anywhere;
* **layer by layer**: a plan with ``num_layers`` issues every run's layer ``i``
  and then an event that compute on layer ``i`` may wait for;
* **gated plans**: a prefill's KV can be stored while its forward pass is still
  running.  The plan is submitted before the step and held; each layer's copies
  are issued once the driver says compute has written that layer
  (:meth:`StreamCopyEngine.open_layer`), after the lane stream waits on an event
  recorded on the compute stream, so the copy reads the layer only after the
  kernels that wrote it.  The handle becomes an ordinary event handle once its
  last layer is issued;
* **faults**: a plan that fails before any copy was issued fails at once; one
  that fails after some were issued fails only once they have ended
  (:func:`~tiered_kv.transfer.event_handle.fail_after_issued`), so no block is
  reused while a copy still touches it.

Once issued, CUDA copies cannot be recalled, so ``cancel`` returns False except
for a gated plan none of whose layers was opened.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.coalesce import CopyRun
from tiered_kv.transfer.event_handle import EventAPI, EventTransferHandle, PlanEvents, fail_after_issued, issued_event
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.storage_engine import PreparedPlan, StorageEngineBase

if TYPE_CHECKING:
    from tiered_kv.transfer.cuda_engine import CudaRuntime


@dataclass(slots=True)
class IssueJob:
    """One plan being issued: its prepared runs, lane stream, events and the layer events so far."""

    prep: PreparedPlan
    stream: Any
    start: Any
    end: Any
    layer_events: list[Any] = field(default_factory=list)


class StreamCopyEngine(StorageEngineBase):
    """The issuing path both CUDA engines use; a subclass supplies its library.

    A subclass's constructor sets ``_api`` (its :class:`EventAPI`), ``_events``
    (the plan-event table over it), ``streams`` (one per lane) and ``runtime``
    (the raw copy calls, or None to copy with torch ``copy_``), and implements
    :meth:`_new_event`, :meth:`_compute_streams` and :meth:`_stream_ptr`.
    """

    _api: EventAPI
    _events: PlanEvents
    streams: dict[str, Any]
    runtime: CudaRuntime | None

    def __init__(self, tiers: Mapping[str, KVStorage], max_blocks_per_chunk: int, record: bool) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        self._gated: dict[int, tuple[EventTransferHandle, IssueJob]] = {}

    # The library: what each engine supplies ------------------------------------------------
    def _new_event(self, timing: bool) -> Any:
        """A new event (with timing for a plan's start and end, without for ordering only)."""
        raise NotImplementedError

    def _compute_streams(self, name: str, given: object | None) -> list[Any]:
        """The streams whose kernels may touch the KV: ``given`` (else InvalidArgumentError), or the defaults."""
        raise NotImplementedError

    def _stream_ptr(self, stream: Any) -> int:
        """The raw ``cudaStream_t`` of one of this engine's streams."""
        raise NotImplementedError

    def _issuing(self, stream: Any) -> AbstractContextManager[object]:
        """Where copies are issued from: torch ``copy_`` calls need their stream made current."""
        return nullcontext()

    # ----------------------------------------------------------------------------------------
    @property
    def max_tracked_plans(self) -> int:
        """Plans whose end events are kept before completed ones are forgotten."""
        return self._events.limit

    @property
    def tracked_plans(self) -> int:
        """Plans whose end events the engine holds now (at most ``max_tracked_plans`` unless many are in flight)."""
        return len(self._events)

    def submit(self, plan: TransferPlan, compute_stream: object | None = None) -> TransferHandle:
        """Issue the plan's copies on its lane's stream and return at once.

        Args:
            plan: The plan.
            compute_stream: The stream whose kernels write the KV a GPU-to-CPU
                plan reads (default: the engine's current compute stream(s)).

        Raises:
            PlanError: the plan is malformed or its id is still in flight.
            InvalidArgumentError: ``compute_stream`` is not a CUDA stream.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if compute_stream is not None:
            self._compute_streams("compute_stream", compute_stream)
        prep = self.prepare(plan)
        if self._events.in_flight(plan.plan_id) or plan.plan_id in self._gated:
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        stream = self.streams[prep.lane]
        handle = EventTransferHandle(plan, num_bytes=prep.num_bytes)
        job = IssueJob(prep, stream, self._new_event(True), self._new_event(True))
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
                handle.finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        self._end_issue(handle, job)
        return handle

    def _runs(self, prep: PreparedPlan) -> Iterator[CopyRun]:
        """Every run of the plan, chunk by chunk, each recorded in ``trace`` just before it is copied."""
        for ci, chunk in enumerate(prep.chunks):
            for run in chunk:
                self._record(prep, ci, run)
                yield run

    def _copy(self, plan: TransferPlan, run: CopyRun, layer: int | None, stream: Any) -> None:
        """One run (or one layer of it) on ``stream``: raw calls when the runtime loaded, else torch ``copy_``."""
        runtime = self.runtime
        if runtime is None:
            if layer is None:
                self.copy_run(plan, run, non_blocking=True)
            else:
                self.copy_run_layer(plan, run, layer, non_blocking=True)
        elif layer is None:
            self.copy_run_raw(runtime, plan, run, self._stream_ptr(stream))
        else:
            self.copy_run_layer_raw(runtime, plan, run, layer, self._stream_ptr(stream))

    def _issue_whole(self, job: IssueJob) -> None:
        """Every run in one go: one ``cudaMemcpyAsync`` (block-contiguous) or ``cudaMemcpy2DAsync`` (layer-first)."""
        with self._issuing(job.stream):
            for run in self._runs(job.prep):
                self._copy(job.prep.plan, run, None, job.stream)

    def _issue_layer(self, job: IssueJob, layer: int) -> None:
        """Every run's layer ``layer``, then an event compute on that layer may wait for."""
        with self._issuing(job.stream):
            for run in self._runs(job.prep):
                self._copy(job.prep.plan, run, layer, job.stream)
        ev = self._new_event(False)
        ev.record(job.stream)
        job.layer_events.append(ev)

    def _order_after_compute(self, job: IssueJob, compute_stream: object | None) -> None:
        for compute in self._compute_streams("stream", compute_stream):
            ready = self._new_event(False)
            ready.record(compute)
            job.stream.wait_event(ready)

    def _end_issue(self, handle: EventTransferHandle, job: IssueJob) -> None:
        job.end.record(job.stream)
        handle.attach(self._api, job.start, job.end, tuple(job.layer_events))
        self._events.add(handle.plan.plan_id, job.end)

    def _fail_issue(self, handle: EventTransferHandle, job: IssueJob, exc: BaseException) -> None:
        if not fail_after_issued(handle, self._api, job.stream, job.start, job.end, job.layer_events, exc):
            handle.finish(TransferStatus.FAILED, TransferError(f"plan {handle.plan.plan_id}: {exc}"))

    def make_compute_wait(self, handle: TransferHandle, stream: object | None = None, layer: int | None = None) -> None:
        """Order compute after the plan (or one layer of it) on the device; the host does not block.

        Args:
            handle: A handle this engine returned.
            stream: The stream to order; default: the engine's current compute stream(s).
            layer: Wait only for this layer of a layer-wise plan, so compute on it
                overlaps the copy of later layers.

        Raises:
            PlanError: ``handle`` is not an issued plan of a CUDA engine.
            InvalidArgumentError: ``stream`` is not a CUDA stream.
        """
        end = issued_event(handle, "make_compute_wait")
        streams = self._compute_streams("stream", stream)
        if layer is not None:
            end = handle.layer_event(layer)  # type: ignore[attr-defined]
        for compute in streams:
            compute.wait_event(end)

    def close(self) -> None:
        """Wait for every plan still in flight (teardown only: a host wait, never in a serving step)."""
        self._abandon_gated()
        self._events.wait_all()

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: False, except for a gated plan none of whose layers opened."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return self._cancel_gated(handle)

    # Gated plans ------------------------------------------------------------------------------
    def _hold(self, handle: EventTransferHandle, job: IssueJob) -> EventTransferHandle:
        """Keep a gated plan; nothing of it is issued until its first layer opens."""
        handle.mark_running()
        self._gated[handle.plan.plan_id] = (handle, job)
        return handle

    def open_layer(self, handle: TransferHandle, layer: int, stream: object = None) -> None:
        """Compute has written layer ``layer`` of a gated plan's source: issue that layer's copies.

        The lane stream waits on an event recorded now on ``stream`` (default:
        the current stream), so the copy follows the kernels that wrote the
        layer; the host does not wait.  A plan that already failed ignores
        further opens.

        Raises:
            PlanError: not a handle, not a gated plan of this engine, or not the next layer.
        """
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"open_layer() takes a TransferHandle, got {type(handle).__name__}")
        entry = self._gated.get(handle.plan.plan_id)
        if entry is None or entry[0] is not handle:
            if handle.done() and handle.plan.gated:
                return
            handle._check_open(layer)
            raise PlanError(f"plan {handle.plan.plan_id} is not a gated plan waiting in this engine")
        handle._check_open(layer)
        job = entry[1]
        try:
            self._order_after_compute(job, stream)
            self._issue_layer(job, layer)
        except Exception as exc:
            self._drop(handle)
            self._fail_issue(handle, job, exc)
            return
        handle._open(layer)
        if handle.num_opened == handle.plan.num_layers:
            del self._gated[handle.plan.plan_id]
            self._end_issue(handle, job)

    def _drop(self, handle: TransferHandle) -> None:
        self._gated.pop(handle.plan.plan_id, None)
        for i in range(handle.num_opened, handle.plan.num_layers):
            handle._open(i)

    def _cancel_gated(self, handle: TransferHandle) -> bool:
        """Cancel a gated plan none of whose layers was issued; False otherwise."""
        entry = self._gated.get(handle.plan.plan_id)
        if entry is None or entry[0] is not handle or handle.num_opened:
            return False
        self._drop(handle)
        handle.finish(TransferStatus.CANCELLED, TransferError(f"plan {handle.plan.plan_id}: cancelled"))
        return True

    def _abandon_gated(self) -> None:
        """At close: cancel gated plans never opened; fail partly opened ones once what was issued ends."""
        for handle, job in list(self._gated.values()):
            if not self._cancel_gated(handle):
                self._drop(handle)
                self._fail_issue(handle, job, TransferError("engine closed before every layer was opened"))
