"""ARC (adaptive replacement cache) policy with vLLM 0.33.0's rules (``kv_offload/cpu/policies/arc.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from tiered_kv.tiers.policies.base import CachePolicy, Predicate
from tiered_kv.tiers.store import Key

if TYPE_CHECKING:  # the store owns these records and imports the policies
    from tiered_kv.tiers.cpu_store import RequestAccess

_MISSING = object()


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache, as vLLM 0.33.0 decides it.

    * T1 holds keys used once, T2 keys used again; both least recent first.
    * B1 and B2 are ghost lists: keys recently evicted from T1 and T2, kept
      (at most ``capacity`` each) only to learn from.
    * ``target_t1_size`` is how large T1 should be.  Offering (storing) a B1
      ghost means recency was undervalued: the target grows by
      ``max(1, |B2|/|B1|)`` (capped at ``capacity``); a B2 ghost shrinks it by
      ``max(1, |B1|/|B2|)`` (floored at 0).  A request learns from each ghost
      once, before the store re-inserts it.
    * Insertion goes to T1's most recent end and clears the key's ghost.
    * When a request finishes, each key it reused (read, or offered while
      ready, without having inserted it) counts as one access: from T1 it is
      promoted to T2, in T2 it becomes most recent.  A key it only inserted
      stays in its list and becomes most recent there.  Keys are walked tail to
      head, so the head ends most recent.
    * An explicit ``touch`` promotes a ready T1 key to T2 (a pending one stays
      in T1, most recent: its reservation is not a second use), refreshes a T2
      key, and adapts the target on a ghost.
    * Eviction picks victims one by one: from T1 while T1 (counting keys
      already picked as gone) is at least ``int(target_t1_size)`` and has an
      evictable key; otherwise from T2; and when T2 has none, it falls back to
      T1.  Each list is scanned forward once however many are picked.  Victims
      are committed only once all ``n`` are found; they become ghosts and the
      ghost lists are trimmed to ``capacity``.
    """

    name = "arc"

    def __init__(self, capacity: int, is_ready: Predicate) -> None:
        super().__init__(capacity, is_ready)
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._target = 0.0

    @property
    def t1(self) -> tuple[Key, ...]:
        """Keys used once, least recent first."""
        return tuple(self._t1)

    @property
    def t2(self) -> tuple[Key, ...]:
        """Keys used more than once, least recent first."""
        return tuple(self._t2)

    @property
    def b1(self) -> tuple[Key, ...]:
        """Ghosts of keys evicted from T1, oldest first."""
        return tuple(self._b1)

    @property
    def b2(self) -> tuple[Key, ...]:
        """Ghosts of keys evicted from T2, oldest first."""
        return tuple(self._b2)

    @property
    def target_t1_size(self) -> float:
        """The adaptive target size of T1, in ``[0, capacity]``."""
        return self._target

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def order(self) -> list[Key]:
        return [*self._t1, *self._t2]

    def snapshot(self) -> tuple:
        return (self.t1, self.t2, self.b1, self.b2, self._target)

    def insert(self, key: Key, req: RequestAccess | None) -> None:
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def insert_all(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        # ``insert`` per key, without a method call per key; with no ghosts (most of a run
        # below capacity) there is nothing to clear, so T1 takes the keys in one C-level update.
        t1, b1, b2 = self._t1, self._b1, self._b2
        if (b1 or b2) and not (b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys)):
            for key in keys:
                t1[key] = None
                b1.pop(key, None)
                b2.pop(key, None)
        else:  # no key is a ghost (the common case): T1 takes the keys in one C-level update
            t1.update(dict.fromkeys(keys))

    def remove(self, key: Key) -> None:
        if self._t1.pop(key, _MISSING) is _MISSING:
            del self._t2[key]

    def _adapt(self, key: Key) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._target = min(self._target + max(1, len(b2) / len(b1)), self.capacity)
            b1.move_to_end(key)
        elif key in b2:
            self._target = max(self._target - max(1, len(b1) / len(b2)), 0)
            b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        b1, b2 = self._b1, self._b2
        if (b1 or b2) and not (b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys)):
            for key in reversed(keys):
                self._adapt(key)

    def touch(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        t1, t2, ready = self._t1, self._t2, self.is_ready
        for key in reversed(keys):
            if key in t1:
                if ready(key):
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._adapt(key)

    def on_request_finished(
        self, keys: Sequence[Key], insertion_only: Collection[Key], reused: Collection[Key], req: RequestAccess
    ) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target = 0.0

    def evict(self, n: int, protected: Collection[Key], evictable: Predicate) -> list[Key] | None:
        # The picks one by one, in phases: T1 is picked from while its size, counting keys already
        # picked as gone, is at least the target (it only shrinks, so that is a first run of picks);
        # then T2; then T1 again, continuing its scan.  Plain loops, so no generator frame is resumed
        # per scanned key (the picks are the same as taking them one at a time from two scans).
        t1, t2 = self._t1, self._t2
        scan1 = iter(t1)
        first: list[Key] = []
        room = min(n, len(t1) - int(self._target) + 1)
        if room > 0:
            for key in scan1:
                if key not in protected and evictable(key):
                    first.append(key)
                    if len(first) == room:
                        break
        second: list[Key] = []
        left = n - len(first)
        if left:
            for key in t2:
                if key not in protected and evictable(key):
                    second.append(key)
                    if len(second) == left:
                        break
            left -= len(second)
        third: list[Key] = []
        if left:
            for key in scan1:  # T2 has nothing (more) evictable: fall back to T1
                if key not in protected and evictable(key):
                    third.append(key)
                    if len(third) == left:
                        break
            if len(third) < left:
                return None
        b1, b2 = self._b1, self._b2
        for key in first:
            del t1[key]
            b1[key] = None
        for key in second:
            del t2[key]
            b2[key] = None
        for key in third:
            del t1[key]
            b1[key] = None
        for ghosts in (self._b1, self._b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return first + second + third
