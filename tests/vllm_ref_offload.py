"""vLLM 0.33.0's own CPU offloading manager and cache policies, imported from its wheel.

Only ``vllm/v1/kv_offload/{base,config}.py``, ``cpu/{common,manager}.py`` and
``cpu/policies/*.py`` are loaded, from the tree :func:`vllm_source.vllm_source`
unpacks.  The packages above them are made as empty namespaces (so vLLM's
``__init__`` modules, which import the whole engine, never run), and the few
modules they import that are not pure Python bookkeeping are stubbed:
``vllm.logger`` (a logger), ``vllm.v1.kv_hints`` (a type used only in an
annotation) and the offloading connector's metrics (a stats record that keeps
what is set on it).  torch and numpy are real.

The modules sit in ``sys.modules`` only while they import (and while one of
vLLM's test files imports, :func:`load_test_module`); then every ``vllm`` entry
is taken out again and whatever was there before is put back, so the rest of
the suite still sees that vLLM is not installed.  The policy registry's lazy
loaders are pointed at the classes already imported, so that building vLLM's
manager imports nothing later.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

from vllm_source import vllm_source

_STUBBED = "_tiered_kv_stubbed"
_LOADED: types.SimpleNamespace | None = None
_MODULES: dict[str, types.ModuleType] = {}


def _package(name: str, path: Path | None) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)] if path is not None else []  # type: ignore[attr-defined]
        setattr(mod, _STUBBED, True)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    return mod


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        setattr(mod, _STUBBED, True)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, mod)
    for k, v in attrs.items():
        if not hasattr(mod, k):
            setattr(mod, k, v)
    return mod


class _Logger(logging.LoggerAdapter):
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)

    def info_once(self, *args: Any, **kwargs: Any) -> None:
        self.info(*args, **kwargs)


def _init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})


class OffloadingConnectorStats:
    """Keeps what the manager sets: the latest gauge, every histogram sample, counter sums."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = {}
        self.counters: dict[str, float] = {}

    def set_gauge(self, name: str, value: float, labelvalues: tuple = ()) -> None:
        self.gauges[name] = value

    def observe_histogram(self, name: str, value: float, labelvalues: tuple = ()) -> None:
        self.histograms.setdefault(name, []).append(value)

    def increase_counter(self, name: str, value: float = 1, labelvalues: tuple = ()) -> None:
        self.counters[name] = self.counters.get(name, 0) + value

    def reduce(self) -> dict[str, Any]:
        """As vLLM's: counters and gauges by name, each histogram as ``name_count`` and ``name_sum``."""
        out: dict[str, Any] = {**self.counters, **self.gauges}
        for name, values in self.histograms.items():
            out[f"{name}_count"] = len(values)
            out[f"{name}_sum"] = sum(values)
        return out


def load() -> types.SimpleNamespace:
    """vLLM's modules, as a namespace: ``base``, ``manager``, ``policies_base``, ``lru``, ``arc``, ``factory``."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    src = vllm_source()
    root = src / "vllm"
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] == "vllm"}
    for k in saved:
        del sys.modules[k]
    try:
        for name in ("vllm", "vllm.v1", "vllm.v1.kv_offload", "vllm.v1.kv_offload.cpu",
                     "vllm.v1.kv_offload.cpu.policies", "vllm.v1.metrics", "vllm.utils", "vllm.distributed",
                     "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                     "vllm.distributed.kv_transfer.kv_connector.v1",
                     "vllm.distributed.kv_transfer.kv_connector.v1.offloading"):  # fmt: skip
            _package(name, root.joinpath(*name.split(".")[1:]))
        _module("vllm.logger", init_logger=_init_logger)
        _module("vllm.v1.kv_hints", KvHintsEnvelope=object, KvHintAction=object)
        _module(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
            OffloadingConnectorStats=OffloadingConnectorStats,
        )
        imp = importlib.import_module
        ns = types.SimpleNamespace(
            base=imp("vllm.v1.kv_offload.base"),
            common=imp("vllm.v1.kv_offload.cpu.common"),
            manager=imp("vllm.v1.kv_offload.cpu.manager"),
            policies_base=imp("vllm.v1.kv_offload.cpu.policies.base"),
            lru=imp("vllm.v1.kv_offload.cpu.policies.lru"),
            arc=imp("vllm.v1.kv_offload.cpu.policies.arc"),
            factory=imp("vllm.v1.kv_offload.cpu.policies.factory"),
            src=src,
        )
        registry = ns.factory.CachePolicyFactory._registry
        registry["lru"] = lambda: ns.lru.LRUCachePolicy
        registry["arc"] = lambda: ns.arc.ARCCachePolicy
        _MODULES.update({k: m for k, m in sys.modules.items() if k.split(".")[0] == "vllm"})
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
            del sys.modules[k]
        sys.modules.update(saved)
    _LOADED = ns
    return ns


def load_test_module(rel: str, name: str, replace: dict[str, Any]) -> types.ModuleType:
    """One of vLLM's test files, imported with ``replace`` (module attribute -> object) applied afterwards."""
    src = load().src
    spec = importlib.util.spec_from_file_location(name, src / rel)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] == "vllm"}
    try:
        for k in saved:
            del sys.modules[k]
        sys.modules.update(_MODULES)
        spec.loader.exec_module(mod)
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "vllm"]:
            del sys.modules[k]
        sys.modules.update(saved)
    for k, v in replace.items():
        setattr(mod, k, v)
    return mod
