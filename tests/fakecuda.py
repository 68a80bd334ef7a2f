"""CPU stand-ins for the CUDA stream/event API and for cupy, to run the GPU engines' logic here.

Copies happen synchronously on the CPU.  The cupy fake performs ``memcpyAsync``
and the gather kernel with ``ctypes.memmove`` on the raw pointers the engine
computes, so the engine's pointer arithmetic is checked byte for byte.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import torch


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_on = None

    def record(self, stream=None) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return True

    done = True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeStream:
    def __init__(self, priority: int = 0, non_blocking: bool = False) -> None:
        self.priority = priority
        self.ptr = id(self)
        self.waited_on: list = []

    @staticmethod
    def priority_range():
        return (0, -1)

    def wait_event(self, ev) -> None:
        self.waited_on.append(ev)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_current = FakeStream()


def install_fake_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _current)


def install_fake_cupy(monkeypatch) -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.Stream = FakeStream
    cuda.Event = FakeEvent
    cuda.runtime = types.SimpleNamespace(memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cuda.get_elapsed_time = lambda a, b: 0.0
    launches: list[int] = []

    class RawKernel:
        def __init__(self, src: str, name: str) -> None:
            assert "__global__" in src and name in src

        def __call__(self, grid, block, args) -> None:
            src, dst, nbytes = args
            assert grid == (len(src),)
            launches.append(len(src))
            for s, d in zip(src, dst, strict=True):
                ctypes.memmove(d, s, int(nbytes))

    cupy.cuda = cuda
    cupy.RawKernel = RawKernel
    cupy.asarray = lambda xs, dtype=None: list(xs)
    cupy.uint64 = int
    cupy.launches = launches
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    return cupy
