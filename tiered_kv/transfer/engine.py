"""The copy-engine interface every backend implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tiered_kv.transfer.plan import TransferHandle, TransferPlan


@runtime_checkable
class CopyEngine(Protocol):
    """Executes transfer plans asynchronously.

    ``submit`` validates the plan (raising :class:`~tiered_kv.errors.PlanError`
    before anything is copied) and returns at once with a handle.  ``cancel``
    stops a plan that has not finished; a cancelled or failed plan never leaves
    a partially written destination that the caller could mistake for data.
    """

    def submit(self, plan: TransferPlan) -> TransferHandle: ...

    def cancel(self, handle: TransferHandle) -> bool: ...


@runtime_checkable
class GatedCopyEngine(CopyEngine, Protocol):
    """A copy engine that can gate a plan's layers: layer ``i`` of a gated plan is copied once opened.

    Compute opens a layer (``open_layer``) right after it has written it, so a
    store of a prefill overlaps the rest of the forward pass.
    """

    def open_layer(self, handle: TransferHandle, layer: int, stream: object = None) -> None: ...
