"""CPU stand-ins for the CUDA stream/event API and for cupy, to run the GPU engines' logic here.

One :class:`FakeGPU` stands for the device.  Copies happen synchronously on the
CPU.  The cupy fake performs ``memcpyAsync`` and the gather kernel with
``ctypes.memmove`` on the raw pointers the engine computes, so the engine's
pointer arithmetic is checked byte for byte.

Ordering is observable: every stream operation (event record, stream wait,
memcpy, kernel launch, torch copies issued under ``torch.cuda.stream(s)``) is
appended to ``gpu.log`` in issue order, and each event knows the stream that
recorded it.  Completion is controllable: while ``gpu.holding`` is set, newly
recorded events stay incomplete until ``gpu.release()``; ``gpu.fail_with(exc)``
makes every later query or synchronise raise, as a CUDA error does.
``synchronize()`` on an incomplete event raises instead of blocking forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import sys
import types
import weakref

import torch


class FakeEvent:
    """A CUDA event of one fake device (subclassed per device, see :class:`FakeGPU`)."""

    gpu: FakeGPU

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: object) -> None:
        self.recorded_on: FakeStream | None = None
        self.complete = True  # an event never recorded counts as complete, as in CUDA
        self.gpu.events.add(self)

    def record(self, stream: FakeStream | None = None) -> None:
        gpu = self.gpu
        self.recorded_on = stream if stream is not None else gpu.null
        self.complete = not gpu.holding
        if gpu.holding:
            gpu.pending.append(self)
        gpu.note("record", self.recorded_on, self)

    def _check(self) -> None:
        if self.gpu.error is not None:
            raise self.gpu.error

    def query(self) -> bool:
        self._check()
        return self.complete

    @property
    def done(self) -> bool:  # cupy spelling of query()
        return self.query()

    def synchronize(self) -> None:
        self._check()
        if not self.complete:
            raise AssertionError("synchronize() on an event that never completes would block forever")

    def elapsed_time(self, end: FakeEvent) -> float:
        self._check()
        return self.gpu.elapsed_ms


class FakeStream:
    """A CUDA stream of one fake device; ``ptr`` (cupy) and ``cuda_stream`` (torch) are its handle."""

    gpu: FakeGPU

    def __init__(self, priority: int = 0, non_blocking: bool = False, ptr: int | None = None, **_: object) -> None:
        self.priority = priority
        self.ptr = next(self.gpu.ptrs) if ptr is None else ptr
        self.cuda_stream = self.ptr
        self.waited_on: list[FakeEvent] = []
        self.gpu.streams[self.ptr] = self

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -1)

    def wait_event(self, ev: FakeEvent) -> None:
        if self.gpu.keep_log:
            self.waited_on.append(ev)
        self.gpu.note("wait", self, ev)

    def __enter__(self) -> FakeStream:  # cupy: ``with stream`` makes it current
        self.gpu.cupy_stack.append(self)
        return self

    def __exit__(self, *exc: object) -> bool:
        self.gpu.cupy_stack.pop()
        return False

    def __repr__(self) -> str:
        return f"<FakeStream {self.ptr}>"


class FakeGPU:
    """One fake device: streams, events, the operation log, and control over completion.

    Attributes:
        log: ``(op, stream, detail)`` per stream operation, in issue order.
        null: The legacy default stream (handle 0), current for torch and cupy at first.
        torch_current: torch's current stream (``torch.cuda.stream(s)`` switches it).
        holding: While True, recorded events stay incomplete until :meth:`release`.
        elapsed_ms: What every event pair reports as device time.
        keep_log: Record the log and stream waits (off for long runs, so the
            fake holds no events and ``live_events`` counts what the engine keeps).
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, FakeStream | None, object]] = []
        self.streams: dict[int, FakeStream] = {}
        self.ptrs = itertools.count(1)
        self.events: weakref.WeakSet[FakeEvent] = weakref.WeakSet()
        self.pending: list[FakeEvent] = []
        self.holding = False
        self.error: BaseException | None = None
        self.elapsed_ms = 2.5
        self.keep_log = True
        self.launches: list[int] = []
        self.Stream = type("FakeStream", (FakeStream,), {"gpu": self})
        self.Event = type("FakeEvent", (FakeEvent,), {"gpu": self})
        self.null = self.Stream(ptr=0)
        self.torch_current = self.null
        self.cupy_stack: list[FakeStream] = []

    @property
    def cupy_current(self) -> FakeStream:
        return self.cupy_stack[-1] if self.cupy_stack else self.null

    def note(self, op: str, stream: FakeStream | None, detail: object = None) -> None:
        if self.keep_log:
            self.log.append((op, stream, detail))

    def hold(self) -> None:
        self.holding = True

    def release(self) -> None:
        """Complete every event recorded while holding, and stop holding."""
        self.holding = False
        for ev in self.pending:
            ev.complete = True
        self.pending.clear()

    def fail_with(self, exc: BaseException) -> None:
        self.error = exc

    def live_events(self) -> int:
        gc.collect()
        return len(self.events)

    def ops_on(self, stream: FakeStream) -> list[tuple[str, object]]:
        return [(op, detail) for op, s, detail in self.log if s is stream]


def install_fake_cuda(monkeypatch, gpu: FakeGPU | None = None) -> FakeGPU:
    """Make torch believe it has CUDA, backed by ``gpu`` (a new one by default)."""
    gpu = gpu or FakeGPU()

    @contextlib.contextmanager
    def stream(s):
        previous, gpu.torch_current = gpu.torch_current, s
        gpu.note("issue", s)  # the torch engine issues its copies inside this block
        try:
            yield s
        finally:
            gpu.torch_current = previous

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", gpu.Stream)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: gpu.torch_current)
    monkeypatch.setattr("tiered_kv.transfer.cuda_engine.load_cuda_runtime", lambda: fake_runtime(gpu))
    return gpu


def fake_runtime(gpu: FakeGPU):
    """The raw copy calls, done with memmove on the pointers the engine computes (checked byte for byte)."""
    from tiered_kv.transfer.cuda_engine import CudaRuntime

    def memcpy(dst: int, src: int, n: int, stream: int) -> None:
        gpu.note("memcpy", gpu.streams[stream], n)
        ctypes.memmove(dst, src, n)

    def memcpy2d(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int) -> None:
        gpu.note("memcpy2d", gpu.streams[stream], width * height)
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    return CudaRuntime("fake", memcpy, memcpy2d)


def install_fake_cupy(monkeypatch, gpu: FakeGPU | None = None) -> FakeGPU:
    """Install a fake ``cupy`` on ``gpu`` (and fake torch CUDA too: the tiers are torch's)."""
    gpu = install_fake_cuda(monkeypatch, gpu)
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream = gpu.Stream
    cuda.Event = gpu.Event
    cuda.ExternalStream = lambda ptr, device_id=-1: gpu.streams.get(ptr) or gpu.Stream(ptr=ptr)
    cuda.get_current_stream = lambda: gpu.cupy_current

    def memcpy_async(dst: int, src: int, n: int, kind: int, stream: int) -> None:
        gpu.note("memcpy", gpu.streams[stream], n)
        ctypes.memmove(dst, src, n)

    def memcpy2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind, stream) -> None:
        gpu.note("memcpy2d", gpu.streams[stream], width * height)
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

    cuda.runtime = types.SimpleNamespace(
        memcpyAsync=memcpy_async, memcpy2DAsync=memcpy2d_async, getDeviceCount=lambda: 1
    )

    def get_elapsed_time(start: FakeEvent, end: FakeEvent) -> float:
        return start.elapsed_time(end)

    cuda.get_elapsed_time = get_elapsed_time

    class RawKernel:
        def __init__(self, src: str, name: str) -> None:
            assert "__global__" in src and name in src

        def __call__(self, grid, block, args) -> None:
            src, dst, nbytes = args
            assert grid == (len(src),)
            gpu.launches.append(len(src))
            gpu.note("kernel", gpu.cupy_current, len(src))
            for s, d in zip(src, dst, strict=True):
                ctypes.memmove(d, s, int(nbytes))

    cupy.cuda = cuda
    cupy.RawKernel = RawKernel
    cupy.asarray = lambda xs, dtype=None: list(xs)
    cupy.uint64 = int
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    return gpu
