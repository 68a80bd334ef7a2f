"""A Chrome/Perfetto trace of one simulation (``tiered-kv simulate --timeline``).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev.  Each run is
a process with three tracks: the compute steps, and the copies in each
direction, so a reader sees copies overlap compute (async), the compute
stream wait for them (blocking: a ``waiting for copies`` slice before the
step) or a step stretched by the swap-in it reads (layerwise).  A run with
tiers below the CPU adds a track per tier and direction (``DISK load``: into
the CPU tier; ``DISK store``: out of it).  Times are simulated microseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_kv.sim.simulator import Simulator

TRACKS = {"compute": 1, "H2D": 2, "D2H": 3}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(sim: Simulator, name: str, pid: int = 1) -> list[dict[str, Any]]:
    """The trace events of a finished simulation that kept its timeline (``keep_timeline=True``)."""
    if sim.steps is None or sim.engine.jobs is None:
        raise ValueError("the simulation did not keep its timeline (Simulator(keep_timeline=True))")
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}]
    for track, tid in TRACKS.items():
        label = "compute" if track == "compute" else f"copies {track}"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
    _steps(sim, pid, events)
    _copies(sim, pid, events)
    _tier_io(sim, pid, events)
    return events


def _slice(
    name: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any] | None = None
) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": _us(start), "dur": _us(end - start)}
    if args is not None:
        event["args"] = args
    return event


def _steps(sim: Simulator, pid: int, events: list[dict[str, Any]]) -> None:
    """The compute track: each step, after a ``waiting for copies`` slice when it had to wait."""
    for s in sim.steps or ():
        if s.start > s.issued:
            events.append(_slice("waiting for copies", pid, 1, s.issued, s.start))
        args = {
            "requests": s.num_seqs,
            "tokens": s.num_tokens,
            "compute_ms": round(s.compute_s * 1e3, 6),
            "waiting_on_layerwise_copies_ms": round((s.end - s.start - s.compute_s) * 1e3, 6),
            "preempted": s.preempted,
            "resumed": s.resumed,
        }
        events.append(_slice(f"step {s.index}", pid, 1, s.start, s.end, args))


def _copies(sim: Simulator, pid: int, events: list[dict[str, Any]]) -> None:
    """The two copy tracks: every GPU<->CPU copy that ran."""
    for j in sim.engine.jobs or ():
        if j.start < 0 or j.end < 0:
            continue
        plan = j.plan
        args = {
            "request": plan.request_id if isinstance(plan.request_id, int | str) else str(plan.request_id),
            "blocks": plan.num_blocks,
            "bytes": j.nbytes,
            "copies": j.copies,
            "ordered_before_compute": j.early,
        }
        name = f"{plan.kind.value} {plan.plan_id}"
        events.append(_slice(name, pid, TRACKS.get(j.direction, 4), j.start, j.end, args))


def _tier_io(sim: Simulator, pid: int, events: list[dict[str, Any]]) -> None:
    """One track per tier below the CPU and direction."""
    tid = max(TRACKS.values()) + 1
    for medium, engine in sim.tier_engines.items():
        for op in ("load", "store"):
            tid += 1
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"{medium} {op}"}}
            )
            for t in engine.jobs:
                if t.op != op:
                    continue
                plan = t.handle.plan
                args = {"blocks": plan.num_blocks, "bytes": t.handle.num_bytes}
                events.append(_slice(f"{plan.kind.value} {plan.plan_id}", pid, tid, t.start, t.end, args))
