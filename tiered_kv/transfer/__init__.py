"""Layer 1: transfer plans and copy engines.

``plan``, ``engine``, ``controlled``, ``event_handle`` and
``factory`` are standard library only; the torch, CUDA and cupy engines live in
their own modules and import torch (the factory imports them only when it
builds one).
"""

from tiered_kv.transfer.controlled import ControlledCopyEngine
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.factory import EngineUnavailableError, available_kinds, make_copy_engine
from tiered_kv.transfer.plan import (
    CPU,
    GPU,
    CopyRun,
    PlanKind,
    TransferHandle,
    TransferPlan,
    TransferStatus,
    chunk_runs,
    coalesce,
    count_runs,
)

__all__ = [
    "CPU",
    "GPU",
    "ControlledCopyEngine",
    "CopyEngine",
    "CopyRun",
    "EngineUnavailableError",
    "PlanKind",
    "TransferHandle",
    "TransferPlan",
    "TransferStatus",
    "available_kinds",
    "chunk_runs",
    "coalesce",
    "count_runs",
    "make_copy_engine",
]
