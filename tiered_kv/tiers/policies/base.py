"""The contract of a store's cache policy (vLLM 0.33.0's ``kv_offload/cpu/policies/base.py``).

A policy orders a store's resident keys and picks eviction victims.  Slots, ref
counts and the pending/ready state belong to the store (one owner per fact): it
tells the policy what it needs through two predicates given at construction
(``is_ready``) and at eviction (``evictable``), and through the
``mark_evictable`` / ``mark_non_evictable`` calls at every change of a key's
evictability (made through their batched forms, ``mark_evictable_all`` /
``mark_non_evictable_all``, once per call of the store: a method call per key
costs more than most policies' work for it).  A policy that leaves these hooks, or
``on_request_access``, at the base's no-ops is not called for them at all (ARC).

The hooks and when the store calls them are vLLM 0.33's:

* ``insert(key, req)``: a store reserved ``key`` for request ``req`` (pending); the store
  calls it through ``insert_all(keys, req)``, once per ``prepare_store``;
* ``remove(key)``: a failed store or a ``remove`` dropped it (no ghost entry);
* ``touch(keys, req)``: an explicit use;
* ``on_store_miss(keys, req)``: ``req`` offered absent keys (ARC learns from ghosts);
* ``on_request_access(keys, req)``: ``req`` loaded or offered keys for the first time;
* ``on_request_finished(keys, insertion_only, reused, req)``: ``req`` finished;
  ``keys`` is every key it saw, head to tail;
* ``evict(n, protected, evictable)``: exactly ``n`` victims or ``None``;
* ``clear()``: the store was reset.

``req`` is the store's :class:`~tiered_kv.tiers.cpu_store.RequestAccess`, or
``None`` for a call made without a request (then nothing is request-scoped).

A user's policy subclasses :class:`CachePolicy` and is registered by name, or
named with the module that defines it (:mod:`tiered_kv.tiers.policies.factory`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, ClassVar

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.tiers.store import Key

if TYPE_CHECKING:  # the store owns these records and imports the policies
    from tiered_kv.tiers.cpu_store import RequestAccess

Predicate = Callable[[Key], bool]


class CachePolicy(abc.ABC):
    """Orders a store's resident keys and picks eviction victims.

    Invariants:
        * A key is resident at most once; ``len(policy)`` counts resident keys.
        * ``evict(n, ...)`` returns exactly ``n`` distinct resident keys, each
          evictable and not protected, and forgets them; or it returns ``None``
          and changes nothing.  All-or-nothing, because the store must not lose
          entries when it cannot make enough room anyway.
        * No hook other than ``insert``, ``remove``, ``evict`` and ``clear`` adds
          or drops a resident key.

    Args:
        capacity: Slots of the store it orders (bounds ARC's target and ghost lists).
        is_ready: The store's "resident and not pending" test.

    Attributes:
        name: The registry name (``"lru"``, ``"arc"``).
    """

    name: ClassVar[str]

    def __init__(self, capacity: int, is_ready: Predicate) -> None:
        self.capacity = checks.count("capacity", capacity)  # 0: a store that holds nothing, as in vLLM
        if not callable(is_ready):
            raise InvalidArgumentError(f"is_ready must be a callable key -> bool, got {checks.describe(is_ready)}")
        self.is_ready = is_ready

    @abc.abstractmethod
    def __len__(self) -> int:
        """Resident keys."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (ghost entries are not)."""

    @abc.abstractmethod
    def order(self) -> list[Key]:
        """Resident keys in the policy's order, the next victim first (ignoring pins)."""

    @abc.abstractmethod
    def snapshot(self) -> tuple:
        """The policy's decision state as a comparable value (for tests and debugging)."""

    @abc.abstractmethod
    def insert(self, key: Key, req: RequestAccess | None) -> None:
        """Add a key the store just reserved (pending, so not evictable yet)."""

    def insert_all(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        """``insert`` of each key, in order (one call per ``prepare_store``, so a policy may batch it)."""
        for key in keys:
            self.insert(key, req)

    @abc.abstractmethod
    def remove(self, key: Key) -> None:
        """Forget a resident key without treating it as an eviction."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        """Record a use of ``keys``; keys that are not resident are ignored."""

    def on_store_miss(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        """``req`` offered these absent keys, before they are inserted (default: a touch, as vLLM's)."""
        self.touch(keys, req)

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        """``req`` saw these keys for the first time (default: nothing)."""
        return

    def on_request_finished(
        self, keys: Sequence[Key], insertion_only: Collection[Key], reused: Collection[Key], req: RequestAccess
    ) -> None:
        """``req`` finished; ``keys`` is every key it saw, head to tail (default: a touch of them)."""
        self.touch(keys, req)

    @abc.abstractmethod
    def evict(self, n: int, protected: Collection[Key], evictable: Predicate) -> list[Key] | None:
        """Pick and forget exactly ``n`` (>= 1) evictable keys not in ``protected``, in eviction order; or ``None``."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget everything, adaptive state included."""

    def mark_evictable(self, key: Key) -> None:
        """``key`` became evictable (its store completed, or its last load finished)."""
        return

    def mark_evictable_all(self, keys: Sequence[Key]) -> None:
        """``mark_evictable`` of each key, in order (one call, so a policy may batch it)."""
        for key in keys:
            self.mark_evictable(key)

    def mark_non_evictable(self, key: Key) -> None:
        """``key`` stopped being evictable (a load pinned it)."""
        return

    def mark_non_evictable_all(self, keys: Sequence[Key]) -> None:
        """``mark_non_evictable`` of each key, in order (one call per ``prepare_load``, so a policy may batch it)."""
        for key in keys:
            self.mark_non_evictable(key)

    def check_invariants(self) -> None:
        """Assert the policy's own invariants (for tests and debugging)."""
        order = self.order()
        assert len(order) == len(self) == len(set(order)), f"{self.name}: order and size disagree"
