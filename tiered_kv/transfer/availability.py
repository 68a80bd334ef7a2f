"""Which copy engines this machine can run, and the error for one it cannot.

The probes import torch and cupy only when called, so importing this module
(and the ``transfer`` package) needs the standard library alone.  A missing
backend is an error that names what is missing; nothing here falls back to
another engine, because a CPU engine's numbers reported under a GPU engine's
name would be wrong data, not a degraded result.
"""

from __future__ import annotations

from tiered_kv.errors import TransferError

#: Engine kinds that need a CUDA device.
DEVICE_KINDS = ("cuda", "cupy")


class EngineUnavailableError(TransferError):
    """A copy engine was asked for on a machine that cannot run it (no CUDA, no cupy)."""


def cuda_missing() -> str | None:
    """Why torch cannot drive CUDA here, or ``None`` when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} ({build}) sees no CUDA device"
    return None


def cupy_missing() -> str | None:
    """Why cupy cannot drive CUDA here, or ``None`` when it can."""
    try:
        import cupy
    except Exception as exc:  # a broken install raises more than ImportError
        return f"cupy is not importable ({exc}); install it with pip install 'tiered-kv[cupy]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver: cupy raises its own CUDARuntimeError
        return f"cupy sees no CUDA device ({exc})"
    if count < 1:
        return "cupy sees no CUDA device"
    return None


def missing(kind: str) -> str | None:
    """Why the engine ``kind`` ("cpu", "cuda" or "cupy") cannot run here, or ``None``."""
    if kind == "cuda":
        return cuda_missing()
    if kind == "cupy":
        # The tiers are torch tensors, so the cupy engine needs torch's CUDA as well.
        return cupy_missing() or cuda_missing()
    return None


def require(kind: str, engine_name: str) -> None:
    """Raise :class:`EngineUnavailableError` naming what ``engine_name`` lacks here."""
    reason = missing(kind)
    if reason is not None:
        raise EngineUnavailableError(f"{engine_name} cannot run here: {reason}")
