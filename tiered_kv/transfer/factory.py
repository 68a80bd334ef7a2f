"""The one place that chooses a copy engine, and which engines this machine can run.

``make_copy_engine(tiers, kind)`` returns:

* ``"cuda"``: :class:`~tiered_kv.transfer.cuda_engine.TorchCudaCopyEngine`;
* ``"cupy"``: :class:`~tiered_kv.transfer.cuda_engine.CupyCopyEngine`;
* ``"cpu"``: :class:`~tiered_kv.transfer.cpu_engine.CpuCopyEngine`;
* ``"auto"``: the torch CUDA engine when CUDA is available and the GPU tier
  lives on a CUDA device, else the CPU engine.  The cupy engine is never chosen
  by itself: it is an alternative to measure, not a better default.

An engine that was asked for by name and cannot run here raises
:class:`EngineUnavailableError` naming what is missing; nothing falls back to
the CPU engine, so a CPU engine's numbers can never be reported under a GPU
engine's name (wrong data, not a degraded result).  For the same reason a
device engine refuses a GPU tier held in host memory.

torch and cupy are imported only when an engine is built or a probe runs, so
importing this module needs the standard library alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tiered_kv import checks
from tiered_kv.errors import ConfigError, InvalidArgumentError, TransferError

if TYPE_CHECKING:
    from tiered_kv.storage.kv_storage import KVStorage
    from tiered_kv.transfer.storage_engine import StorageEngineBase

#: Accepted values of ``kind``.
KINDS = ("auto", "cpu", "cuda", "cupy")
ENGINE_KINDS = KINDS[1:]  # the engines themselves: "auto" picks one of them
#: Engine kinds that need a CUDA device.
DEVICE_KINDS = ("cuda", "cupy")

_CLASS_NAMES = {"cpu": "CpuCopyEngine", "cuda": "TorchCudaCopyEngine", "cupy": "CupyCopyEngine"}


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


def available_kinds() -> list[str]:
    """The engine kinds that can run on this machine, ``"cpu"`` first."""
    return [k for k in ("cpu", "cuda", "cupy") if missing(k) is None]


def resolve_kind(tiers: Mapping[str, KVStorage], kind: str = "auto") -> str:
    """The concrete kind (``"cpu"``, ``"cuda"`` or ``"cupy"``) that ``make_copy_engine`` would build.

    Raises:
        InvalidArgumentError: ``kind`` is not one of :data:`KINDS`, or ``tiers`` is not a mapping.
        EngineUnavailableError: ``kind`` names an engine this machine cannot run.
        ConfigError: a device engine was asked for but the GPU tier is in host memory.
    """
    checks.choice("kind", kind, KINDS)
    checks.instance("tiers", tiers, Mapping)
    if kind == "auto":
        return "cuda" if missing("cuda") is None and _gpu_tier_device(tiers) == "cuda" else "cpu"
    if kind in DEVICE_KINDS:
        require(kind, _CLASS_NAMES[kind])
        where = _gpu_tier_device(tiers)
        if where != "cuda":
            place = "missing" if where is None else f"on {where}"
            raise ConfigError(
                f"{_CLASS_NAMES[kind]} copies device memory, but the GPU tier is {place}; "
                "allocate it on a CUDA device or ask for kind='cpu'"
            )
    return kind


def make_copy_engine(tiers: Mapping[str, KVStorage], kind: str = "auto", **options: Any) -> StorageEngineBase:
    """Build the copy engine ``kind`` over ``tiers``.

    Args:
        tiers: ``{"GPU": ..., "CPU": ...}`` storage the engine moves bytes between.
        kind: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cupy"`` (see the module docstring).
        **options: Passed to the engine's constructor (``max_blocks_per_chunk``,
            ``record``, and each engine's own: ``copy_hook`` (cpu), ``kernel_min_runs``
            (cupy), ``max_tracked_plans`` (cuda, cupy)).

    Raises:
        InvalidArgumentError: ``kind`` is unknown, or an option is not one the chosen engine takes.
        EngineUnavailableError: ``kind`` names an engine this machine cannot run.
        ConfigError: a device engine was asked for but the GPU tier is in host memory.
    """
    concrete = resolve_kind(tiers, kind)
    cls = _engine_class(concrete)
    try:
        inspect.signature(cls).bind(tiers, **options)
    except TypeError as exc:
        raise InvalidArgumentError(f"{cls.__name__} does not take these options {sorted(options)}: {exc}") from None
    return cls(tiers, **options)


def _gpu_tier_device(tiers: Mapping[str, KVStorage]) -> str | None:
    """The device type (``"cuda"``, ``"cpu"``) where the GPU tier's bytes live; ``None`` without a GPU tier."""
    gpu = tiers.get("GPU")
    if gpu is None:
        return None
    device = getattr(gpu, "device", None)
    return getattr(device, "type", str(device))


def _engine_class(kind: str) -> type[StorageEngineBase]:
    if kind == "cuda":
        from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

        return TorchCudaCopyEngine
    if kind == "cupy":
        from tiered_kv.transfer.cuda_engine import CupyCopyEngine

        return CupyCopyEngine
    from tiered_kv.transfer.cpu_engine import CpuCopyEngine

    return CpuCopyEngine
