"""A copy engine whose completions the caller controls: public, for users who test their loop.

It is the package's only test double, kept in the package because a user needs it: code
built on :class:`~tiered_kv.manager.TierManager` that must be tested against faults (a copy
that fails, is cancelled, or lands out of order) or must repeat a run exactly needs an engine
that finishes nothing by itself (``docs/library.md``).  The simulator does not use it: its copy
engine is ``tiered_kv.sim.link.SimLink``, timed by a link model.

Nothing completes by itself: the caller completes, fails, cancels or reorders
plans explicitly.  An optional ``on_complete`` callback performs the actual
copy at completion time (tests use it to move real bytes), so fault tests can
check that a failed plan never touched its destination.
"""

from __future__ import annotations

from collections.abc import Callable

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus


class ControlledCopyEngine:
    """Handles stay pending until :meth:`complete`, :meth:`fail` or :meth:`cancel`.

    Args:
        num_blocks: ``{"GPU": n, "CPU": m}`` pool sizes for plan validation.
        bytes_per_block: Reported in handles.
        on_complete: Called with the plan just before it is marked done.
        on_complete_layer: Called with ``(plan, layer)`` as each layer of a
            layer-wise plan lands (``complete_layer``, or ``complete`` for the
            layers still missing).
    """

    def __init__(
        self,
        num_blocks: dict[str, int] | None = None,
        bytes_per_block: int = 0,
        on_complete: Callable[[TransferPlan], None] | None = None,
        on_complete_layer: Callable[[TransferPlan, int], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block
        self.on_complete = on_complete
        self.on_complete_layer = on_complete_layer
        self.pending: dict[int, TransferHandle] = {}
        self.submitted: list[TransferPlan] = []

    def submit(self, plan: TransferPlan) -> TransferHandle:
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if self.num_blocks is not None:
            plan.validate(self.num_blocks[plan.src_medium], self.num_blocks[plan.dst_medium])
        if plan.plan_id in self.pending:
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        handle = TransferHandle(plan, num_bytes=plan.num_blocks * self.bytes_per_block)
        self.pending[plan.plan_id] = handle
        self.submitted.append(plan)
        return handle

    def tier_sizes(self) -> dict[str, int] | None:
        """Medium name -> blocks that plans are validated against (``None``: plans are not validated)."""
        return dict(self.num_blocks) if self.num_blocks is not None else None

    def pending_ids(self) -> list[int]:
        """Plan ids not yet final, in submission order."""
        return list(self.pending)

    def _take(self, plan_id: int) -> TransferHandle:
        try:
            return self.pending.pop(plan_id)
        except KeyError:
            raise PlanError(f"plan {plan_id} is not pending in this engine") from None

    def complete(self, plan_id: int) -> TransferHandle:
        """Finish a plan successfully (running ``on_complete`` first).

        A plan whose ``wait_for`` plans are still pending cannot complete: a real
        engine orders it after them, so the test must complete those first.
        """
        pending = self.pending.get(plan_id)
        if pending is not None:
            self._check_unblocked(pending)
            if pending.num_opened < pending.plan.num_layers:
                raise PlanError(
                    f"plan {plan_id} is gated and layer {pending.num_opened} is not opened: "
                    "its source is not written yet, so it cannot be copied"
                )
        handle = self._take(plan_id)
        handle.mark_running()
        for layer in range(handle.plan.num_layers):
            if not handle.layer_done(layer):
                self._land_layer(handle, layer)
        if self.on_complete is not None:
            self.on_complete(handle.plan)
        handle.finish(TransferStatus.DONE)
        return handle

    def complete_layer(self, plan_id: int, layer: int) -> TransferHandle:
        """Land one layer of a layer-wise plan (any order); the plan stays pending until ``complete``."""
        handle = self.pending.get(plan_id)
        if handle is None:
            raise PlanError(f"plan {plan_id} is not pending in this engine")
        if not 0 <= layer < handle.plan.num_layers:
            raise PlanError(f"plan {plan_id} has no layer {layer} (it has {handle.plan.num_layers})")
        self._check_unblocked(handle)
        if layer >= handle.num_opened:
            raise PlanError(f"plan {plan_id}: layer {layer} is not opened yet (its source is not written)")
        handle.mark_running()
        self._land_layer(handle, layer)
        return handle

    def open_layer(self, handle: TransferHandle, layer: int, stream: object = None) -> None:
        """Compute finished layer ``layer`` of a gated plan; the test may now land it."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"open_layer() takes a TransferHandle, got {type(handle).__name__}")
        if handle.done():
            return
        handle._check_open(layer)
        handle._open(layer)

    def _check_unblocked(self, handle: TransferHandle) -> None:
        blocked = [w for w in handle.plan.wait_for if w in self.pending]
        if blocked:
            raise PlanError(f"plan {handle.plan.plan_id} must wait for plan(s) {blocked} to finish first")

    def _land_layer(self, handle: TransferHandle, layer: int) -> None:
        if self.on_complete_layer is not None:
            self.on_complete_layer(handle.plan, layer)
        handle.finish_layer(layer)

    def fail(self, plan_id: int, reason: str = "injected failure") -> TransferHandle:
        handle = self._take(plan_id)
        handle.finish(TransferStatus.FAILED, TransferError(f"plan {plan_id}: {reason}"))
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        """Cancel a plan still pending here; True exactly when the handle is now CANCELLED.

        A layer-wise plan some of whose layers landed (``complete_layer``) is
        between two layers, where a real engine stops a cancelled plan: it ends
        CANCELLED too, never left started with nobody to finish it, and its
        destination must not be read (the manager rolls the copy back).
        """
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        if self.pending.get(handle.plan.plan_id) is not handle:
            return False
        self.pending.pop(handle.plan.plan_id)
        error = TransferError(f"plan {handle.plan.plan_id}: cancelled")
        return handle.cancel_if_pending(error) or handle.finish(TransferStatus.CANCELLED, error)

    def complete_all(self) -> list[TransferHandle]:
        """Complete every pending plan in submission order (gated plans with unopened layers stay pending)."""
        ready = [pid for pid, h in self.pending.items() if h.num_opened == h.plan.num_layers]
        return [self.complete(pid) for pid in ready]

    def complete_in_order(self, plan_ids: list[int]) -> list[TransferHandle]:
        """Complete the given plans in the given (possibly reordered) order."""
        return [self.complete(pid) for pid in plan_ids]
