"""Layer 1: transfer plans and copy engines.

``plan``, ``coalesce``, ``engine`` and ``controlled`` are standard library only;
the torch, CUDA and cupy engines live in their own modules and import torch.
"""

from tiered_kv.transfer.coalesce import CopyRun, chunk_runs, coalesce, count_runs
from tiered_kv.transfer.controlled import ControlledCopyEngine
from tiered_kv.transfer.engine import CopyEngine
from tiered_kv.transfer.plan import CPU, GPU, PlanKind, TransferHandle, TransferPlan, TransferStatus

__all__ = [
    "CPU",
    "GPU",
    "ControlledCopyEngine",
    "CopyEngine",
    "CopyRun",
    "PlanKind",
    "TransferHandle",
    "TransferPlan",
    "TransferStatus",
    "chunk_runs",
    "coalesce",
    "count_runs",
]
