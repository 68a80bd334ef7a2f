"""Discrete-event core: an event heap of ``(time, sequence, kind, payload)``.

The sequence number breaks ties deterministically (first scheduled, first
served), so identical seeds and configs replay identically.  The clock is the
loop's own ``now``; the random generator is injected by the simulator.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from typing import Any

from tiered_kv.errors import InvalidArgumentError


class EventLoop:
    """A simulated clock and a time-ordered event queue."""

    __slots__ = ("_heap", "_seq", "now", "trace")

    def __init__(self, record_trace: bool = False) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.trace: list[tuple[float, str, Hashable]] | None = [] if record_trace else None

    def schedule(self, time: float, kind: str, payload: Any = None) -> None:
        """Queue an event at ``time``, which must be finite and not in the past.

        A NaN time would compare false with everything and freeze the clock
        (``max(now, nan)`` never advances); an infinite one would never come.
        """
        if not math.isfinite(time):
            raise InvalidArgumentError(f"cannot schedule {kind!r} at a non-finite time ({time})")
        if time < self.now:
            raise InvalidArgumentError(f"cannot schedule {kind!r} at {time} before now={self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, payload))

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_until(self, time: float, before: bool = False) -> tuple[float, str, Any] | None:
        """Remove and return the next event due at or before ``time`` (strictly before, with ``before``).

        The clock moves to the event's time; None (clock untouched) if no event is due.
        """
        heap = self._heap
        if heap and (heap[0][0] < time if before else heap[0][0] <= time):
            t, _, kind, payload = heapq.heappop(heap)
            if t > self.now:
                self.now = t
            return t, kind, payload
        return None

    def log(self, kind: str, detail: Hashable, time: float | None = None) -> None:
        """Append to the trace (when recording), stamped ``time`` or now."""
        if self.trace is not None:
            self.trace.append((round(self.now if time is None else time, 9), kind, detail))

    def __len__(self) -> int:
        return len(self._heap)
