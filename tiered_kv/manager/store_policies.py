"""Cache policies of a block store: which resident key to evict next.

A policy only orders keys and picks victims.  Slots, ref counts and the
pending/ready state belong to the store (one owner per fact): the store passes
them in as predicates, ``can_evict(key)`` to :meth:`CachePolicy.evict` and
``is_ready(key)`` to :meth:`CachePolicy.touch`.  Each policy is a small
subclass, and one contract test runs against all of them
(``tests/test_store_policies.py``).

The decisions follow vLLM's CPU offloading policies (``cpu/policies/lru.py``
and ``arc.py``), so that a store with a given policy evicts the same keys in the
same order as vLLM's ``CPUOffloadingManager`` would.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.manager.store import Key, check_key, check_keys

Predicate = Callable[[Key], bool]


def _predicate(name: str, fn: object) -> Predicate:
    if not callable(fn):
        raise InvalidArgumentError(f"{name} must be a callable key -> bool, got {checks.describe(fn)}")
    return fn  # type: ignore[return-value]


class CachePolicy(abc.ABC):
    """Orders a store's resident keys and picks eviction victims.

    The public methods check their arguments and the policy's state, then call
    the subclass's hooks (``_insert``, ``_remove``, ``_touch``, ``_evict``),
    so a subclass only encodes its order.

    Invariants:
        * A key is resident at most once; ``len(policy)`` counts resident keys.
        * ``evict(n, can_evict)`` returns exactly ``n`` distinct resident keys,
          each with ``can_evict(key)`` true, and forgets them; or it returns
          ``None`` and changes nothing.  All-or-nothing, because the store must
          not lose entries when it cannot make enough room anyway.
        * ``touch`` never adds or drops a resident key.

    Attributes:
        name: The registry name (``"lru"``, ``"arc"``).
        capacity: Slots of the store it orders (bounds ARC's target and ghost lists).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self.capacity = checks.count("capacity", capacity, 1)

    @abc.abstractmethod
    def __len__(self) -> int:
        """Resident keys."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghost entries are not)."""

    @abc.abstractmethod
    def order(self) -> list[Key]:
        """Resident keys in the policy's internal order, least recent first."""

    @abc.abstractmethod
    def snapshot(self) -> tuple:
        """The policy's whole state as a comparable value (for tests and debugging)."""

    def insert(self, key: Key) -> None:
        """Add a newly reserved key as the most recent one.

        Raises:
            BlockStateError: ``key`` is already resident; nothing changes.
        """
        check_key("key", key)
        if key in self:
            raise BlockStateError(f"cannot insert key {checks.describe(key)}: it is already in the {self.name} policy")
        self._insert(key)

    def remove(self, key: Key) -> None:
        """Forget a resident key without treating it as an eviction (no ghost entry).

        Raises:
            BlockStateError: ``key`` is not resident; nothing changes.
        """
        check_key("key", key)
        if key not in self:
            raise BlockStateError(f"cannot remove key {checks.describe(key)}: it is not in the {self.name} policy")
        self._remove(key)

    def touch(self, keys: Sequence[Key], is_ready: Predicate) -> None:
        """Record a use of ``keys``, walking them in reverse so the first ends most recent.

        Keys that are not resident are ignored (ARC still learns from ghost hits).
        ``is_ready`` tells a key whose store is in flight: its reservation is
        not a second use, so ARC keeps it in T1.
        """
        check_keys("keys", keys)
        self._touch(keys, _predicate("is_ready", is_ready))

    def evict(self, n: int, can_evict: Predicate) -> list[Key] | None:
        """Pick and forget exactly ``n`` keys with ``can_evict(key)`` true, in eviction order.

        ``can_evict`` is the store's "ready, unpinned and not protected" test;
        it must not change the store.

        Returns:
            The victims, or ``None`` (nothing changed) if ``n`` cannot be found.
        """
        checks.count("n", n)
        _predicate("can_evict", can_evict)
        if n == 0:
            return []
        return self._evict(n, can_evict)

    @abc.abstractmethod
    def _insert(self, key: Key) -> None: ...

    @abc.abstractmethod
    def _remove(self, key: Key) -> None: ...

    @abc.abstractmethod
    def _touch(self, keys: Sequence[Key], is_ready: Predicate) -> None: ...

    @abc.abstractmethod
    def _evict(self, n: int, can_evict: Predicate) -> list[Key] | None: ...


class LRUPolicy(CachePolicy):
    """Least recently used first: one ordered dict, least recent at the front.

    Inserted keys are most recent.  Eviction walks from the front and skips keys
    that cannot be evicted, which stay where they are: a pinned key keeps its
    age, so it becomes a victim as soon as it is unpinned if nothing used it.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def order(self) -> list[Key]:
        return list(self._keys)

    def snapshot(self) -> tuple:
        return (tuple(self._keys),)

    def _insert(self, key: Key) -> None:
        self._keys[key] = None

    def _remove(self, key: Key) -> None:
        del self._keys[key]

    def _touch(self, keys: Sequence[Key], is_ready: Predicate) -> None:
        # vLLM's LRU moves pending keys too; only ARC distinguishes them.
        resident = self._keys
        for key in reversed(keys):
            if key in resident:
                resident.move_to_end(key)

    def _evict(self, n: int, can_evict: Predicate) -> list[Key] | None:
        victims: list[Key] = []
        for key in self._keys:
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self._keys[key]
        return victims


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


CACHE_POLICIES: dict[str, type[CachePolicy]] = {cls.name: cls for cls in (LRUPolicy, ARCPolicy)}


def make_cache_policy(name: str, capacity: int) -> CachePolicy:
    """A new, empty policy by registry name (``"lru"`` or ``"arc"``)."""
    checks.choice("policy", name, CACHE_POLICIES)
    return CACHE_POLICIES[name](capacity)
