"""Whether the remote server is worth asking: a small circuit breaker with a counted history.

A remote tier must never stall the scheduler.  Every call to the server has a
short socket timeout; after one fails, the server is considered down for a
back-off period (doubling on each consecutive failure, up to a cap), during
which lookups answer "miss" and I/O fails fast without touching the network.
The first success resets the back-off.  Lookups on the scheduler's thread and
I/O on worker threads share one :class:`RedisHealth`, so it is thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class HealthStats:
    """Counters since the breaker was built.

    Attributes:
        errors: Calls that reached for the server and failed (timeouts, refused connections).
        skipped: Calls answered without the server because it was in back-off.
        down: Whether the server is in back-off now.
        last_error: The most recent failure, as text.
    """

    errors: int
    skipped: int
    down: bool
    last_error: str


class RedisHealth:
    """A circuit breaker over one server.

    Args:
        backoff_s: The first back-off after a failure.
        max_backoff_s: The cap of the doubling back-off.
        clock: Seconds, monotonic (injected in tests).
    """

    def __init__(
        self, backoff_s: float = 0.5, max_backoff_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        for name, value in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if value.__class__ not in (int, float) or not 0 <= value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a number of seconds >= 0, got {checks.describe(value)}")
        if max_backoff_s < backoff_s:
            raise InvalidArgumentError(f"max_backoff_s ({max_backoff_s}) must be >= backoff_s ({backoff_s})")
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be callable, got {checks.describe(clock)}")
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = float("-inf")
        self._next_backoff = self.backoff_s
        self._errors = self._skipped = 0
        self._last_error = ""

    def available(self) -> bool:
        """Whether to try the server now; a False answer is counted as a skipped call."""
        with self._lock:
            if self._clock() >= self._down_until:
                return True
            self._skipped += 1
            return False

    def failure(self, exc: BaseException) -> None:
        """Record a failed call: the server is down for the current back-off, which then doubles."""
        with self._lock:
            self._errors += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._down_until = self._clock() + self._next_backoff
            self._next_backoff = min(self._next_backoff * 2, self.max_backoff_s)

    def success(self) -> None:
        """Record a call that worked: no back-off any more."""
        with self._lock:
            self._down_until = float("-inf")
            self._next_backoff = self.backoff_s

    @property
    def stats(self) -> HealthStats:
        with self._lock:
            down = self._clock() < self._down_until
            return HealthStats(self._errors, self._skipped, down, self._last_error)
