"""Counting host synchronisations, three independent ways, and the Perfetto trace they are read from.

A region of code "makes no host synchronisation" when the host never waits
for the device inside it.  gpu-check looks for waits with three instruments,
each of which sees something the others miss:

* :class:`SyncCounter` counts calls of torch's explicit waits made from Python
  (``torch.cuda.synchronize``, ``Stream.synchronize``, ``Event.synchronize``)
  while a region is open: what the copy engines or the model would call.
* :class:`SyncDebug` turns on torch's sync debug mode (CUDA only) and counts
  its warnings: the waits hidden inside torch ops (``.item()``, a device tensor
  built from a Python list, a copy to pageable memory).
* :func:`trace_syncs` reads the exported profiler trace and counts the CUDA
  runtime and driver calls that block the host (``*Synchronize``, synchronous
  ``cudaMemcpy``) inside the region's annotation: this sees every library,
  cupy included, because it is recorded below them.

:func:`region_name` names the annotation; a region is opened with
``torch.profiler.record_function(region_name(...))``.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

REGION_PREFIX = "gpu_check/"
#: Runtime and driver calls after which the host has waited for the device.
BLOCKING_CALL = re.compile(r"(Synchronize|^cudaMemcpy$|^cudaMemcpy2D$|^cuMemcpyDtoH|^cuMemcpyHtoD(?!.*Async))")


def region_name(name: str) -> str:
    return REGION_PREFIX + name


class SyncCounter:
    """Counts explicit host waits made through torch's Python API while open.

    The wrapped functions still run; each call while a region is open adds one
    to ``counts[name]``.  Installed once, removed by :meth:`uninstall`.
    """

    TARGETS = (
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
        (torch.cuda.Event, "synchronize", "Event.synchronize"),
    )

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.open = False
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> SyncCounter:
        for owner, attr, label in self.TARGETS:
            original = getattr(owner, attr)
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._wrap(original, label))
        return self

    def _wrap(self, fn: Any, label: str) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.open:
                self.counts[label] += 1
            return fn(*args, **kwargs)

        return counted

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def __enter__(self) -> SyncCounter:
        self.open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.open = False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class SyncDebug:
    """torch's sync debug mode ("warn") while open; counts the synchronising ops it reports.

    Only CUDA builds have the mode: elsewhere ``available`` is False and nothing is counted.
    """

    def __init__(self) -> None:
        self.available = torch.cuda.is_available() and hasattr(torch.cuda, "set_sync_debug_mode")
        self.messages: Counter[str] = Counter()
        self._catch: Any = None

    def __enter__(self) -> SyncDebug:
        if self.available:
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
            for w in self._log:
                text = str(w.message)
                if "synchroniz" in text.lower():
                    self.messages[text.split("\n")[0][:120]] += 1

    @property
    def total(self) -> int:
        return sum(self.messages.values())


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a Chrome/Perfetto JSON trace (plain or gzipped)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(raw)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def trace_syncs(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Blocking CUDA calls inside each occurrence of the annotation ``name`` (same thread, within its span).

    Returns ``{"regions": occurrences found, "calls": {call name: count}, "total": n,
    "cuda_api_events": CUDA runtime/driver events seen in the regions}``.
    """
    spans = [
        (e["pid"], e["tid"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("name") == name and e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]
    calls: Counter[str] = Counter()
    api = 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        ts = float(e["ts"])
        if not any(p == e["pid"] and t == e["tid"] and a <= ts <= b for p, t, a, b in spans):
            continue
        api += 1
        if BLOCKING_CALL.search(e.get("name", "")):
            calls[e["name"]] += 1
    return {"regions": len(spans), "calls": dict(calls), "total": sum(calls.values()), "cuda_api_events": api}


def profiler_activities() -> list[Any]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts
