"""Will a simulation fit this machine?  Memory and time, estimated before anything is built.

A config of ``num_requests: 1000000000000`` or ``gpu_blocks: 1000000000``
passes every per-key check, then hangs for days or is killed for memory.  The
simulator's appetite is simple enough to predict: the workload is built in
full up front (a list entry and usually a fresh int per token), every GPU and
CPU block is a small Python object created when the pools are, and the run
time grows with the tokens simulated.  The constants below were measured on
the synthetic experiment (``tracemalloc`` peak; wall time on 2 cores) and carry a
margin; they only need to be right within a small factor to tell a long run
from an absurd one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv.errors import ConfigError, ResourceLimitError
from tiered_kv.sim.config import RunSetup
from tiered_kv.sim.workload import SimRequest, WorkloadSize, generate, size

# Measured about 31 B per workload token at peak (ids, prompt/output lists, the running copy); x2 margin.
BYTES_PER_TOKEN = 64
# Measured about 120 B per pool block (the block, its free-queue entry, its hash once cached); x2 margin.
BYTES_PER_BLOCK = 256
# The interpreter, the imports and the results.
BASE_BYTES = 256 << 20
# Measured about 1.1 us of wall time per workload token and run (the synthetic experiment, 2 cores); x2 margin.
SECONDS_PER_TOKEN = 2e-6
# Longer than this is not an experiment but a mistake in a config.
MAX_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Machine:
    """What the estimate is held against: physical memory in bytes (None where unknown)."""

    memory_bytes: int | None

    @classmethod
    def this(cls) -> Machine:
        try:
            return cls(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            return cls(None)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Peak memory (bytes) and wall time (seconds) of one command."""

    memory_bytes: int
    seconds: float
    workload_bytes: int
    block_bytes: int


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    for limit, div, unit in (
        (120, 1, "s"),
        (7200, 60, "min"),
        (2 * 86400, 3600, "hours"),
        (730 * 86400, 86400, "days"),
    ):
        if s < limit:
            return f"{s / div:.0f} {unit}"
    return f"{s / (365 * 86400):.3g} years"


def estimate(
    work: WorkloadSize, setups: Sequence[RunSetup], cells: int, parallel: int = 1, local_parallel: int | None = None
) -> Estimate:
    """Memory and time of ``cells`` simulations of ``work`` on pools like ``setups``.

    ``parallel`` simulations run at a time, ``local_parallel`` of them
    (default: all) on this machine; each holds its own workload and pools.
    """
    blocks = max(s.manager.num_gpu_blocks + s.manager.num_cpu_blocks for s in setups)
    wl = work.tokens * BYTES_PER_TOKEN + work.requests * 512
    bl = blocks * BYTES_PER_BLOCK
    lanes = max(1, min(parallel, cells))
    here = lanes if local_parallel is None else max(1, min(local_parallel, cells))
    return Estimate(BASE_BYTES + here * (wl + bl), cells * work.tokens * SECONDS_PER_TOKEN / lanes, wl, bl)


def check(
    work: WorkloadSize,
    setups: Sequence[RunSetup],
    cells: int,
    parallel: int = 1,
    local_parallel: int | None = None,
    machine: Machine | None = None,
) -> Estimate:
    """Refuse, with the numbers, a simulation that cannot run or would not fit this machine.

    Raises:
        ConfigError: a request longer than the smallest GPU pool (it could never be scheduled).
        ResourceLimitError: more memory than the machine has, or more than :data:`MAX_SECONDS`.
    """
    machine = machine or Machine.this()
    smallest = min(setups, key=lambda s: s.manager.num_gpu_blocks)
    need = -(-work.longest // smallest.manager.block_size)
    if need > smallest.manager.num_gpu_blocks - 1:
        raise ConfigError(
            f"{work.longest_key}: a request of {work.longest} tokens needs {need} GPU blocks, more than the "
            f"{smallest.manager.num_gpu_blocks - 1} of run {smallest.name!r}; it could never run"
        )
    est = estimate(work, setups, cells, parallel, local_parallel)
    wkey = "workload.trace" if work.longest_key.startswith("workload.trace") else "workload.num_requests"
    if machine.memory_bytes is not None and est.memory_bytes > machine.memory_bytes:
        if est.block_bytes > est.workload_bytes:
            big = max(setups, key=lambda s: s.manager.num_gpu_blocks + s.manager.num_cpu_blocks)
            m = big.manager
            cause = (
                f"memory: {m.num_gpu_blocks} GPU + {m.num_cpu_blocks} CPU blocks (run {big.name!r})",
                "use fewer blocks (memory.gpu_blocks/cpu_blocks, or smaller *_kv_gib)",
            )
        else:
            cause = (
                f"{wkey}: {work.requests} requests of about {work.tokens / max(work.requests, 1):.0f} tokens each",
                "simulate fewer or shorter requests",
            )
        here = parallel if local_parallel is None else local_parallel
        per = f", {here} at a time" if here > 1 else ""
        raise ResourceLimitError(
            f"{cause[0]} would need about {human_bytes(est.memory_bytes)} of memory{per}, but this machine has "
            f"{human_bytes(machine.memory_bytes)}; {cause[1]}"
        )
    if est.seconds > MAX_SECONDS:
        raise ResourceLimitError(
            f"{wkey}: {cells} simulation(s) of {work.requests} requests ({work.tokens:.3g} tokens) would take "
            f"about {human_seconds(est.seconds)} here, over the "
            f"{human_seconds(MAX_SECONDS)} limit; simulate fewer or shorter requests"
        )
    return est


def build_workload(
    cfg: dict[str, Any], setups: Sequence[RunSetup], cells: int | None = None, parallel: int = 1
) -> list[SimRequest]:
    """Size the config's workload, :func:`check` it, then generate it."""
    check(size(cfg["workload"]), setups, len(setups) if cells is None else cells, parallel)
    return generate(cfg["workload"], cfg["seed"])
