"""Gated plans on CUDA engines: copies issued layer by layer as compute opens each layer.

A prefill's KV can be stored while its forward pass is still running: the
plan is submitted before the step, and each layer's copies are issued once
the driver says compute has written that layer (``open_layer``).  The lane
stream first waits on an event recorded on the compute stream, so the copy
reads the layer only after the kernels that wrote it, and the host never
waits.  The handle becomes an ordinary event handle once its last layer is
issued.

Both CUDA engines (torch and cupy) share this; each supplies how to order a
stream after compute, issue one layer, and finish or fail the issue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.transfer.event_handle import EventTransferHandle
from tiered_kv.transfer.plan import TransferHandle, TransferStatus
from tiered_kv.transfer.storage_engine import PreparedPlan


@dataclass(slots=True)
class IssueJob:
    """One plan being issued: its prepared runs, lane stream, events and the layer events so far."""

    prep: PreparedPlan
    stream: Any
    start: Any
    end: Any
    layer_events: list[Any] = field(default_factory=list)


class GatedLayers:
    """Mixin: keeps gated plans until compute opens their layers, then issues them."""

    _gated: dict[int, tuple[EventTransferHandle, IssueJob]]

    # Engine hooks ------------------------------------------------------------------------
    def _order_after_compute(self, job: IssueJob, compute_stream: object) -> None:
        raise NotImplementedError

    def _issue_layer(self, job: IssueJob, layer: int) -> None:
        raise NotImplementedError

    def _end_issue(self, handle: EventTransferHandle, job: IssueJob) -> None:
        raise NotImplementedError

    def _fail_issue(self, handle: EventTransferHandle, job: IssueJob, exc: BaseException) -> None:
        raise NotImplementedError

    # --------------------------------------------------------------------------------------
    def _hold(self, handle: EventTransferHandle, job: IssueJob) -> EventTransferHandle:
        """Keep a gated plan; nothing of it is issued until its first layer opens."""
        handle._start()
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
        handle._finish(TransferStatus.CANCELLED, TransferError(f"plan {handle.plan.plan_id}: cancelled"))
        return True

    def _abandon_gated(self) -> None:
        """At close: cancel gated plans never opened; fail partly opened ones once what was issued ends."""
        for handle, job in list(self._gated.values()):
            if not self._cancel_gated(handle):
                self._drop(handle)
                self._fail_issue(handle, job, TransferError("engine closed before every layer was opened"))
