"""Raw asynchronous copies on a CUDA stream: ``cudaMemcpyAsync`` and ``cudaMemcpy2DAsync``.

A run of blocks is one contiguous region in the block-contiguous layout (one
``cudaMemcpyAsync``) and ``2 * num_layers`` equally spaced pieces in the
layer-first layout: exactly the shape of ``cudaMemcpy2DAsync`` (rows of
``length * segment_bytes`` bytes, a row per layer and K/V, each tier's pitch
being its ``num_blocks * segment_bytes``).  One call per run, whatever the
layout, instead of a torch ``copy_`` per piece: measured on an H200, per-piece
torch copies of layer-first runs reached 3% of the link.

The runtime comes from cupy when it is installed (it wraps libcudart), else
from the ``libcudart`` that torch's CUDA build ships, loaded with ctypes.  Both
take raw device/host addresses and a raw stream handle, so torch tensors and
torch streams work unchanged.  Nothing here runs on import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from tiered_kv.errors import TransferError

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
