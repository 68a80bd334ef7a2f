"""The one place that chooses a copy engine.

``make_copy_engine(tiers, kind)`` returns:

* ``"cuda"``: :class:`~tiered_kv.transfer.cuda_engine.TorchCudaCopyEngine`;
* ``"cupy"``: :class:`~tiered_kv.transfer.cuda_engine.CupyCopyEngine`;
* ``"cpu"``: :class:`~tiered_kv.transfer.cpu_engine.CpuCopyEngine`;
* ``"auto"``: the torch CUDA engine when CUDA is available and the GPU tier
  lives on a CUDA device, else the CPU engine.  The cupy engine is never chosen
  by itself: it is an alternative to measure, not a better default.

An engine that was asked for by name and cannot run here raises
:class:`~tiered_kv.transfer.availability.EngineUnavailableError` naming what is
missing; nothing falls back to the CPU engine, so a CPU engine's numbers can
never be reported under a GPU engine's name.  For the same reason a device
engine refuses a GPU tier held in host memory.

torch and cupy are imported only when an engine is built, so importing this
module needs the standard library alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tiered_kv import checks
from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.transfer.availability import DEVICE_KINDS, missing, require

if TYPE_CHECKING:
    from tiered_kv.storage.kv_storage import KVStorage
    from tiered_kv.transfer.storage_engine import StorageEngineBase

#: Accepted values of ``kind``.
KINDS = ("auto", "cpu", "cuda", "cupy")
ENGINE_KINDS = KINDS[1:]  # the engines themselves: "auto" picks one of them

_CLASS_NAMES = {"cpu": "CpuCopyEngine", "cuda": "TorchCudaCopyEngine", "cupy": "CupyCopyEngine"}


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
