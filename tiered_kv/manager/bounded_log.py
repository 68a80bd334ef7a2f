"""A log that keeps the last N records and counts the rest: memory stays flat however long a run is.

The tier manager records why it preempted each victim (``decision_log``) and
what admission loaded from below the CPU (``load_log``).  A serving run makes
one such record per preemption or lower-tier admission, so an unbounded list
grows linearly with the requests served.  This keeps a ring of the latest
``capacity`` records and, for everything, the count appended so far; records
are numbered from 0 in the order appended, so a reader that remembers how far
it read can take what is new with :meth:`BoundedLog.since` and learn how many
it missed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

from tiered_kv import checks

T = TypeVar("T")

#: Records a log keeps unless told otherwise: the latest 10,000 (a few MB of decisions).
DEFAULT_LOG_SIZE = 10_000


class BoundedLog(Generic[T]):
    """The latest ``capacity`` records (oldest first) and the count of all ever appended.

    Reads like a list of the records it still holds (``len``, iteration,
    indexing, ``==`` with a list); :attr:`total` and :attr:`dropped` count
    what was appended and what fell off the front.

    Args:
        capacity: Records kept (an int >= 1), or ``None`` to keep every one
            (memory then grows with the run).
    """

    __slots__ = ("_ring", "total")
    __hash__ = None  # type: ignore[assignment]  # compares by content, like the list it stands for

    def __init__(self, capacity: int | None = DEFAULT_LOG_SIZE) -> None:
        if capacity is not None:
            checks.count("capacity", capacity, 1)
        self._ring: deque[T] = deque(maxlen=capacity)
        #: Records ever appended (kept or dropped).
        self.total = 0

    @property
    def capacity(self) -> int | None:
        """How many records are kept (``None``: all)."""
        return self._ring.maxlen

    @property
    def dropped(self) -> int:
        """Records appended but no longer kept (the oldest ones)."""
        return self.total - len(self._ring)

    def append(self, record: T) -> None:
        """Add a record; the oldest falls off when the log is full."""
        self._ring.append(record)
        self.total += 1

    def since(self, n: int) -> tuple[list[T], int]:
        """Records numbered ``n`` and after that are still kept, and how many of those were dropped already.

        A reader that has read the first ``n`` records passes ``n`` and then
        remembers :attr:`total`.
        """
        checks.count("n", n)
        first = self.dropped
        skip = n - first
        if skip >= 0:
            return [r for i, r in enumerate(self._ring) if i >= skip], 0
        return list(self._ring), -skip

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[T]:
        return iter(self._ring)

    def __getitem__(self, index: int) -> T:
        return self._ring[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BoundedLog):
            return list(self._ring) == list(other._ring)
        if isinstance(other, list):
            return list(self._ring) == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"BoundedLog({len(self._ring)} of {self.total} kept, capacity {self.capacity})"
