"""Which package files a swap preemption and an admission go through, traced call by call.

A tiny scheduler run (three 10-token requests, 8 usable GPU blocks of 4
tokens, a CPU tier, ``mode="swap"``) is traced with ``sys.settrace``: for an
admission, the first ``Scheduler.schedule``; for a swap preemption, the step
that preempts and the poll that settles its copy after the engine finished
it.  ``preempt`` is the issue's narrower path of a swap preemption: only what
runs inside ``Scheduler._make_room`` in that step (the victim's choice, its
pricing and the copy submitted to the engine), then the poll that settles the
copy, up to ``Scheduler._apply``.  It prints the files in the order first
entered, how many there are, and how many calls entered a file that was still
on the call stack below the caller (a call back up, into a file the path had
left without returning).

Usage: python benchmarks/path_trace.py {swap,admit,preempt}
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import tiered_kv
from tiered_kv.core.request import Request
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer.controlled import ControlledCopyEngine

ROOT = os.path.dirname(tiered_kv.__file__)


def make() -> tuple[Scheduler, ControlledCopyEngine]:
    eng = ControlledCopyEngine()
    tm = TierManager(ManagerConfig(9, 32, 4), eng, cost_model=CostModel(kv_bytes_per_token=8, block_size=4))
    s = Scheduler(tm, SchedulerConfig(mode="swap", max_num_batched_tokens=64))
    for i in range(3):
        s.add_request(Request(f"R{i}", list(range(100 * i, 100 * i + 10)), max_tokens=12))
    return s, eng


def step(s: Scheduler) -> Any:
    out = s.schedule()
    s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
    return out


def traced(fn: Any, events: list[tuple[str, str]], within: str | None = None) -> Any:
    """Run ``fn``, recording package calls and returns; with ``within``, only inside that scheduler method."""
    inside = [within is None]

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        f = frame.f_code.co_filename
        if event != "call" or not f.startswith(ROOT):
            return None
        entering = not inside[0] and frame.f_code.co_name == within and f.endswith("scheduler.py")
        if not (inside[0] or entering):
            return None
        inside[0] = True
        events.append(("call", os.path.relpath(f, ROOT)))

        def on_return(fr: FrameType, ev: str, a: Any) -> None:
            if ev == "return":
                events.append(("return", ""))
                if entering:
                    inside[0] = False

        return on_return

    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(None)


def summary(events: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Files in first-entered order, and the calls that entered a file still on the stack below the caller."""
    first: list[str] = []
    stack: list[str] = []
    back_up: list[str] = []
    for kind, f in events:
        if kind == "return":
            if stack:
                stack.pop()
            continue
        if stack and f != stack[-1] and f in stack:
            back_up.append(f"{stack[-1]} -> {f}")
        if f not in first:
            first.append(f)
        stack.append(f)
    return first, back_up


def main(which: str) -> None:
    events: list[tuple[str, str]] = []
    if which == "admit":
        s, _ = make()
        traced(lambda: step(s), events)
    else:
        s, eng = make()
        n = 0
        while not step(s).preempted:  # find the step that preempts, then replay up to it and trace it
            n += 1
        s, eng = make()
        for _ in range(n):
            step(s)
        out = traced(lambda: step(s), events, "_make_room" if which == "preempt" else None)
        assert out.preempted, "the replay preempts in the same step"
        eng.complete_all()
        traced(s.settle, events)
    first, back_up = summary(events)
    print(f"{which}: {len(first)} files, {len(back_up)} calls back up into a file on the stack")
    print("  " + " -> ".join(first))
    for call in sorted(set(back_up)):
        print(f"  back up: {call} ({back_up.count(call)}x)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "swap")
