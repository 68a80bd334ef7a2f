"""The contract of a block store's cache policy: which resident key to evict next.

A policy only orders keys and picks victims.  Slots, ref counts and the
pending/ready state belong to the store (one owner per fact): the store passes
them in as predicates, ``can_evict(key)`` to :meth:`CachePolicy.evict` and
``is_ready(key)`` to :meth:`CachePolicy.touch`.  The policies themselves are
small subclasses in their own modules (:mod:`.store_lru`, :mod:`.store_arc`);
the registry is :mod:`.store_policies`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Sequence
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

    The store validates its own arguments once and then calls the hooks
    directly, skipping a second check of the same keys.  Besides the four
    above, it uses batch forms (``_insert_all``, ``_remove_all``) and two
    hooks with defaults that a policy may refine:

    * ``_evict_for_store(n, evictable, protected)``: ``_evict`` with the store's
      two facts kept apart: ``evictable(key)`` (ready and unpinned, which changes
      only through the store) and ``protected`` (the keys of this one call);
    * ``_mark_evictable(keys)``: the store's promise to report every key that
      becomes evictable (a store completed, or a key's last load finished), so
      that a policy may stop re-examining keys it already found busy.  ``keys``
      may include keys that did not change: a policy re-checks before acting.

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

    def check_invariants(self, evictable: Predicate | None = None) -> None:
        """Assert the policy's own invariants (for tests and debugging).

        Args:
            evictable: The store's "ready and unpinned" test, for policies whose
                bookkeeping depends on it; ``None`` when the policy is used alone.
        """
        order = self.order()
        assert len(order) == len(self) == len(set(order)), f"{self.name}: order and size disagree"

    @abc.abstractmethod
    def _insert(self, key: Key) -> None: ...

    @abc.abstractmethod
    def _remove(self, key: Key) -> None: ...

    @abc.abstractmethod
    def _touch(self, keys: Sequence[Key], is_ready: Predicate) -> None: ...

    @abc.abstractmethod
    def _evict(self, n: int, can_evict: Predicate) -> list[Key] | None: ...

    def _insert_all(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._insert(key)

    def _remove_all(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self._remove(key)

    def _evict_for_store(self, n: int, evictable: Predicate, protected: Collection[Key]) -> list[Key] | None:
        return self._evict(n, lambda key: evictable(key) and key not in protected)

    def _mark_evictable(self, keys: Collection[Key]) -> None:
        return
