"""TorchCudaCopyEngine: the shared issuing path (:mod:`~tiered_kv.transfer.stream_engine`) on torch CUDA streams.

What is torch's here: the streams (urgent swap-ins get a high-priority stream
of their own), torch CUDA events, the compute stream (torch's current stream
unless one is given), and the copies: one raw ``cudaMemcpyAsync`` /
``cudaMemcpy2DAsync`` per run through :mod:`tiered_kv.transfer.cudart` where
the runtime loads, else torch ``copy_`` calls issued with the lane stream made
current.  Large plans are issued as chunks of bounded size so other streams'
copies interleave with them on the copy engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from tiered_kv import checks
from tiered_kv.errors import TransferError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer.availability import require
from tiered_kv.transfer.cudart import load_cuda_runtime
from tiered_kv.transfer.event_handle import TorchEvents
from tiered_kv.transfer.plan_events import DEFAULT_MAX_TRACKED_PLANS, PlanEvents
from tiered_kv.transfer.stream_engine import StreamCopyEngine

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
            per run (:mod:`tiered_kv.transfer.cudart`); ``"torch"``: torch
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
