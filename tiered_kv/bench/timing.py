"""Timing helpers shared by ``crossover`` and ``gpu-check``: repeated points, their spread, rows saved as measured.

* :func:`spread` summarises the samples of one point as min / median / max, so a
  noisy point shows as a wide spread instead of hiding behind a best-of-N.
* :class:`Stopwatch` times work on the compute stream: with CUDA events on a
  GPU (the host waits once, at the end of the measurement), with the host
  clock on a CPU, where every torch op is synchronous.
* :class:`RowFile` appends one JSON line per measured row and flushes it, so a
  killed run keeps every row it finished.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch


def spread(samples: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "n", "samples"}`` of one measured point (seconds)."""
    if not samples:
        raise ValueError("spread() needs at least one sample")
    return {
        "min": min(samples),
        "median": statistics.median(samples),
        "max": max(samples),
        "n": len(samples),
        "samples": list(samples),
    }


def relative_spread(s: dict[str, Any]) -> float:
    """``(max - min) / median``: how far apart the repeats of one point landed."""
    return (s["max"] - s["min"]) / s["median"] if s["median"] > 0 else 0.0


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def sync_device(device: str | torch.device) -> None:
    """Wait for everything queued on the device (a measurement boundary, never inside a measured region)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


class Stopwatch:
    """Times a callable on the current stream.

    On CUDA the start and end are events recorded on the current stream, so the
    result is device time of the queued work and the host waits once, after
    the end event.  On a CPU the ops run synchronously and the host clock is
    the truth.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = is_cuda(device)
        self.device = device

    def time(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn``'s work took, measured after everything queued before it finished."""
        sync_device(self.device)
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def repeat(self, fn: Callable[[], object], repeats: int) -> dict[str, Any]:
        """Run ``fn`` once untimed (first-call set-up), then ``repeats`` times timed."""
        fn()
        return spread([self.time(fn) for _ in range(repeats)])


class RowFile:
    """An append-only JSON Lines file, flushed after every row.

    Args:
        path: Where the rows go (parent directories are created); ``None`` keeps
            rows in memory only.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._fh: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = path.open("w", encoding="utf-8")

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._fh is not None:
            self._fh.write(json.dumps(row) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RowFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
