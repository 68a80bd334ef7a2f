"""CupyCopyEngine: cupy streams and events, raw-pointer memcpyAsync, and a gather/scatter kernel.

* Each contiguous piece of a coalesced run is one ``cudaMemcpyAsync`` on raw
  pointers (one per run in the block-contiguous layout).
* Plans of many small scattered runs use a RawKernel instead: one thread block
  per segment copies 16-byte words, reading or writing pinned host memory
  directly through unified virtual addressing (the CPU tier is registered
  mapped), which replaces thousands of small DMA set-ups with one launch.
* Streams per lane and events per plan, as in the torch engine.

Segment byte offsets come from :func:`tiered_kv.storage.spec.segment_offsets`,
whose agreement with the torch views is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiered_kv.errors import PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets
from tiered_kv.transfer.coalesce import CopyRun
from tiered_kv.transfer.plan import TransferHandle, TransferPlan, TransferStatus
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


class CupyCopyEngine(StorageEngineBase):
    """cupy backend.  ``kernel_min_runs``: use the gather kernel for plans with at least this many runs."""

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        kernel_min_runs: int = 32,
        record: bool = False,
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise TransferError("CupyCopyEngine needs cupy (pip install 'tiered-kv[cupy]')") from exc
        self.cp = cupy
        self.streams = {lane: cupy.cuda.Stream(non_blocking=True) for lane in ("h2d_urgent", "h2d", "d2h", "local")}
        self.kernel = cupy.RawKernel(GATHER_SRC, "copy_segments")
        self.kernel_min_runs = kernel_min_runs
        self._events: dict[int, object] = {}

    def _base(self, medium: str) -> int:
        return self.tiers[medium].kv.data_ptr()

    def submit(self, plan: TransferPlan) -> TransferHandle:
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        prep = self.prepare(plan)
        stream = self.streams[prep.lane]
        handle = _CupyHandle(plan, num_bytes=prep.num_bytes)
        cp = self.cp
        try:
            for w in plan.wait_for:
                ev = self._events.get(w)
                if ev is not None:
                    stream.wait_event(ev)
            start = cp.cuda.Event()
            start.record(stream)
            if prep.num_copies >= self.kernel_min_runs and self.spec.segment_bytes % 16 == 0:
                self._gather(prep, stream)
            else:
                self._memcpy(prep, stream)
            end = cp.cuda.Event()
            end.record(stream)
        except Exception as exc:
            handle._finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        handle.attach(start, end)
        self._events[plan.plan_id] = end
        return handle

    def _memcpy(self, prep: PreparedPlan, stream: object) -> None:
        plan = prep.plan
        src, dst = self.tiers[plan.src_medium], self.tiers[plan.dst_medium]
        sb, db = self._base(plan.src_medium), self._base(plan.dst_medium)
        for ci, chunk in enumerate(prep.chunks):
            for run in chunk:
                self._record(prep, ci, run)
                for s, d, n in run_byte_ranges(src, dst, run):
                    self.cp.cuda.runtime.memcpyAsync(db + d, sb + s, n, CUDA_MEMCPY_DEFAULT, stream.ptr)  # type: ignore[attr-defined]

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

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: always False (after checking the argument)."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return False


class _CupyHandle(TransferHandle):
    def attach(self, start: object, end: object) -> None:
        self._start_ev, self._end_ev = start, end
        self.status = TransferStatus.RUNNING

    def done(self) -> bool:
        if not self._event.is_set() and self._end_ev.done:  # type: ignore[attr-defined]
            self._settle()
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._event.is_set():
            self._end_ev.synchronize()  # type: ignore[attr-defined]
            self._settle()
        return self.ok

    def _settle(self) -> None:
        self._finish(TransferStatus.DONE)
        from cupy.cuda import get_elapsed_time

        self.elapsed_s = get_elapsed_time(self._start_ev, self._end_ev) / 1000.0
