"""ARC (adaptive replacement cache) policy of a block store, with vLLM's decisions."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from tiered_kv.manager.store import Key
from tiered_kv.manager.store_policy import CachePolicy, Predicate


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache, with vLLM's decisions.

    * T1 holds keys used once, T2 keys used again; both least recent first.
    * B1 and B2 are ghost lists: keys recently evicted from T1 and T2, kept
      (bounded by ``capacity`` each) only to learn from.
    * ``target_t1_size`` is how large T1 should be.  A touch of a B1 ghost means
      recency was undervalued, so the target grows by ``max(1, |B2|/|B1|)``
      (capped at ``capacity``); a touch of a B2 ghost shrinks it by
      ``max(1, |B1|/|B2|)`` (floored at 0).
    * Insertion goes to T1 (and clears any ghost of the key).  A touch promotes a
      ready T1 key to T2; a pending T1 key stays in T1 as most recent, since its
      reservation was not a second use.
    * Eviction picks victims one by one: from T1 while T1 (counting keys already
      picked as gone) is at least ``int(target_t1_size)`` and has an evictable
      key, otherwise from T2.  As in vLLM there is no fallback from T2 back to
      T1: when T1 is below target and T2 has no evictable key, the eviction
      fails even if T1 has one.  Victims are committed only once all ``n`` are
      found; they move to B1/B2 and the ghost lists are then trimmed.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
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

    def _insert(self, key: Key) -> None:
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def _remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def _touch(self, keys: Sequence[Key], is_ready: Predicate) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in reversed(keys):
            if key in t1:
                if is_ready(key):
                    del t1[key]
                    t2[key] = None
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                self._target = min(self._target + max(1.0, len(b2) / len(b1)), float(self.capacity))
                b1.move_to_end(key)
            elif key in b2:
                self._target = max(self._target - max(1.0, len(b1) / len(b2)), 0.0)
                b2.move_to_end(key)

    def _evict(self, n: int, can_evict: Predicate) -> list[Key] | None:
        picked: list[tuple[Key, bool]] = []  # (key, came from T1)
        t1_size = len(self._t1)
        target = int(self._target)
        # One forward scan per list: each candidate is looked at once however many are picked.
        t1_scan: Iterator[Key] = (k for k in self._t1 if can_evict(k))
        t2_scan: Iterator[Key] = (k for k in self._t2 if can_evict(k))
        while len(picked) < n:
            key = next(t1_scan, None) if t1_size >= target else None
            if key is not None:
                picked.append((key, True))
                t1_size -= 1
                continue
            key = next(t2_scan, None)
            if key is None:
                return None
            picked.append((key, False))
        for key, from_t1 in picked:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for ghosts in (self._b1, self._b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return [key for key, _ in picked]
