"""The serving engine a simulation stands for: a stated setting, ``engine: vllm-0.15.1``.

The same GPU serves the same model at different speeds under different engine
versions, and some behaviours change with the version.  A config names the
engine it simulates; the hardware profile gives one step model per engine
*era* (:data:`ERAS`), never one fitted to a mix of both:

* ``vllm-v0``: vLLM before 0.8.0 (its V0 engine; the published vLLM 0.6.0
  points), whose ``--num-scheduler-steps`` (multi-step scheduling) the
  simulator reproduces with ``compute.scheduler_steps``;
* ``vllm-v1``: vLLM 0.8.0 and later (the V1 engine, the default from 0.8.0,
  vLLM PR #13726), which has no multi-step scheduling.

What else depends on the version (each from vLLM's own code or release notes):

* **async scheduling**, on by default from 0.14.0 (vLLM PR #27614, in the
  "Async Scheduling Plan", vLLM issue #27679): the engine core schedules step
  ``N + 1`` while step ``N`` runs (``EngineCore.step_with_batch_queue``, a batch
  queue of two), so a request that reaches the core while step ``N`` runs is
  first scheduled in step ``N + 2``: its TTFT holds one more step;
* **CUDA graph memory in the KV budget**: from 0.21.0 the worker's memory
  profile subtracts an estimate of the CUDA graphs' memory from the KV cache
  (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, default 1 from 0.21.0: vLLM PR
  #30515 added it off by default; the 0.21.0 log line says "default since
  v0.21.0"); before, the graphs were captured after the KV cache was
  allocated, out of the memory ``gpu_memory_utilization`` leaves over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tiered_kv.errors import ConfigError

#: The engine a config simulates when it names none: the vLLM the v1 step models were fitted to.
DEFAULT_ENGINE = "vllm-0.15.1"
#: The engine eras a hardware profile gives step models for.
ERAS = ("vllm-v1", "vllm-v0")

_V1_FROM = (0, 8, 0)
_ASYNC_FROM = (0, 14, 0)
_CUDAGRAPH_BUDGET_FROM = (0, 21, 0)
_PATTERN = re.compile(r"^vllm-(\d+)\.(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class EngineVersion:
    """A vLLM version and what follows from it (module docstring).

    Attributes:
        name: As the config gives it, ``vllm-X.Y.Z``.
        version: ``(X, Y, Z)``.
    """

    name: str
    version: tuple[int, int, int]

    @property
    def era(self) -> str:
        """The step-model era of the hardware profile this version uses (one of :data:`ERAS`)."""
        return "vllm-v1" if self.version >= _V1_FROM else "vllm-v0"

    @property
    def multi_step(self) -> bool:
        """Whether the engine has multi-step scheduling (``--num-scheduler-steps``, V0 only)."""
        return self.era == "vllm-v0"

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine schedules one step ahead by default (0.14.0 and later)."""
        return self.version >= _ASYNC_FROM

    @property
    def cudagraph_memory_in_budget(self) -> bool:
        """Whether the memory profile takes the CUDA graphs' memory from the KV cache (0.21.0 and later)."""
        return self.version >= _CUDAGRAPH_BUDGET_FROM


def parse_engine(text: object, key: str = "engine") -> EngineVersion:
    """``vllm-X.Y[.Z]`` as an :class:`EngineVersion`; anything else is refused naming ``key`` and the form."""
    m = _PATTERN.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(
            f"{key}: expected the engine and its version as vllm-X.Y.Z (such as {DEFAULT_ENGINE}, or vllm-0.6.0 "
            f"for the published vLLM 0.6 points), got {text!r}"
        )
    major, minor, patch = int(m[1]), int(m[2]), int(m[3] or 0)
    return EngineVersion(f"vllm-{major}.{minor}.{patch}", (major, minor, patch))


def engine_check(value: str) -> str | None:
    """A schema check: None when ``value`` parses, else the reason (the key is added by the schema)."""
    try:
        parse_engine(value)
    except ConfigError as exc:
        return str(exc).split(": ", 1)[1]
    return None
