"""The copy link as crossover measures it: tiers sized for the longest context, swap-out and swap-in timed.

Before anything is allocated, :func:`check_tiers_fit` compares the tiers'
bytes with what is free (device memory for a GPU tier on CUDA, host memory for
everything else) and refuses, with the numbers and the longest context that
would fit, a measurement that cannot run.

:class:`SwapTimer` times a request's swap-out (GPU tier to CPU tier) and
swap-in (back into the same blocks) through the real copy engine, from
submission to completion as the host sees it: what a scheduler waiting on the
copy would wait.  Each point is repeated and reported as a spread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv.bench.timing import spread, sync_device
from tiered_kv.errors import ResourceLimitError
from tiered_kv.sim.budget import human_bytes
from tiered_kv.storage.kv_storage import KVStorage, available_host_bytes
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer.plan import PlanKind, TransferPlan

#: Left free beside the tiers (the interpreter, torch, the model's activations on a CPU).
HOST_MARGIN_BYTES = 1 << 30


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class TierNeed:
    """Bytes the tiers of a crossover measurement take, and where."""

    gpu_tier_bytes: int
    cpu_tier_bytes: int
    gpu_on_device: bool
    extra_device_bytes: int = 0  # model weights and activations beside a GPU tier on CUDA
    extra_host_bytes: int = 0  # the same when everything is in host memory

    @property
    def host_bytes(self) -> int:
        on_host = self.cpu_tier_bytes + (0 if self.gpu_on_device else self.gpu_tier_bytes + self.extra_host_bytes)
        return on_host + HOST_MARGIN_BYTES

    @property
    def device_bytes(self) -> int:
        return self.gpu_tier_bytes + self.extra_device_bytes if self.gpu_on_device else 0


def tier_need(spec: KVSpec, max_tokens: int, gpu_on_device: bool, extra_bytes: int = 0) -> TierNeed:
    """Both tiers hold the longest context once, plus the null block."""
    nb = blocks_for(max_tokens, spec.block_size) + 1
    b = nb * spec.bytes_per_block
    return TierNeed(b, b, gpu_on_device, extra_bytes if gpu_on_device else 0, 0 if gpu_on_device else extra_bytes)


def check_tiers_fit(spec: KVSpec, max_tokens: int, device: str, what: str, extra_bytes: int = 0) -> TierNeed:
    """Raise :class:`ResourceLimitError` (with the numbers) unless the tiers for ``max_tokens`` fit here.

    Args:
        spec: The KV shape.
        max_tokens: The longest context to measure.
        device: Where the GPU tier goes (``"cuda"`` or ``"cpu"``).
        what: Names the measurement in the message.
        extra_bytes: Model weights and activations that share the GPU tier's memory.
    """
    on_device = torch.device(device).type == "cuda"
    need = tier_need(spec, max_tokens, on_device, extra_bytes)
    host_free = available_host_bytes()
    per_token = spec.bytes_per_token
    problems = []
    if need.host_bytes > host_free:
        per_host_token = per_token * (1 if on_device else 2)
        room = host_free - HOST_MARGIN_BYTES - (0 if on_device else extra_bytes)
        problems.append(
            (
                f"{human_bytes(need.host_bytes)} of host memory (CPU tier {human_bytes(need.cpu_tier_bytes)}"
                + ("" if on_device else f", GPU tier {human_bytes(need.gpu_tier_bytes)} in host memory")
                + (f", model {human_bytes(extra_bytes)}" if extra_bytes and not on_device else "")
                + f", {human_bytes(HOST_MARGIN_BYTES)} margin) but only {human_bytes(host_free)} is available",
                room // per_host_token,
            )
        )
    if on_device:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need.device_bytes > free:
            problems.append(
                (
                    f"{human_bytes(need.device_bytes)} of GPU memory (GPU tier {human_bytes(need.gpu_tier_bytes)}"
                    + (f", model {human_bytes(extra_bytes)}" if extra_bytes else "")
                    + f") but only {human_bytes(free)} is free",
                    (free - extra_bytes) // per_token,
                )
            )
    if problems:
        fits = max(0, min(t for _, t in problems) - spec.block_size)
        hint = (
            f"; the longest context that fits is about {fits} tokens (--max-tokens {fits})"
            if fits >= spec.block_size
            else "; nothing fits: free memory first"
        )
        needs = "; and ".join(p for p, _ in problems)
        raise ResourceLimitError(f"{what} up to {max_tokens} tokens needs {needs}{hint}")
    return need


def make_tiers(spec: KVSpec, max_tokens: int, layout: str, device: str) -> dict[str, KVStorage]:
    """A GPU tier on ``device`` and a CPU tier (pinned where CUDA is), each holding the longest context."""
    nb = blocks_for(max_tokens, spec.block_size) + 1
    tiers = {
        "GPU": KVStorage(spec, nb, "GPU", layout, device=device),
        "CPU": KVStorage(spec, nb, "CPU", layout),
    }
    for t in tiers.values():
        t.byte_view().fill_(1)  # touch every page now, not inside the first timed copy
    return tiers


class SwapTimer:
    """Times swap-out and swap-in of the first ``n`` blocks through one copy engine."""

    def __init__(self, engine: Any, device: str) -> None:
        self.engine = engine
        self.device = device
        self.next_id = 0

    def _once(self, src: str, dst: str, n: int) -> tuple[float, float]:
        self.next_id += 1
        ids = tuple(range(1, n + 1))
        out = src == "GPU"
        plan = TransferPlan(
            self.next_id,
            src,
            dst,
            ids,
            ids,
            PlanKind.SWAP_OUT if out else PlanKind.SWAP_IN,
            urgent=not out,
        )
        sync_device(self.device)  # boundary: nothing else is queued when the copy starts
        t0 = time.perf_counter()
        h = self.engine.submit(plan)
        if not h.wait(600):
            raise RuntimeError(f"{'swap-out' if out else 'swap-in'} of {n} blocks failed: {h.error}")
        return time.perf_counter() - t0, h.elapsed_s

    def measure(self, n: int, repeats: int) -> dict[str, Any]:
        """Spreads of host-observed and engine-reported seconds for ``n`` blocks each way, after one untimed round."""
        self._once("GPU", "CPU", n)
        self._once("CPU", "GPU", n)
        walls: dict[str, list[float]] = {"out": [], "in": []}
        engine_s: dict[str, list[float]] = {"out": [], "in": []}
        for _ in range(repeats):
            for key, (src, dst) in (("out", ("GPU", "CPU")), ("in", ("CPU", "GPU"))):
                wall, dev = self._once(src, dst, n)
                walls[key].append(wall)
                engine_s[key].append(dev)
        return {
            "swap_out": spread(walls["out"]),
            "swap_in": spread(walls["in"]),
            "swap_out_engine": spread(engine_s["out"]),
            "swap_in_engine": spread(engine_s["in"]),
        }


def link_name(engine: Any, device: str) -> str:
    """What the measured link is, in words (a CPU machine's copies are host memory to host memory)."""
    kind = type(engine).__name__
    if torch.device(device).type == "cuda":
        return f"GPU memory <-> pinned host memory over the host link ({kind})"
    return f"host memory to host memory, no GPU here ({kind}): not a PCIe measurement"
