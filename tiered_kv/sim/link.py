"""A simulated host link and copy engine that is a real :class:`~tiered_kv.transfer.engine.CopyEngine`.

What a copy costs:

* A plan is issued as *copies*: one per coalesced run of blocks in the
  block-contiguous layout, or one per run, layer and K/V half in the
  layer-first layout (vLLM v0 kept one tensor per layer and called
  ``cudaMemcpyAsync`` once per block per layer per K/V: ``coalesce=False``).
* A plan of ``k`` copies and ``b`` bytes takes ``k * per_copy + b / bw`` on
  its own, so a plan of tiny copies reaches a fraction of the bandwidth; that
  is why layout and block size matter.
* Each direction is a FIFO queue with its own one-way bandwidth.  While both
  directions move data, together they get at most the bidirectional cap (the
  total, not twice one way), shared in proportion to their one-way rates; the
  plans in flight slow down, and their completions move, as the other
  direction starts and stops (a fluid model, recomputed at every change).
* A direction with zero bandwidth is down: plans on it fail at once.

How copies interfere with compute (``mode``):

* ``async``: dedicated copy engines.  Copies overlap compute; a request waits
  only for its own data (the scheduler runs it once its swap-in has landed).
* ``blocking``: vLLM v0.  Copies are issued before the step on the compute
  stream, so the step starts only when every copy issued so far has finished
  (:meth:`SimLink.idle_at`).
* ``layerwise``: swap-ins and prefix loads are ordered before the forward
  pass that reads them and overlap it layer by layer: the handle is final at
  once (compute is ordered after the copy on the device), the request runs in
  the next step, and that step's layer ``i`` waits for the copy's layer ``i``
  (:meth:`SimLink.layerwise_end`).  Copies to the host stay asynchronous.

Completion is an event on the simulator's clock; the manager sees it at its
next ``poll``.  ``failure_rate`` injects failures (seeded), for fault tests.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError, TransferError
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.profiles import LinkProfile
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan, TransferStatus

MODES = ("async", "blocking", "layerwise")
LAYOUTS = ("block_contiguous", "layer_first")
H2D, D2H = "H2D", "D2H"
_EARLY_KINDS = (PlanKind.SWAP_IN, PlanKind.ONBOARD)


@dataclass(frozen=True, slots=True)
class CopyGeometry:
    """How a plan's blocks become copies.

    Attributes:
        bytes_per_block: KV bytes of one block (all layers, K and V).
        num_layers: Layers of the model (the layer-first layout copies each separately).
        layout: ``block_contiguous`` (a block is one region) or ``layer_first``
            (a block is ``2 * num_layers`` regions, one per layer and K/V).
        coalesce: Merge runs of consecutive block ids (in source and
            destination) into one copy; vLLM v0 did not.
    """

    bytes_per_block: int
    num_layers: int
    layout: str = "block_contiguous"
    coalesce: bool = True

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def pieces_per_block(self) -> int:
        return 2 * self.num_layers if self.layout == "layer_first" else 1

    def num_copies(self, src: tuple[int, ...], dst: tuple[int, ...]) -> int:
        """Copies a plan from ``src`` to ``dst`` block ids is issued as."""
        n = len(src)
        if n == 0:
            return 0
        if self.coalesce:
            runs = 1
            for i in range(1, n):
                if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
                    runs += 1
        else:
            runs = n
        return runs * self.pieces_per_block


@dataclass(slots=True, eq=False)
class CopyJob:
    """One plan on the link.

    Attributes:
        solo_s: Duration alone on the link: ``copies * per_copy + bytes / bw``.
        shared_s: Duration if the other direction were busy throughout.
        remaining_s: Work left, in seconds of running alone.
        start / end: When it started and finished moving (``-1`` until then).
        early: Final before its bytes moved (layerwise swap-ins and loads).
    """

    handle: TransferHandle
    direction: str
    nbytes: int
    copies: int
    solo_s: float
    shared_s: float
    remaining_s: float
    deps: tuple[int, ...] = ()
    submitted: float = 0.0
    start: float = -1.0
    end: float = -1.0
    rate: float = 1.0
    version: int = 0
    early: bool = False
    fail: bool = False

    @property
    def plan(self) -> TransferPlan:
        return self.handle.plan


class SimLink:
    """Transfers on simulated time (the simulator's copy engine).

    Attributes:
        intervals: ``(start, end, direction, bytes)`` of every finished plan.
        jobs: Every plan that used the link, in submission order (for timelines).
        on_submit: Called with each new job (the simulator's per-request accounting).
    """

    def __init__(
        self,
        loop: EventLoop,
        link: LinkProfile,
        geometry: CopyGeometry,
        mode: str = "async",
        failure_rate: float = 0.0,
        seed: int = 0,
        keep_jobs: bool = False,
    ) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"copy mode must be one of {MODES}, got {mode!r}")
        self.loop = loop
        self.link = link
        self.geometry = geometry
        self.mode = mode
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self.bandwidth = {H2D: link.h2d_bytes_per_s, D2H: link.d2h_bytes_per_s}
        total = link.h2d_bytes_per_s + link.d2h_bytes_per_s
        # Fraction of its one-way rate each direction keeps while both move data.
        self.share = min(1.0, link.bidir_bytes_per_s / total) if total > 0 and math.isfinite(total) else 1.0
        self.queues: dict[str, deque[CopyJob]] = {H2D: deque(), D2H: deque()}
        self.finished_plans: set[int] = set()
        self.intervals: list[tuple[float, float, str, int]] = []
        self.jobs: list[CopyJob] | None = [] if keep_jobs else None
        self.on_submit: Callable[[CopyJob], None] | None = None
        self._last = 0.0
        self._early_new: list[CopyJob] = []
        self.copies_issued = 0

    # ----------------------------------------------------------- CopyEngine
    def submit(self, plan: TransferPlan) -> TransferHandle:
        direction = plan.direction
        nbytes = plan.num_blocks * self.geometry.bytes_per_block
        handle = TransferHandle(plan, num_bytes=nbytes)
        bw = self.bandwidth.get(direction, math.inf)
        if bw <= 0:
            handle.finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {direction} link is down"))
            self.loop.log("transfer_failed", plan.plan_id)
            return handle
        copies = self.geometry.num_copies(plan.src_block_ids, plan.dst_block_ids)
        per_copy = self.link.per_copy_overhead_s
        if math.isinf(bw):
            solo = shared = copies * per_copy
        else:
            solo = copies * per_copy + nbytes / bw
            shared = copies * per_copy + nbytes / (bw * self.share)
        job = CopyJob(handle, direction, nbytes, copies, solo, shared, solo, plan.wait_for)
        job.submitted = self.loop.now
        if direction not in self.queues:
            self.queues[direction] = deque()
        handle.status = TransferStatus.RUNNING
        if self.failure_rate and self._rng.random() < self.failure_rate:
            job.fail = True
        self.copies_issued += copies
        if self.jobs is not None:
            self.jobs.append(job)
        if self.on_submit is not None:
            self.on_submit(job)
        now = self.loop.now
        self._advance(now)
        self.queues[direction].append(job)
        self._start_heads(now)
        if self.mode == "layerwise" and plan.kind in _EARLY_KINDS:
            # Ordered before the forward pass that reads it: final now, paid for in that step.
            job.early = True
            self._early_new.append(job)
            self._finish_handle(job)
        if self.loop.trace is not None:
            end = self.project().get(job, (now, now))[1]
            self.loop.log("transfer_start", (plan.plan_id, plan.kind.value, direction, plan.num_blocks, round(end, 9)))
        return handle

    def cancel(self, handle: TransferHandle) -> bool:
        return False  # a simulated DMA, like a real one, is not recalled once queued

    # ------------------------------------------------------------ the fluid
    def _advance(self, now: float) -> None:
        """Charge the running heads for the time since the last change."""
        dt = now - self._last
        if dt > 0:
            for q in self.queues.values():
                if q and q[0].start >= 0:
                    q[0].remaining_s -= dt * q[0].rate
        self._last = now

    def _ready(self, job: CopyJob) -> bool:
        return all(d in self.finished_plans for d in job.deps)

    def _start_heads(self, now: float) -> None:
        """Start waiting heads, set every head's rate, and (re)schedule their completions."""
        running = []
        for q in self.queues.values():
            if q:
                head = q[0]
                if head.start < 0 and self._ready(head):
                    head.start = now
                if head.start >= 0:
                    running.append(head)
        both = len(running) > 1 and self.share < 1.0
        for job in running:
            rate = job.solo_s / job.shared_s if both and job.shared_s > 0 else 1.0
            if rate != job.rate or job.version == 0:
                job.rate = rate
                job.version += 1
                left = max(job.remaining_s, 0.0)
                self.loop.schedule(now + (left / rate if left > 0 else 0.0), "copy", (job, job.version))

    def on_event(self, payload: tuple[CopyJob, int]) -> CopyJob | None:
        """A completion event, handled at its time (the loop's clock); the job that finished, or None if stale."""
        job, version = payload
        if version != job.version or job.end >= 0:
            return None
        now = self.loop.now
        self._advance(now)
        q = self.queues[job.direction]
        assert q and q[0] is job, "a copy completes only at the head of its direction"
        q.popleft()
        job.end = now
        job.remaining_s = 0.0
        self.finished_plans.add(job.plan.plan_id)
        self.intervals.append((job.start, now, job.direction, job.nbytes))
        if not job.early:
            self._finish_handle(job)
        self._start_heads(now)
        return job

    def _finish_handle(self, job: CopyJob) -> None:
        if job.fail:
            job.handle.finish(TransferStatus.FAILED, TransferError(f"plan {job.plan.plan_id}: injected failure"))
        else:
            job.handle.finish(TransferStatus.DONE)
        job.handle.elapsed_s = self.loop.now - job.submitted  # simulated submit-to-finish time, not wall time

    # --------------------------------------------------------- projections
    def busy(self) -> bool:
        return any(self.queues.values())

    def project(self) -> dict[CopyJob, tuple[float, float]]:
        """Start and end of every queued plan if nothing else were submitted (the fluid, run forward)."""
        now = self.loop.now
        self._advance(now)
        qs = {d: list(q) for d, q in self.queues.items() if q}
        left = {j: max(j.remaining_s, 0.0) for q in qs.values() for j in q}
        start = {j: j.start for q in qs.values() for j in q}
        done = set(self.finished_plans)
        out: dict[CopyJob, tuple[float, float]] = {}
        t = now
        for _ in range(sum(len(q) for q in qs.values()) + 1):
            heads = []
            for q in qs.values():
                if q and all(d in done for d in q[0].deps):
                    if start[q[0]] < 0:
                        start[q[0]] = t
                    heads.append(q[0])
            if not heads:
                break
            both = len(heads) > 1 and self.share < 1.0
            rates = {j: (j.solo_s / j.shared_s if both and j.shared_s > 0 else 1.0) for j in heads}
            first = min(heads, key=lambda j: left[j] / rates[j])
            dt = left[first] / rates[first]
            for j in heads:
                left[j] -= dt * rates[j]
            t += dt
            out[first] = (start[first], t)
            done.add(first.plan.plan_id)
            qs[first.direction].pop(0)
        return out

    def idle_at(self) -> float:
        """When every copy issued so far will have finished (``blocking``: the step starts then)."""
        if not self.busy():
            return self.loop.now
        ends = self.project().values()
        return max((e for _, e in ends), default=self.loop.now)

    def take_layerwise(self) -> list[CopyJob]:
        """Layerwise copies issued since the last call (the next step reads them)."""
        new, self._early_new = self._early_new, []
        return new

    def layerwise_end(self, jobs: list[CopyJob], start: float, step_s: float, num_layers: int) -> float:
        """End of a step starting at ``start`` whose layer ``i`` waits for layer ``i`` of each of ``jobs``.

        With copy ``[cs, ce]`` of ``D = ce - cs`` seconds and compute of ``T``
        seconds, both split evenly over ``L`` layers, layer ``i`` ends at
        ``max(previous layer's end, cs + (i + 1) D / L) + T / L``; the latest
        of those constraints is at the first or the last layer:
        ``max(start + T, cs + D / L + T, ce + T / L)``.
        """
        end = start + step_s
        if not jobs:
            return end
        proj = self.project() if any(j.end < 0 for j in jobs) else {}
        for j in jobs:
            cs, ce = (j.start, j.end) if j.end >= 0 else proj.get(j, (start, start))
            if ce <= start:
                continue
            d = ce - cs
            end = max(end, cs + d / num_layers + step_s, ce + step_s / num_layers)
        return end
