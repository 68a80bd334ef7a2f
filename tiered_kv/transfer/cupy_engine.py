"""CupyCopyEngine: cupy streams and events, raw-pointer memcpyAsync, and a gather/scatter kernel.

* Each contiguous piece of a coalesced run is one ``cudaMemcpyAsync`` on raw
  pointers (one per run in the block-contiguous layout).
* Plans of many small scattered runs use a RawKernel instead: one thread block
  per segment copies 16-byte words, reading or writing pinned host memory
  directly through unified virtual addressing (the CPU tier is registered
  mapped), which replaces thousands of small DMA set-ups with one launch.
* Streams per lane, events per plan, gated and layer-wise plans: the shared
  issuing path of :mod:`~tiered_kv.transfer.stream_engine`, on cupy streams
  and events.
* The compute stream a device-to-host plan waits for: the KV tensors are
  torch's, so by default that is both cupy's current stream and torch's (one
  wait when they are the same stream); a caller computing on another stream
  passes it (a cupy or a torch stream).

Segment byte offsets come from :func:`tiered_kv.storage.spec.segment_offsets`,
whose agreement with the torch views is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets
from tiered_kv.transfer.availability import require
from tiered_kv.transfer.coalesce import CopyRun
from tiered_kv.transfer.cudart import CudaRuntime
from tiered_kv.transfer.event_handle import CupyEvents
from tiered_kv.transfer.plan_events import DEFAULT_MAX_TRACKED_PLANS, PlanEvents
from tiered_kv.transfer.storage_engine import LANES, PreparedPlan
from tiered_kv.transfer.stream_engine import IssueJob, StreamCopyEngine

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


class CupyCopyEngine(StreamCopyEngine):
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
        self.streams = {lane: cupy.cuda.Stream(non_blocking=True) for lane in LANES}
        self.kernel = cupy.RawKernel(GATHER_SRC, "copy_segments")
        runtime = cupy.cuda.runtime

        def memcpy(dst: int, src: int, n: int, stream: int) -> None:
            runtime.memcpyAsync(dst, src, n, CUDA_MEMCPY_DEFAULT, stream)

        def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
            runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, stream)

        self.runtime = CudaRuntime("cupy", memcpy, memcpy2d)

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

    def _new_event(self, timing: bool) -> Any:
        return self.cp.cuda.Event() if timing else self.cp.cuda.Event(disable_timing=True)

    def _stream_ptr(self, stream: Any) -> int:
        return stream.ptr

    def _issue_whole(self, job: IssueJob) -> None:
        """The gather kernel for a plan of many runs (``kernel_min_runs``), else one memcpy per run."""
        k = self.kernel_min_runs
        if k is not None and job.prep.num_copies >= k and self.spec.segment_bytes % 16 == 0:
            self._gather(job.prep, job.stream)
        else:
            super()._issue_whole(job)

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
