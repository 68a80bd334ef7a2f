"""A simulated PCIe link that is a real :class:`~tiered_kv.transfer.engine.CopyEngine`.

* Full duplex: device-to-host and host-to-device run at once, each at its own bandwidth.
* Each direction is a FIFO queue: a plan starts when its direction is free and
  every plan in its ``wait_for`` has finished.
* A plan takes ``bytes / bandwidth + runs * per_copy_overhead`` (coalesced runs).
* Completion is an event on the simulator's clock; the manager sees it at its
  next ``poll``.  Compute and transfers overlap; a transfer only costs time
  when a request waits for it.
* A direction with zero bandwidth is down: plans on it fail at once.
* ``failure_rate`` injects failures at completion time (seeded), for fault tests.
"""

from __future__ import annotations

import math
import random

from tiered_kv.errors import TransferError
from tiered_kv.sim.events import EventLoop
from tiered_kv.transfer.coalesce import coalesce
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus


class SimCopyEngine:
    """Transfers on simulated time.

    Attributes:
        intervals: ``(start, end, direction, bytes)`` of every plan, for hidden/exposed accounting.
    """

    def __init__(
        self,
        loop: EventLoop,
        bytes_per_block: int,
        d2h_bytes_per_s: float,
        h2d_bytes_per_s: float,
        per_copy_overhead_s: float,
        failure_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.loop = loop
        # Fault injection: each plan fails at its completion time with this probability.
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self.bytes_per_block = bytes_per_block
        self.bandwidth = {"D2H": d2h_bytes_per_s, "H2D": h2d_bytes_per_s}
        self.overhead = per_copy_overhead_s
        self.free_at = {"D2H": 0.0, "H2D": 0.0}
        self.end_of: dict[int, float] = {}
        self.intervals: list[tuple[float, float, str, int]] = []

    def submit(self, plan: TransferPlan) -> TransferHandle:
        direction = plan.direction
        nbytes = plan.num_blocks * self.bytes_per_block
        handle = TransferHandle(plan, num_bytes=nbytes)
        bw = self.bandwidth.get(direction, math.inf)
        if bw <= 0:
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {direction} link is down"))
            self.loop.log("transfer_failed", plan.plan_id)
            return handle
        runs = len(coalesce(plan.src_block_ids, plan.dst_block_ids))
        duration = (nbytes / bw if math.isfinite(bw) else 0.0) + runs * self.overhead
        now = self.loop.now
        start = max(now, self.free_at.get(direction, now), *(self.end_of.get(w, now) for w in plan.wait_for))
        end = start + duration
        self.free_at[direction] = end
        self.end_of[plan.plan_id] = end
        self.intervals.append((start, end, direction, nbytes))
        handle.status = TransferStatus.RUNNING
        handle._sim_elapsed_s = end - now  # type: ignore[attr-defined]  # reported on simulated time, not wall time
        if self.failure_rate and self._rng.random() < self.failure_rate:
            handle._injected_failure = True  # type: ignore[attr-defined]
        self.loop.schedule(end, "transfer_done", handle)
        self.loop.log("transfer_start", (plan.plan_id, plan.kind.value, direction, plan.num_blocks, round(end, 9)))
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        return False  # a simulated DMA, like a real one, is not recalled once queued

    @staticmethod
    def finish(handle: TransferHandle) -> None:
        if getattr(handle, "_injected_failure", False):
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {handle.plan.plan_id}: injected failure"))
        else:
            handle._finish(TransferStatus.DONE)
        handle.elapsed_s = handle._sim_elapsed_s  # type: ignore[attr-defined]
