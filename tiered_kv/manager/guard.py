"""Single-threaded objects that say so: a second thread entering is an error, not a race.

The tier manager is driven by one scheduler, as in vLLM; copy engines finish
handles on their own threads but never call it.  Two threads interleaving
calls would corrupt its books silently, so entry by a second thread while the
first is inside raises :class:`~tiered_kv.errors.ConcurrentUseError`.  The lock
is re-entrant: the owning thread may call back in (an engine's ``submit`` may
poll, a public method may call another).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from tiered_kv.errors import ConcurrentUseError

F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """Guard a method of an object with an ``RLock`` in ``self._lock``."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if not lock.acquire(False):
            raise ConcurrentUseError(
                f"{type(self).__name__}.{method.__name__} was called while another thread is inside it; "
                f"a {type(self).__name__} is single-threaded: drive it from one thread at a time"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return guarded  # type: ignore[return-value]
