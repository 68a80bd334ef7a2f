"""Device events of plans, for the torch and cupy engines: the handle they complete, the table of recent ones.

An engine records a start and an end event on the copy stream around a plan's
copies and attaches them.  ``done()`` polls the end event, ``wait(timeout)``
polls it until the deadline (CUDA has no timed event wait, and a blocking
``synchronize`` would ignore the timeout), and ``wait()`` with no timeout
synchronises on it.  ``elapsed_s`` is the device time between the two events,
so it measures the copies themselves, not the host's submission or polling.

The two libraries spell the same event API differently; an :class:`EventAPI`
adapter hides that, so one handle class serves both.  Standard library only:
the adapters call methods on the event objects they are given.

Anything the event API raises (a CUDA error surfaces at the next query or
synchronise) fails the plan: a copy engine is foreign code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tiered_kv import checks
from tiered_kv.errors import PlanError, TransferError
from tiered_kv.transfer.plan import FINAL, TransferHandle, TransferStatus

#: First and longest sleep between two polls in ``wait(timeout)``.  The longest
#: bounds how late a wait returns after the copy ends (an engine idles that long
#: waiting for a swap-in), at a cost of at most 4000 event queries a second.
POLL_MIN_S = 50e-6
POLL_MAX_S = 250e-6


class EventAPI(Protocol):
    """How one library queries, synchronises and times its events."""

    def query(self, event: Any) -> bool:
        """True once all work recorded before ``event`` has completed."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Device milliseconds between two completed events."""
        ...


class TorchEvents:
    """``torch.cuda.Event``: ``query()``, ``synchronize()``, ``start.elapsed_time(end)``."""

    __slots__ = ()

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end))


class CupyEvents:
    """``cupy.cuda.Event``: the ``done`` property, ``synchronize()``, ``cupy.cuda.get_elapsed_time``.

    Args:
        get_elapsed_time: ``cupy.cuda.get_elapsed_time`` (passed in so this
            module never imports cupy).
    """

    __slots__ = ("_get_elapsed_time",)

    def __init__(self, get_elapsed_time: Callable[[Any, Any], float]) -> None:
        self._get_elapsed_time = get_elapsed_time

    def query(self, event: Any) -> bool:
        return bool(event.done)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self._get_elapsed_time(start, end))


@dataclass(eq=False)
class EventTransferHandle(TransferHandle):
    """A handle that is final once its end event has completed on the device.

    Until :meth:`attach` it behaves like a plain handle, so an engine can fail
    it before any copy was issued.  After ``attach`` it is RUNNING; it becomes
    DONE the first time a ``done()`` or ``wait()`` sees the end event complete,
    or FAILED if the event API raises.
    """

    _api: EventAPI | None = field(default=None, repr=False)
    _start_ev: Any = field(default=None, repr=False)
    _end_ev: Any = field(default=None, repr=False)
    _layer_evs: tuple[Any, ...] = field(default=(), repr=False)
    _fail_with: BaseException | None = field(default=None, repr=False)

    def attach(self, api: EventAPI, start: Any, end: Any, layer_events: tuple[Any, ...] = ()) -> None:
        """Tie the handle to the events recorded before and after the plan's copies (and after each layer's)."""
        self._api, self._start_ev, self._end_ev, self._layer_evs = api, start, end, tuple(layer_events)
        self.status = TransferStatus.RUNNING

    def attach_failed(
        self, api: EventAPI, start: Any, end: Any, layer_events: tuple[Any, ...], error: BaseException
    ) -> None:
        """A copy failed while the plan was issued, after others were: fail, but only once those have ended.

        Until ``end`` fires, copies already on the stream still write the
        destination; a handle that failed at once would let its blocks be
        reused under them.
        """
        self.attach(api, start, end, layer_events)
        self._fail_with = error

    def layer_event(self, layer: int) -> Any:
        """The event recorded after layer ``layer``'s copies (the end event for a plan that is not layer-wise,
        or for a layer never issued because the plan failed first)."""
        return self._layer_evs[layer] if layer < len(self._layer_evs) else self._end_ev

    def layer_done(self, layer: int) -> bool:
        if not self._layer_evs or self._api is None or layer >= len(self._layer_evs):
            return self.done() and self.ok
        try:
            return bool(self._api.query(self._layer_evs[layer]))
        except Exception as exc:
            self._settle(exc)
            return False

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Host wait for one layer (the engine's compute normally waits on the device instead)."""
        if not self._layer_evs or self._api is None:
            return self.wait(timeout)
        timeout = checks.timeout("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.layer_done(layer):
            if self._event.is_set() and not self.ok:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_MIN_S)
        return True

    @property
    def event(self) -> Any:
        """The end event (``None`` if the plan failed before its copies were issued)."""
        return self._end_ev

    def done(self) -> bool:
        if self._event.is_set() or self._api is None:
            return self._event.is_set()
        try:
            finished = self._api.query(self._end_ev)
        except Exception as exc:
            self._settle(exc)
            return True
        if finished:
            self._settle(self._fail_with)
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until final or ``timeout`` seconds; return whether the copy succeeded.

        With a timeout the end event is polled (sleeping between polls), so the
        call returns False by the deadline even if the device never finishes.
        """
        timeout = checks.timeout("timeout", timeout)
        if self._event.is_set() or self._api is None:
            self._event.wait(timeout)
            return self.ok
        if timeout is None:
            try:
                self._api.synchronize(self._end_ev)
            except Exception as exc:
                self._settle(exc)
                return False
            self._settle(self._fail_with)
            return self.ok
        deadline = time.monotonic() + timeout
        delay = POLL_MIN_S
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, POLL_MAX_S)
        return self.ok

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise :class:`TransferError` unless the copy succeeded."""
        self.wait(timeout)
        if not self.done():
            raise TransferError(f"plan {self.plan.plan_id}: not finished after {timeout} s")
        super().result(0)

    def _settle(self, exc: BaseException | None) -> None:
        """Make the handle final: DONE with the device's elapsed time, or FAILED with ``exc``.

        Status, error and time change together under the handle's lock, so no
        reader sees DONE before its elapsed time is set.  If the device cannot
        time the events (the copies did finish), the host-measured time stays.
        """
        status, error = TransferStatus.DONE, None
        elapsed = time.perf_counter() - self.submitted_at
        if exc is None:
            try:
                elapsed = self._api.elapsed_ms(self._start_ev, self._end_ev) / 1000.0  # type: ignore[union-attr]
            except Exception:  # the copies finished; only the device timing is unavailable: keep host time
                pass
        else:
            status, error = TransferStatus.FAILED, TransferError(f"plan {self.plan.plan_id}: {exc}")
        with self._lock:
            if self.status in FINAL:
                return
            self.status, self.error, self.elapsed_s = status, error, elapsed
        self._event.set()


def fail_after_issued(
    handle: EventTransferHandle,
    api: EventAPI,
    stream: Any,
    start: Any,
    end: Any,
    layer_events: list[Any],
    error: BaseException,
) -> bool:
    """Engines: a copy raised after ``start`` was recorded; fail ``handle`` once what was issued has ended.

    Records ``end`` on ``stream`` behind the copies already issued.  False if
    even that fails (the caller then fails the handle at once: nothing more can
    be known about the stream).
    """
    try:
        end.record(stream)
    except Exception:
        return False
    handle.attach_failed(api, start, end, tuple(layer_events), error)
    return True


def issued_event(handle: object, caller: str) -> Any:
    """The end event of a plan whose copies were issued; :class:`PlanError` for anything else.

    For ``make_compute_wait``: ordering a stream after a plan needs the plan's
    event, which a CPU engine's handle, or a plan refused at submission, lacks.
    """
    if not isinstance(handle, EventTransferHandle):
        raise PlanError(f"{caller}() takes a handle from a CUDA copy engine, got {type(handle).__name__}")
    if handle.event is None:
        raise PlanError(f"{caller}(): plan {handle.plan.plan_id} failed before its copies were issued ({handle.error})")
    return handle.event


#: Plans whose events an engine keeps before it forgets the completed ones.
DEFAULT_MAX_TRACKED_PLANS = 4096


class PlanEvents:
    """Plan id -> end event, with a bound on how many are kept.

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
