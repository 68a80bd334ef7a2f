"""What one scheduling step decided."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from tiered_kv.core.request import Request
from tiered_kv.manager.states import PreemptMode
from tiered_kv.transfer.plan import TransferHandle


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch and what happened around it.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` to compute this step, in order.
            Their KV is on the GPU and no copy writes it, except for the
            requests in ``loads``.
        num_tokens: Sum of ``num_new_tokens``.
        recomputed_tokens: Tokens of the batch computed before and computed
            again because their KV was dropped by a recompute preemption.
        recomputed: The same, by request (only requests with such tokens):
            the scheduler keeps each recompute victim's high-water mark, and
            a driver that counts per request reads it here.
        preempted / resumed / admitted: Request ids, in the order it happened.
        loads: Scheduled requests whose KV is still landing layer by layer
            (layer-wise swap-in): before computing layer ``i`` of such a
            request, wait for layer ``i`` of its handle (``wait_layer``, or on
            a CUDA engine ``make_compute_wait(handle, layer=i)``).  If the load
            fails, :meth:`Scheduler.update` discards that request's step.
        saves: Scheduled requests whose prompt blocks completed this step are
            stored layer by layer as the step computes them (layer-wise
            write-through): after computing layer ``i`` of such a request,
            open it (``open_layer(handle, i)`` on the copy engine).
            :meth:`Scheduler.update` opens any layer the driver did not.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_tokens: int = 0
    recomputed_tokens: int = 0
    recomputed: dict[Hashable, int] = field(default_factory=dict)
    preempted: list[tuple[Hashable, PreemptMode]] = field(default_factory=list)
    resumed: list[Hashable] = field(default_factory=list)
    admitted: list[Hashable] = field(default_factory=list)
    loads: dict[Hashable, TransferHandle] = field(default_factory=dict)
    saves: dict[Hashable, TransferHandle] = field(default_factory=dict)

    def needs_sample(self, request: Request, num_new_tokens: int) -> bool:
        """Whether computing these tokens reaches the end of the request's known tokens (a token is sampled)."""
        return request.num_computed_tokens + num_new_tokens == request.num_tokens
