"""Settling of copies: a final copy changes where its request's KV is, and is counted.

Copies complete on the engine's side; the manager learns of them only here,
at ``poll`` (every final copy, in plan order), ``process_completion`` (one now)
or ``cancel``.  A landed copy hands its blocks on; a failed or cancelled one is
rolled back so the KV stays where it was.  Part of
:class:`~tiered_kv.manager.TierManager` (see :mod:`.manager_state`).
"""

from __future__ import annotations

from collections.abc import Hashable

from tiered_kv import checks
from tiered_kv.manager.guard import exclusive
from tiered_kv.manager.manager_state import ManagerState
from tiered_kv.manager.outcomes import Completion
from tiered_kv.manager.states import Residency
from tiered_kv.manager.transfers import Transfer
from tiered_kv.transfer.plan import PlanKind, TransferHandle


class Settling(ManagerState):
    """Settles final copies: each changes where its request's KV is, or is rolled back."""

    @exclusive
    def poll(self) -> list[Completion]:
        """Settle every copy whose handle is final, in plan order; return what settled.

        With on-evict offload it then tops up the saves before eviction: once
        per scheduler step is often enough.
        """
        done = [c for t in self.transfers.finished() if (c := self._settle(t)) is not None]
        self._drain_events()
        if self.offload == "on_evict":
            assert self._off is not None
            self._off.save_window(self.evict_window)
        if self._lower is not None:
            self._lower.tick()
        return done

    @exclusive
    def process_completion(self, handle: TransferHandle) -> Completion:
        """Settle one final handle now (instead of at the next ``poll``).

        Raises:
            PlanError: unknown, settled already, not final, not the plan this
                manager emitted under its id, or a move between tiers below the
                GPU that ``poll`` settles.  Nothing changes.
        """
        c = self._settle(self.transfers.take(checks.instance("handle", handle, TransferHandle)))
        assert c is not None, "only moves of the tiers below the GPU settle silently"
        return c

    @exclusive
    def cancel(self, request_id: Hashable) -> bool:
        """Cancel the request's copy in flight; True only if it was cancelled, and then it is rolled back now.

        A copy the engine finished first is left for ``poll`` to settle as what
        it is, and the answer is False.
        """
        h = self._get(request_id)
        if h.plan_id is None:
            return False
        self.transfers.cancel(h.plan_id)
        t = self.transfers.get(h.plan_id)
        assert t is not None
        if not t.cancelled:
            return False
        self._settle(self.transfers.take(t.handle))
        return True

    @exclusive
    def wait(self, timeout: float | None = None) -> bool:
        """Block until some copy in flight is final (real engines); False if nothing is in flight."""
        return self.transfers.wait(checks.timeout("timeout", timeout))

    def _settle(self, t: Transfer) -> Completion | None:
        if self._lower is not None and self._lower.owns(t):
            return self._settle_staged(t)
        kind, rid = t.plan.kind, t.plan.request_id
        ok, n_tok = t.ok, 0
        if kind is PlanKind.OFFLOAD:
            self._off.settle_store(t)  # type: ignore[union-attr]
        else:
            h = self._held[rid]
            h.plan_id, h.layered = None, False
            swap = self._swap
            if kind is PlanKind.ONBOARD:
                n_tok = self._off.settle_load(h.request, t)  # type: ignore[union-attr]
                new = Residency.GPU if ok else None  # a failed load leaves nothing: recompute from scratch
            elif kind is PlanKind.SWAP_OUT:
                h.swapped = swap.settle_out(t)  # type: ignore[union-attr]
                ok = h.swapped is not None  # landed but the KV is not whole on the CPU: rolled back
                new, h.num_stored_blocks = (Residency.CPU if ok else Residency.GPU), 0
            else:
                ok = swap.settle_in(h.request, t)  # type: ignore[union-attr]
                n_tok, new = (h.swapped.num_tokens, Residency.GPU) if ok else (0, Residency.CPU)  # type: ignore[union-attr]
                h.swapped = None if ok else h.swapped
            if new is None:
                del self._held[rid]
            else:
                h.residency = new
        n = t.plan.num_blocks
        self.counters.count_copy(kind, n, n * self.cost_model.bytes_per_block, ok, t.cancelled)
        res = self._held[rid].residency if rid in self._held else None
        return Completion(t.plan.plan_id, rid, kind, ok, n_tok, res, t.handle.num_bytes, t.handle.elapsed_s)

    def _settle_staged(self, t: Transfer) -> Completion | None:
        """A move of the chain settled; the last staging move of a load starts its GPU copy, or ends the load."""
        out = self._lower.settle(t)  # type: ignore[union-attr]
        if out is None:
            return None
        rid, gpu_copy = out
        h = self._held[rid]
        if gpu_copy is not None:
            h.plan_id = gpu_copy.plan.plan_id
            return None
        h.residency = Residency.GPU  # nothing landed: the request computes all of it, keeping its GPU hits
        return Completion(t.plan.plan_id, rid, PlanKind.ONBOARD, True, 0, Residency.GPU)

    def _drain_events(self) -> None:
        """GPU evictions since the last poll join the counters here (the pool never calls up).

        The pool counts them itself (``num_evicted_blocks``), so the manager keeps the
        pool's events off: building a ``BlockStored`` per cached range and a
        ``BlockRemoved`` per eviction only to count the latter cost more than the count.
        """
        n = self.gpu.block_pool.num_evicted_blocks
        self.counters.gpu_blocks_evicted += n - self._gpu_evicted_seen
        self._gpu_evicted_seen = n
