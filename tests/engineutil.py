"""Engines available on this machine, and helpers for byte-exact round trips."""

from __future__ import annotations

import importlib.util

import torch

from tiered_kv.storage import KVSpec
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.transfer import ControlledCopyEngine
from tiered_kv.transfer.cpu_engine import CpuCopyEngine
from tiered_kv.transfer.storage_engine import StorageEngineBase

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)
HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = HAS_CUDA and importlib.util.find_spec("cupy") is not None


def tiers(layout: str, gpu_blocks: int = 16, cpu_blocks: int = 16) -> dict[str, KVStorage]:
    return {"GPU": KVStorage(SPEC, gpu_blocks, "GPU", layout), "CPU": KVStorage(SPEC, cpu_blocks, "CPU", layout)}


class ControlledStorageEngine(ControlledCopyEngine):
    """The test-controlled engine, moving real bytes when the test completes a plan."""

    def __init__(self, t: dict[str, KVStorage]) -> None:
        self._mover = StorageEngineBase(t)
        super().__init__({m: s.num_blocks for m, s in t.items()}, SPEC.bytes_per_block, self._copy)

    def _copy(self, plan) -> None:
        for run in self._mover.prepare(plan).chunks:
            for r in run:
                self._mover.copy_run(plan, r)

    def drive(self, handle) -> None:
        self.complete(handle.plan.plan_id)

    def close(self) -> None:
        pass


def make_engine(kind: str, t: dict[str, KVStorage], **kw):
    if kind == "cpu":
        return CpuCopyEngine(t, **kw)
    if kind == "controlled":
        return ControlledStorageEngine(t)
    if kind == "cuda":
        from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

        return TorchCudaCopyEngine(t, **kw)
    from tiered_kv.transfer.cuda_engine import CupyCopyEngine

    return CupyCopyEngine(t, **kw)


def finish(engine, handle) -> bool:
    if isinstance(engine, ControlledStorageEngine):
        engine.drive(handle)
    return handle.wait(10)


def fill_random(st: KVStorage, ids, seed: int) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for b in ids:
        data = torch.randn(st.block(b).shape, generator=g).to(st.kv.dtype)
        if st.layout == "block_contiguous":
            st.kv[b].copy_(data)
        else:
            st.kv[:, :, b].copy_(data)
        out[b] = data.clone()
    return out
