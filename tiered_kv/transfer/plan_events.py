"""The end event of each recent plan, by plan id, with a bound on how many are kept.

A device engine needs a plan's end event after ``submit`` returns for two
things: a later plan's ``wait_for`` becomes a stream wait on it, and a plan id
still in flight may not be submitted again.  Neither needs a completed plan's
event (a completed plan orders nothing and blocks no id), so the table forgets
completed plans once it holds more than ``limit``.  A plan in flight is never
forgotten, even past the limit: dropping it would let a ``wait_for`` write race
the read it must follow.  After a sweep the next one waits until the table
holds ``max(limit, 2 * survivors)`` events, so sweeps cost O(1) per plan however
many plans are in flight.  The table thus holds at most ``limit`` events unless
more than ``limit / 2`` plans were still in flight at the last sweep.
"""

from __future__ import annotations

from typing import Any

from tiered_kv import checks
from tiered_kv.transfer.event_handle import EventAPI

#: Plans whose events an engine keeps before it forgets the completed ones.
DEFAULT_MAX_TRACKED_PLANS = 4096


class PlanEvents:
    """Plan id -> end event, bounded as the module docstring explains.

    Args:
        api: The event library's adapter (to ask whether an event completed).
        limit: Size above which completed plans are forgotten (an int >= 1).
    """

    __slots__ = ("_api", "_events", "_sweep_at", "limit")

    def __init__(self, api: EventAPI, limit: int = DEFAULT_MAX_TRACKED_PLANS) -> None:
        self.limit = checks.count("max_tracked_plans", limit, minimum=1)
        self._api = api
        self._events: dict[int, Any] = {}
        self._sweep_at = self.limit

    def __len__(self) -> int:
        return len(self._events)

    def get(self, plan_id: int) -> Any:
        """The plan's end event, or ``None`` if it is unknown or was forgotten (it had completed)."""
        return self._events.get(plan_id)

    def in_flight(self, plan_id: int) -> bool:
        """True while the plan's copies may still be running on the device."""
        event = self._events.get(plan_id)
        return event is not None and not self._completed(event)

    def add(self, plan_id: int, event: Any) -> None:
        """Remember a submitted plan's end event (replacing a completed plan of the same id)."""
        self._events[plan_id] = event
        if len(self._events) > self._sweep_at:
            self._events = {pid: ev for pid, ev in self._events.items() if not self._completed(ev)}
            self._sweep_at = max(self.limit, 2 * len(self._events))

    def wait_all(self) -> None:
        """Block until every tracked plan's copies are done (an engine's ``close``)."""
        for event in list(self._events.values()):
            try:
                self._api.synchronize(event)
            except Exception:  # a device error: that plan failed already
                pass

    def _completed(self, event: Any) -> bool:
        try:
            return self._api.query(event)
        except Exception:  # a device error: the plan failed (its handle says so) and orders nothing more
            return True
