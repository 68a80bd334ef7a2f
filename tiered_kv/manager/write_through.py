"""Write-through of computed prompt blocks to the CPU store, whole or layer by layer.

With ``offload="write_through"`` every full prompt block is stored on the CPU
once it is computed, so a later request with the same prefix loads it instead
of computing it again.  A layer-wise store overlaps the rest of the forward
pass.  Part of :class:`~tiered_kv.manager.TierManager` (see :mod:`.manager_state`).
"""

from __future__ import annotations

from collections.abc import Hashable

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.manager_state import ManagerState
from tiered_kv.manager.states import Residency
from tiered_kv.transfer.plan import TransferHandle, TransferPlan


class WriteThrough(ManagerState):
    """Stores of a request's computed prompt blocks to the CPU store (write-through), whole or layer by layer."""

    @exclusive
    def on_tokens_computed(self, request_id: Hashable) -> TransferPlan | None:
        """The step that computed the request's tokens finished: with write-through, store its new full prompt blocks.

        Only steps that computed prompt tokens can complete such blocks, so a
        scheduler may skip the call on decode steps.
        """
        h = self._get(request_id, Residency.GPU)
        if self.offload != "write_through":
            return None
        req = h.request
        upto = min(req.num_computed_tokens, req.num_prompt_tokens) // self.block_size
        if upto <= h.num_stored_blocks:
            return None
        assert self._off is not None
        t = self._off.write_through(req, h.num_stored_blocks, upto)
        h.num_stored_blocks = upto
        return t.plan if t is not None else None

    @exclusive
    def start_layerwise_store(self, request_id: Hashable, num_tokens_after_step: int) -> TransferPlan | None:
        """Write-through, layer by layer: store the prompt blocks the coming step completes as it computes them.

        Called before the step.  The plan is gated: layer ``i`` is copied
        only after the driver opens it (``open_layer``) once compute has
        written it, so the store overlaps the rest of the forward pass, as
        LMCache and SGLang's HiCache store a prefill.  ``None`` when nothing
        is to be stored, write-through is off, or the copy engine cannot gate.
        The later ``on_tokens_computed`` does not store these blocks again.
        """
        h = self._get(request_id, Residency.GPU)
        req = h.request
        checks.count("num_tokens_after_step", num_tokens_after_step, req.num_computed_tokens)
        if num_tokens_after_step > len(req.all_token_ids):
            raise InvalidArgumentError(
                f"num_tokens_after_step {num_tokens_after_step} exceeds request {request_id!r}'s "
                f"{len(req.all_token_ids)} tokens"
            )
        if self.offload != "write_through" or not self.num_layers:
            return None
        if not callable(getattr(self.transfers.engine, "open_layer", None)):
            return None
        upto = min(num_tokens_after_step, req.num_prompt_tokens) // self.block_size
        if upto <= h.num_stored_blocks:
            return None
        assert self._off is not None
        t = self._off.write_through(req, h.num_stored_blocks, upto, gated_layers=self.num_layers)
        h.num_stored_blocks = upto
        return t.plan if t is not None else None

    @exclusive
    def open_all_layers(self, handle: TransferHandle) -> None:
        """Open every layer of a gated store the driver has not opened (its step's compute is done)."""
        checks.instance("handle", handle, TransferHandle)
        for layer in range(handle.num_opened, handle.plan.num_layers):
            self.transfers.engine.open_layer(handle, layer)  # type: ignore[attr-defined]
