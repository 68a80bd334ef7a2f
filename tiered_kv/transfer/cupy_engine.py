"""CupyCopyEngine: cupy streams and events, raw-pointer memcpyAsync, and a gather/scatter kernel.

* Each contiguous piece of a coalesced run is one ``cudaMemcpyAsync`` on raw
  pointers (one per run in the block-contiguous layout).
* Plans of many small scattered runs use a RawKernel instead: one thread block
  per segment copies 16-byte words, reading or writing pinned host memory
  directly through unified virtual addressing (the CPU tier is registered
  mapped), which replaces thousands of small DMA set-ups with one launch.
* Streams per lane and events per plan, as in the torch engine, with the same
  handle (:class:`~tiered_kv.transfer.event_handle.EventTransferHandle`) and
  the same bounded table of plan events.
* A device-to-host plan first makes its stream wait for an event recorded on
  the compute stream, so it never reads KV a kernel is still writing.  The KV
  tensors are torch's, so by default that is both cupy's current stream and
  torch's (one wait when they are the same stream); a caller computing on
  another stream passes it (a cupy or a torch stream).

Segment byte offsets come from :func:`tiered_kv.storage.spec.segment_offsets`,
whose agreement with the torch views is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets
from tiered_kv.transfer.availability import require
from tiered_kv.transfer.coalesce import CopyRun
from tiered_kv.transfer.cudart import CudaRuntime
from tiered_kv.transfer.event_handle import CupyEvents, EventTransferHandle, fail_after_issued, issued_event
from tiered_kv.transfer.gated import GatedLayers, IssueJob
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.plan_events import DEFAULT_MAX_TRACKED_PLANS, PlanEvents
from tiered_kv.transfer.storage_engine import PreparedPlan, StorageEngineBase

GATHER_SRC = r"""
extern "C" __global__ void copy_segments(const unsigned long long* src, const unsigned long long* dst,
                                         const unsigned long long nbytes) {
    const int4* s = reinterpret_cast<const int4*>(src[blockIdx.x]);
    int4* d = reinterpret_cast<int4*>(dst[blockIdx.x]);
    const unsigned long long n = nbytes / 16;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}
"""

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from unified addresses


def run_byte_ranges(storage_src: KVStorage, storage_dst: KVStorage, run: CopyRun) -> list[tuple[int, int, int]]:
    """``(src_offset, dst_offset, nbytes)`` of each contiguous piece of a run (offsets from each tier's base)."""
    spec = storage_src.spec
    if storage_src.layout == "block_contiguous":
        return [
            (
                run.src_start * spec.bytes_per_block,
                run.dst_start * spec.bytes_per_block,
                run.length * spec.bytes_per_block,
            )
        ]
    seg = spec.segment_bytes
    s_off = segment_offsets(spec, "layer_first", storage_src.num_blocks, run.src_start)
    d_off = segment_offsets(spec, "layer_first", storage_dst.num_blocks, run.dst_start)
    return [(s, d, run.length * seg) for s, d in zip(s_off, d_off, strict=True)]


def block_segments(storage: KVStorage, block_id: int) -> list[int]:
    """Byte offsets of one block's ``2 * num_layers`` segments (each ``segment_bytes`` long)."""
    return segment_offsets(storage.spec, storage.layout, storage.num_blocks, block_id)


class CupyCopyEngine(GatedLayers, StorageEngineBase):
    """cupy backend.

    Args:
        tiers: The storage of each tier.
        max_blocks_per_chunk: Chunk size (blocks).
        kernel_min_runs: Use the gather kernel for plans with at least this many
            copies (``None``: never).  Off by default: on an H200 the kernel,
            which reads pinned host memory through unified addressing, moved
            scattered 16-token blocks at 0.41 of the link, where one
            ``cudaMemcpyAsync`` per run moved 64-token blocks at 0.89.
        record: Keep every issued copy in ``trace``.
        max_tracked_plans: Plans whose end events are kept for ``wait_for`` and
            duplicate-id checks before completed ones are forgotten.

    Raises:
        EngineUnavailableError: cupy is missing or sees no CUDA device.
    """

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        kernel_min_runs: int | None = None,
        record: bool = False,
        max_tracked_plans: int = DEFAULT_MAX_TRACKED_PLANS,
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        if kernel_min_runs is not None:
            checks.count("kernel_min_runs", kernel_min_runs, minimum=1)
        self.kernel_min_runs = kernel_min_runs
        require("cupy", "CupyCopyEngine")
        import cupy

        self.cp = cupy
        self._api = CupyEvents(cupy.cuda.get_elapsed_time)
        self._events = PlanEvents(self._api, max_tracked_plans)
        self._gated = {}
        self.streams = {lane: cupy.cuda.Stream(non_blocking=True) for lane in ("h2d_urgent", "h2d", "d2h", "local")}
        self.kernel = cupy.RawKernel(GATHER_SRC, "copy_segments")
        runtime = cupy.cuda.runtime

        def memcpy(dst: int, src: int, n: int, stream: int) -> None:
            runtime.memcpyAsync(dst, src, n, CUDA_MEMCPY_DEFAULT, stream)

        def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
            runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, stream)

        self._runtime = CudaRuntime("cupy", memcpy, memcpy2d)

    @property
    def max_tracked_plans(self) -> int:
        """Plans whose end events are kept before completed ones are forgotten."""
        return self._events.limit

    @property
    def tracked_plans(self) -> int:
        """Plans whose end events the engine holds now (at most ``max_tracked_plans`` unless many are in flight)."""
        return len(self._events)

    def _base(self, medium: str) -> int:
        return self.tiers[medium].kv.data_ptr()

    def _as_cupy_stream(self, name: str, stream: object) -> Any:
        """A cupy view of a cupy or torch CUDA stream."""
        if isinstance(stream, torch.cuda.Stream):
            return self.cp.cuda.ExternalStream(stream.cuda_stream)
        if isinstance(getattr(stream, "ptr", None), int) and hasattr(stream, "wait_event"):
            return stream
        raise InvalidArgumentError(f"{name} must be a cupy or torch CUDA stream, got {checks.describe(stream)}")

    def _compute_streams(self, name: str, given: object | None) -> list[Any]:
        """The streams whose kernels may touch the KV: ``given``, else cupy's and torch's current streams."""
        if given is not None:
            return [self._as_cupy_stream(name, given)]
        streams = [self.cp.cuda.get_current_stream()]
        if torch.cuda.is_initialized():
            ptr = torch.cuda.current_stream().cuda_stream
            if ptr != streams[0].ptr:
                streams.append(self.cp.cuda.ExternalStream(ptr))
        return streams

    def submit(self, plan: TransferPlan, compute_stream: object | None = None) -> TransferHandle:
        """Issue the plan's copies on its lane's stream and return at once.

        Args:
            plan: The plan.
            compute_stream: The stream (cupy or torch) whose kernels write the
                KV a GPU-to-CPU plan reads; default: cupy's and torch's current streams.

        Raises:
            PlanError: the plan is malformed or its id is still in flight.
            InvalidArgumentError: ``compute_stream`` is not a CUDA stream.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if compute_stream is not None:
            self._as_cupy_stream("compute_stream", compute_stream)
        prep = self.prepare(plan)
        if self._events.in_flight(plan.plan_id) or plan.plan_id in self._gated:
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        stream = self.streams[prep.lane]
        handle = EventTransferHandle(plan, num_bytes=prep.num_bytes)
        cp = self.cp
        job = IssueJob(prep, stream, cp.cuda.Event(), cp.cuda.Event())
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
            k = self.kernel_min_runs
            if plan.num_layers:  # layer by layer, an event after each
                for layer in range(plan.num_layers):
                    self._issue_layer(job, layer)
            elif k is not None and prep.num_copies >= k and self.spec.segment_bytes % 16 == 0:
                self._gather(prep, stream)
            else:
                self._memcpy(prep, stream)
        except Exception as exc:
            if issued:
                self._fail_issue(handle, job, exc)
            else:
                handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        self._end_issue(handle, job)
        return handle

    def _issue_layer(self, job: IssueJob, layer: int) -> None:
        """Every run's layer ``layer``, then an event compute on that layer may wait for."""
        prep, stream = job.prep, job.stream
        for ci, chunk in enumerate(prep.chunks):
            for run in chunk:
                self._record(prep, ci, run)
                self.copy_run_layer_raw(self._runtime, prep.plan, run, layer, stream.ptr)  # type: ignore[attr-defined]
        ev = self.cp.cuda.Event(disable_timing=True)
        ev.record(stream)
        job.layer_events.append(ev)

    def _order_after_compute(self, job: IssueJob, compute_stream: object) -> None:
        for compute in self._compute_streams("stream", compute_stream):
            ready = self.cp.cuda.Event(disable_timing=True)
            ready.record(compute)
            job.stream.wait_event(ready)

    def _end_issue(self, handle: EventTransferHandle, job: IssueJob) -> None:
        job.end.record(job.stream)
        handle.attach(self._api, job.start, job.end, tuple(job.layer_events))
        self._events.add(handle.plan.plan_id, job.end)

    def _fail_issue(self, handle: EventTransferHandle, job: IssueJob, exc: BaseException) -> None:
        if not fail_after_issued(handle, self._api, job.stream, job.start, job.end, job.layer_events, exc):
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {handle.plan.plan_id}: {exc}"))

    def _memcpy(self, prep: PreparedPlan, stream: object) -> None:
        """One ``cudaMemcpyAsync`` (block-contiguous) or ``cudaMemcpy2DAsync`` (layer-first) per run."""
        plan = prep.plan
        for ci, chunk in enumerate(prep.chunks):
            for run in chunk:
                self._record(prep, ci, run)
                self.copy_run_raw(self._runtime, plan, run, stream.ptr)  # type: ignore[attr-defined]

    def _gather(self, prep: PreparedPlan, stream: object) -> None:
        plan = prep.plan
        src, dst = self.tiers[plan.src_medium], self.tiers[plan.dst_medium]
        sb, db = self._base(plan.src_medium), self._base(plan.dst_medium)
        s_ptrs: list[int] = []
        d_ptrs: list[int] = []
        for s_id, d_id in zip(plan.src_block_ids, plan.dst_block_ids, strict=True):
            s_ptrs += [sb + o for o in block_segments(src, s_id)]
            d_ptrs += [db + o for o in block_segments(dst, d_id)]
        cp = self.cp
        with stream:  # type: ignore[attr-defined]
            s_arr = cp.asarray(s_ptrs, dtype=cp.uint64)
            d_arr = cp.asarray(d_ptrs, dtype=cp.uint64)
            self.kernel((len(s_ptrs),), (256,), (s_arr, d_arr, cp.uint64(self.spec.segment_bytes)))

    def close(self) -> None:
        """Wait for every plan still in flight (teardown only: a host wait, never in a serving step)."""
        self._abandon_gated()
        self._events.wait_all()

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: False, except for a gated plan none of whose layers opened."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return self._cancel_gated(handle)

    def make_compute_wait(self, handle: TransferHandle, stream: object | None = None, layer: int | None = None) -> None:
        """Order compute after the plan (or one layer of it) on the device; the host does not block.

        Args:
            handle: A handle this engine returned.
            stream: The stream (cupy or torch) to order; default: cupy's and
                torch's current streams.
            layer: Wait only for this layer of a layer-wise plan.

        Raises:
            PlanError: ``handle`` is not an issued plan of a CUDA engine.
            InvalidArgumentError: ``stream`` is not a CUDA stream.
        """
        end = issued_event(handle, "make_compute_wait")
        if layer is not None:
            end = handle.layer_event(layer)  # type: ignore[attr-defined]
        for compute in self._compute_streams("stream", stream):
            compute.wait_event(end)
