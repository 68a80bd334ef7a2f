"""The bench of ``tiered-kv crossover``: two tiers, the copy engine and the model, timing one operation at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tiered_kv.engine.model import ModelConfig, TinyLlama
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tools.crossover_timing import spread
from tiered_kv.transfer.factory import make_copy_engine
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.current_stream().synchronize()  # measurement boundary only


class SwapRig:
    """What one measurement run times with: a GPU and a CPU tier, the copy engine and the model.

    Blocks ``1..max_blocks`` hold the measured context, ``max_blocks+1..``
    receive its swap-in, and a scratch context of 256 tokens after both runs
    the decode loop that computes beside the copies.
    """

    __slots__ = ("copy", "device", "model", "next_plan_id", "repeats", "scratch", "tiers")

    def __init__(
        self, config: ModelConfig, block_size: int, layout: str, max_blocks: int, repeats: int, device: str
    ) -> None:
        spec = config.kv_spec(block_size)
        scratch_blocks = 256 // block_size
        n_blocks = 2 * max_blocks + 2 + scratch_blocks
        self.tiers = {
            "GPU": KVStorage(spec, n_blocks, "GPU", layout, device=device),
            "CPU": KVStorage(spec, n_blocks, "CPU", layout),
        }
        for t in self.tiers.values():
            t.byte_view().zero_()
        self.copy = make_copy_engine(self.tiers)
        self.model = TinyLlama(config, device)
        self.device = device
        self.repeats = repeats
        self.next_plan_id = 0
        self.scratch = list(range(2 * max_blocks + 1, 2 * max_blocks + 1 + scratch_blocks))

    def submit(self, src_m: str, dst_m: str, src: list[int], dst: list[int]) -> TransferHandle:
        """Hand one copy to the engine (a swap-in is urgent) and return its handle."""
        self.next_plan_id += 1
        kind = PlanKind.SWAP_OUT if dst_m == "CPU" else PlanKind.SWAP_IN
        plan = TransferPlan(self.next_plan_id, src_m, dst_m, tuple(src), tuple(dst), kind, urgent=dst_m == "GPU")
        return self.copy.submit(plan)

    def transfer(self, src_m: str, dst_m: str, src: list[int], dst: list[int]) -> float:
        """Seconds from submitting one copy, nothing else queued, until it has landed."""
        _sync(self.device)
        t0 = time.perf_counter()
        h = self.submit(src_m, dst_m, src, dst)
        if not h.wait(60):
            raise RuntimeError(f"copy failed: {h.error}")
        return time.perf_counter() - t0

    def beside_compute(self, table: list[int], other: list[int]) -> float:
        """Both directions at once while a decode loop runs on a third context.

        Timed by the copies' own completion stamps (set when each finishes), so the
        result is not rounded up to whole decode steps.
        """
        _sync(self.device)
        handles = [self.submit("GPU", "CPU", table, table), self.submit("CPU", "GPU", table, other)]
        while not all(h.done() for h in handles):
            self.model.forward_chunk([1], 255, self.scratch, self.tiers["GPU"])  # one decode step
        for h in handles:
            if not h.wait(60):
                raise RuntimeError(f"copy failed: {h.error}")
        return max(h.elapsed_s for h in handles)

    def prefill(self, tokens: list[int], table: list[int]) -> float:
        """Seconds of a prefill of ``tokens`` into the blocks of ``table``: the recompute."""
        _sync(self.device)
        t0 = time.perf_counter()
        self.model.forward_chunk(tokens, 0, table, self.tiers["GPU"])
        _sync(self.device)
        return time.perf_counter() - t0

    def point(self, fn: Callable[[], float]) -> dict[str, Any]:
        """The spread of ``repeats`` timed calls of ``fn``, after one untimed."""
        fn()  # untimed: the first call pays for set-up, not for the work
        return spread([fn() for _ in range(self.repeats)])

    def close(self) -> None:
        if hasattr(self.copy, "close"):
            self.copy.close()
