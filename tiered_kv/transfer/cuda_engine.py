"""The two CUDA copy engines, on torch streams and on cupy streams: how they issue a plan, and the raw copy calls.

The torch and the cupy engine differ only in the library they speak: how an
event or a stream is made and named, and how one run is copied.  Everything
else is :class:`StreamCopyEngine`, once:

* **lanes**: each lane (:data:`~tiered_kv.transfer.storage_engine.LANES`) has
  its own stream, so PCIe runs both directions at once and a swap-in never
  queues behind a swap-out;
* **never read KV compute is still writing**: a device-to-host plan first makes
  its stream wait for an event recorded on the compute stream(s) at submission;
* **events, not host waits**: every plan records a start and an end event; its
  handle is an :class:`~tiered_kv.transfer.event_handle.EventTransferHandle`,
  ``wait_for`` plans are ordered by stream waits on their end events (kept in a
  bounded :class:`~tiered_kv.transfer.event_handle.PlanEvents` table), and
  ``make_compute_wait`` orders compute after a plan (or one of its layers) on
  the device.  No device-wide synchronisation anywhere;
* **layer by layer**: a plan with ``num_layers`` issues every run's layer ``i``
  and then an event that compute on layer ``i`` may wait for;
* **gated plans**: a prefill's KV can be stored while its forward pass is still
  running.  The plan is submitted before the step and held; each layer's copies
  are issued once the driver says compute has written that layer
  (:meth:`StreamCopyEngine.open_layer`), after the lane stream waits on an event
  recorded on the compute stream, so the copy reads the layer only after the
  kernels that wrote it.  The handle becomes an ordinary event handle once its
  last layer is issued;
* **faults**: a plan that fails before any copy was issued fails at once; one
  that fails after some were issued fails only once they have ended
  (:func:`~tiered_kv.transfer.event_handle.fail_after_issued`), so no block is
  reused while a copy still touches it.

Once issued, CUDA copies cannot be recalled, so ``cancel`` returns False except
for a gated plan none of whose layers was opened.

:class:`TorchCudaCopyEngine` uses torch's streams (urgent swap-ins get a
high-priority stream of their own), torch CUDA events, the compute stream
(torch's current stream unless one is given), and the copies: one raw
``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` per run where the runtime loads,
else torch ``copy_`` calls issued with the lane stream made current.

:class:`CupyCopyEngine` uses cupy streams and events and the same raw calls
from cupy.  Plans of many small scattered runs may use a RawKernel instead: one
thread block per segment copies 16-byte words, reading or writing pinned host
memory directly through unified virtual addressing (the CPU tier is registered
mapped), which replaces thousands of small DMA set-ups with one launch.  The
compute stream a device-to-host plan waits for: the KV tensors are torch's, so
by default that is both cupy's current stream and torch's (one wait when they
are the same stream); a caller computing on another stream passes it (a cupy or
a torch stream).  Segment byte offsets come from
:func:`tiered_kv.storage.spec.segment_offsets`, whose agreement with the torch
views is tested on the CPU.

The raw calls: a run of blocks is one contiguous region in the
block-contiguous layout (one ``cudaMemcpyAsync``) and ``2 * num_layers``
equally spaced pieces in the layer-first layout: exactly the shape of
``cudaMemcpy2DAsync`` (rows of ``length * segment_bytes`` bytes, a row per
layer and K/V, each tier's pitch being its ``num_blocks * segment_bytes``).
One call per run, whatever the layout, instead of a torch ``copy_`` per piece:
measured on an H200, per-piece torch copies of layer-first runs reached 3% of
the link.  The runtime comes from cupy when it is installed (it wraps
libcudart), else from the ``libcudart`` that torch's CUDA build ships, loaded
with ctypes.  Both take raw device/host addresses and a raw stream handle, so
torch tensors and torch streams work unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, PlanError, TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import segment_offsets
from tiered_kv.transfer.event_handle import (
    DEFAULT_MAX_TRACKED_PLANS,
    CupyEvents,
    EventAPI,
    EventTransferHandle,
    PlanEvents,
    TorchEvents,
    fail_after_issued,
    issued_event,
)
from tiered_kv.transfer.factory import require
from tiered_kv.transfer.plan import CopyRun, TransferHandle, TransferPlan, TransferStatus
from tiered_kv.transfer.storage_engine import LANES, PreparedPlan, StorageEngineBase

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from unified addresses


@dataclass(frozen=True)
class CudaRuntime:
    """The two copy calls, bound to one implementation.

    Attributes:
        name: Where they come from (``"cupy"`` or a library path).
        memcpy_async: ``(dst, src, nbytes, stream)``.
        memcpy2d_async: ``(dst, dst_pitch, src, src_pitch, width, height, stream)``.
    """

    name: str
    memcpy_async: Callable[[int, int, int, int], None]
    memcpy2d_async: Callable[[int, int, int, int, int, int, int], None]


def _from_cupy() -> CudaRuntime | None:
    try:
        from cupy.cuda import runtime
    except Exception:  # not installed, or no usable CUDA for it
        return None

    def memcpy(dst: int, src: int, n: int, stream: int) -> None:
        runtime.memcpyAsync(dst, src, n, CUDA_MEMCPY_DEFAULT, stream)

    def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, stream)

    return CudaRuntime("cupy", memcpy, memcpy2d)


def _libcudart_paths() -> list[str]:
    paths: list[str] = []
    try:
        import nvidia.cuda_runtime as rt  # the wheel torch's CUDA builds depend on

        for d in rt.__path__:
            paths += sorted(glob.glob(os.path.join(d, "lib", "libcudart.so*")), reverse=True)
    except Exception:
        pass
    try:
        import torch

        paths += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*")), reverse=True)
    except Exception:
        pass
    found = ctypes.util.find_library("cudart")
    if found:
        paths.append(found)
    paths += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"), reverse=True)
    return paths


def _from_ctypes() -> CudaRuntime | None:
    for path in _libcudart_paths():
        try:
            lib = ctypes.CDLL(path)
            f1, f2 = lib.cudaMemcpyAsync, lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        f1.argtypes, f1.restype = [vp, vp, sz, ctypes.c_int, vp], ctypes.c_int
        f2.argtypes, f2.restype = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp], ctypes.c_int

        def memcpy(dst: int, src: int, n: int, stream: int, _f=f1) -> None:
            _check(_f(dst, src, n, CUDA_MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

        def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int, _f=f2) -> None:
            _check(_f(dst, dpitch, src, spitch, width, height, CUDA_MEMCPY_DEFAULT, stream), "cudaMemcpy2DAsync")

        return CudaRuntime(path, memcpy, memcpy2d)
    return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise TransferError(f"{what} failed with CUDA error {code}")


def load_cuda_runtime() -> CudaRuntime | None:
    """The raw copy calls, from cupy or libcudart; ``None`` where neither loads."""
    return _from_cupy() or _from_ctypes()


@dataclass(slots=True)
class IssueJob:
    """One plan being issued: its prepared runs, lane stream, events and the layer events so far."""

    prep: PreparedPlan
    stream: Any
    start: Any
    end: Any
    layer_events: list[Any] = field(default_factory=list)


class StreamCopyEngine(StorageEngineBase):
    """The issuing path both CUDA engines use; a subclass supplies its library.

    A subclass's constructor sets ``_api`` (its :class:`EventAPI`), ``_events``
    (the plan-event table over it), ``streams`` (one per lane) and ``runtime``
    (the raw copy calls, or None to copy with torch ``copy_``), and implements
    :meth:`_new_event`, :meth:`_compute_streams` and :meth:`_stream_ptr`.
    """

    _api: EventAPI
    _events: PlanEvents
    streams: dict[str, Any]
    runtime: CudaRuntime | None

    def __init__(self, tiers: Mapping[str, KVStorage], max_blocks_per_chunk: int, record: bool) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        self._gated: dict[int, tuple[EventTransferHandle, IssueJob]] = {}

    # The library: what each engine supplies ------------------------------------------------
    def _new_event(self, timing: bool) -> Any:
        """A new event (with timing for a plan's start and end, without for ordering only)."""
        raise NotImplementedError

    def _compute_streams(self, name: str, given: object | None) -> list[Any]:
        """The streams whose kernels may touch the KV: ``given`` (else InvalidArgumentError), or the defaults."""
        raise NotImplementedError

    def _stream_ptr(self, stream: Any) -> int:
        """The raw ``cudaStream_t`` of one of this engine's streams."""
        raise NotImplementedError

    def _issuing(self, stream: Any) -> AbstractContextManager[object]:
        """Where copies are issued from: torch ``copy_`` calls need their stream made current."""
        return nullcontext()

    # ----------------------------------------------------------------------------------------
    @property
    def max_tracked_plans(self) -> int:
        """Plans whose end events are kept before completed ones are forgotten."""
        return self._events.limit

    @property
    def tracked_plans(self) -> int:
        """Plans whose end events the engine holds now (at most ``max_tracked_plans`` unless many are in flight)."""
        return len(self._events)

    def submit(self, plan: TransferPlan, compute_stream: object | None = None) -> TransferHandle:
        """Issue the plan's copies on its lane's stream and return at once.

        Args:
            plan: The plan.
            compute_stream: The stream whose kernels write the KV a GPU-to-CPU
                plan reads (default: the engine's current compute stream(s)).

        Raises:
            PlanError: the plan is malformed or its id is still in flight.
            InvalidArgumentError: ``compute_stream`` is not a CUDA stream.
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"submit() takes a TransferPlan, got {type(plan).__name__}")
        if compute_stream is not None:
            self._compute_streams("compute_stream", compute_stream)
        prep = self.prepare(plan)
        if self._events.in_flight(plan.plan_id) or plan.plan_id in self._gated:
            raise PlanError(f"plan {plan.plan_id} is already in flight")
        stream = self.streams[prep.lane]
        handle = EventTransferHandle(plan, num_bytes=prep.num_bytes)
        job = IssueJob(prep, stream, self._new_event(True), self._new_event(True))
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
            if plan.num_layers:
                for layer in range(plan.num_layers):
                    self._issue_layer(job, layer)
            else:
                self._issue_whole(job)
        except Exception as exc:
            if issued:
                self._fail_issue(handle, job, exc)
            else:
                handle.finish(TransferStatus.FAILED, TransferError(f"plan {plan.plan_id}: {exc}"))
            return handle
        self._end_issue(handle, job)
        return handle

    def _runs(self, prep: PreparedPlan) -> Iterator[CopyRun]:
        """Every run of the plan, chunk by chunk, each recorded in ``trace`` just before it is copied."""
        for ci, chunk in enumerate(prep.chunks):
            for run in chunk:
                self._record(prep, ci, run)
                yield run

    def _copy(self, plan: TransferPlan, run: CopyRun, layer: int | None, stream: Any) -> None:
        """One run (or one layer of it) on ``stream``: raw calls when the runtime loaded, else torch ``copy_``."""
        if self.runtime is not None:
            self.copy_run_raw(self.runtime, plan, run, self._stream_ptr(stream), layer)
        elif layer is None:
            self.copy_run(plan, run, non_blocking=True)
        else:
            self.copy_run_layer(plan, run, layer, non_blocking=True)

    def _issue_whole(self, job: IssueJob) -> None:
        """Every run in one go: one ``cudaMemcpyAsync`` (block-contiguous) or ``cudaMemcpy2DAsync`` (layer-first)."""
        with self._issuing(job.stream):
            for run in self._runs(job.prep):
                self._copy(job.prep.plan, run, None, job.stream)

    def _issue_layer(self, job: IssueJob, layer: int) -> None:
        """Every run's layer ``layer``, then an event compute on that layer may wait for."""
        with self._issuing(job.stream):
            for run in self._runs(job.prep):
                self._copy(job.prep.plan, run, layer, job.stream)
        ev = self._new_event(False)
        ev.record(job.stream)
        job.layer_events.append(ev)

    def _order_after_compute(self, job: IssueJob, compute_stream: object | None) -> None:
        for compute in self._compute_streams("stream", compute_stream):
            ready = self._new_event(False)
            ready.record(compute)
            job.stream.wait_event(ready)

    def _end_issue(self, handle: EventTransferHandle, job: IssueJob) -> None:
        job.end.record(job.stream)
        handle.attach(self._api, job.start, job.end, tuple(job.layer_events))
        self._events.add(handle.plan.plan_id, job.end)

    def _fail_issue(self, handle: EventTransferHandle, job: IssueJob, exc: BaseException) -> None:
        if not fail_after_issued(handle, self._api, job.stream, job.start, job.end, job.layer_events, exc):
            handle.finish(TransferStatus.FAILED, TransferError(f"plan {handle.plan.plan_id}: {exc}"))

    def make_compute_wait(self, handle: TransferHandle, stream: object | None = None, layer: int | None = None) -> None:
        """Order compute after the plan (or one layer of it) on the device; the host does not block.

        Args:
            handle: A handle this engine returned.
            stream: The stream to order; default: the engine's current compute stream(s).
            layer: Wait only for this layer of a layer-wise plan, so compute on it
                overlaps the copy of later layers.

        Raises:
            PlanError: ``handle`` is not an issued plan of a CUDA engine.
            InvalidArgumentError: ``stream`` is not a CUDA stream.
        """
        end = issued_event(handle, "make_compute_wait")
        streams = self._compute_streams("stream", stream)
        if layer is not None:
            end = handle.layer_event(layer)  # type: ignore[attr-defined]
        for compute in streams:
            compute.wait_event(end)

    def close(self) -> None:
        """Wait for every plan still in flight (teardown only: a host wait, never in a serving step)."""
        self._abandon_gated()
        self._events.wait_all()

    def cancel(self, handle: TransferHandle) -> bool:
        """Issued CUDA copies cannot be recalled: False, except for a gated plan none of whose layers opened."""
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"cancel() takes a TransferHandle, got {type(handle).__name__}")
        return self._cancel_gated(handle)

    # Gated plans ------------------------------------------------------------------------------
    def _hold(self, handle: EventTransferHandle, job: IssueJob) -> EventTransferHandle:
        """Keep a gated plan; nothing of it is issued until its first layer opens."""
        handle.mark_running()
        self._gated[handle.plan.plan_id] = (handle, job)
        return handle

    def open_layer(self, handle: TransferHandle, layer: int, stream: object = None) -> None:
        """Compute has written layer ``layer`` of a gated plan's source: issue that layer's copies.

        The lane stream waits on an event recorded now on ``stream`` (default:
        the current stream), so the copy follows the kernels that wrote the
        layer; the host does not wait.  A plan that already failed ignores
        further opens.

        Raises:
            PlanError: not a handle, not a gated plan of this engine, or not the next layer.
        """
        if not isinstance(handle, TransferHandle):
            raise PlanError(f"open_layer() takes a TransferHandle, got {type(handle).__name__}")
        entry = self._gated.get(handle.plan.plan_id)
        if entry is None or entry[0] is not handle:
            if handle.done() and handle.plan.gated:
                return
            handle._check_open(layer)
            raise PlanError(f"plan {handle.plan.plan_id} is not a gated plan waiting in this engine")
        handle._check_open(layer)
        job = entry[1]
        try:
            self._order_after_compute(job, stream)
            self._issue_layer(job, layer)
        except Exception as exc:
            self._drop(handle)
            self._fail_issue(handle, job, exc)
            return
        handle._open(layer)
        if handle.num_opened == handle.plan.num_layers:
            del self._gated[handle.plan.plan_id]
            self._end_issue(handle, job)

    def _drop(self, handle: TransferHandle) -> None:
        self._gated.pop(handle.plan.plan_id, None)
        for i in range(handle.num_opened, handle.plan.num_layers):
            handle._open(i)

    def _cancel_gated(self, handle: TransferHandle) -> bool:
        """Cancel a gated plan none of whose layers was issued; False otherwise."""
        entry = self._gated.get(handle.plan.plan_id)
        if entry is None or entry[0] is not handle or handle.num_opened:
            return False
        self._drop(handle)
        handle.finish(TransferStatus.CANCELLED, TransferError(f"plan {handle.plan.plan_id}: cancelled"))
        return True

    def _abandon_gated(self) -> None:
        """At close: cancel gated plans never opened; fail partly opened ones once what was issued ends."""
        for handle, job in list(self._gated.values()):
            if not self._cancel_gated(handle):
                self._drop(handle)
                self._fail_issue(handle, job, TransferError("engine closed before every layer was opened"))


TORCH_EVENTS = TorchEvents()


class TorchCudaCopyEngine(StreamCopyEngine):
    """CUDA-stream copy engine over torch tensors (GPU tier on the device, CPU tier pinned).

    Args:
        tiers: The storage of each tier.
        max_blocks_per_chunk: Chunk size (blocks).
        record: Keep every issued copy in ``trace``.
        max_tracked_plans: Plans whose end events are kept for ``wait_for`` and
            duplicate-id checks before completed ones are forgotten.
        copy_api: ``"runtime"``: one raw ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync``
            per run (see the module docstring); ``"torch"``: torch
            ``copy_`` calls, one per contiguous piece; ``"auto"``: the runtime
            when it loads, else torch.

    Raises:
        EngineUnavailableError: torch sees no CUDA device.
    """

    fuse_strided_runs = False  # torch copy_ path: one copy per contiguous segment, no staging

    def __init__(
        self,
        tiers: Mapping[str, KVStorage],
        max_blocks_per_chunk: int = 64,
        record: bool = False,
        max_tracked_plans: int = DEFAULT_MAX_TRACKED_PLANS,
        copy_api: str = "auto",
    ) -> None:
        super().__init__(tiers, max_blocks_per_chunk, record)
        self._api = TORCH_EVENTS
        self._events = PlanEvents(TORCH_EVENTS, max_tracked_plans)
        checks.choice("copy_api", copy_api, ("auto", "runtime", "torch"))
        require("cuda", "TorchCudaCopyEngine")
        self.runtime = load_cuda_runtime() if copy_api != "torch" else None
        if copy_api == "runtime" and self.runtime is None:
            raise TransferError("copy_api='runtime': neither cupy nor libcudart could be loaded")
        self.copy_api = "runtime" if self.runtime is not None else "torch"
        lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
        self.streams = {
            "h2d_urgent": torch.cuda.Stream(priority=hi),
            "h2d": torch.cuda.Stream(priority=lo),
            "d2h": torch.cuda.Stream(priority=lo),
            "local": torch.cuda.Stream(priority=lo),
        }

    def _new_event(self, timing: bool) -> Any:
        return torch.cuda.Event(enable_timing=True) if timing else torch.cuda.Event()

    def _compute_streams(self, name: str, given: object | None) -> list[Any]:
        if given is None:
            return [torch.cuda.current_stream()]
        checks.instance(name, given, torch.cuda.Stream)
        return [given]

    def _stream_ptr(self, stream: Any) -> int:
        return stream.cuda_stream

    def _issuing(self, stream: Any) -> AbstractContextManager[object]:
        return torch.cuda.stream(stream)


GATHER_SRC = r"""
extern "C" __global__ void copy_segments(const unsigned long long* src, const unsigned long long* dst,
                                         const unsigned long long nbytes) {
    const int4* s = reinterpret_cast<const int4*>(src[blockIdx.x]);
    int4* d = reinterpret_cast<int4*>(dst[blockIdx.x]);
    const unsigned long long n = nbytes / 16;
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}
"""


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
        self.runtime = _from_cupy()

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
