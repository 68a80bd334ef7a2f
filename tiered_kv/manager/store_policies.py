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
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from operator import length_hint
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


_MISSING = object()


class LRUPolicy(CachePolicy):
    """Least recently used first; eviction never re-walks keys it found busy.

    The recency order is vLLM's: one ordered dict, least recent at the front;
    inserted and touched keys go to the back; eviction takes the first keys that
    can be evicted and skips the rest, which keep their place, so a pinned key
    keeps its age and becomes a victim as soon as it is unpinned if nothing used
    it.

    What differs is only how the skipped keys are kept.  vLLM walks over them
    on every eviction; with many stores in flight (a request's stores complete
    when it finishes) or many loads pinning blocks, that walk is most of the
    cost of a store.  Here, a key that the store's eviction finds busy (pending,
    pinned) or protected at the front is *parked*: moved, with a sequence
    number, from the ordered dict to a side table.  Every parked key is older
    than every key in the ordered dict (when it was parked, everything ahead of
    it had been evicted or parked too, and keys only join the dict at the
    back), so the recency order is "parked keys by sequence number, then the
    ordered dict", exactly as before.  An eviction that is refused parks
    nothing.  A parked
    key that can be evicted (the store reports it through ``_mark_evictable``)
    waits in a heap by sequence number; eviction takes from that heap first,
    then from the front of the ordered dict.  A touch brings a parked key back
    to the end of the ordered dict.  Heap entries are checked when popped
    (still parked under that number, still evictable) and dropped if stale.

    Parking happens only in ``_evict_for_store``, whose caller keeps the
    ``_mark_evictable`` promise.  :meth:`evict`, with an arbitrary predicate,
    walks the full order and parks nothing.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._keys: OrderedDict[Key, None] = OrderedDict()  # unparked keys, least recent first
        self._parked: dict[Key, int] = {}  # parked key -> its sequence number (its place in the order)
        self._heap: list[tuple[int, Key]] = []  # (sequence number, key) of parked keys that may be evictable
        self._seq = 0

    def __len__(self) -> int:
        return len(self._keys) + len(self._parked)

    def __contains__(self, key: object) -> bool:
        return key in self._keys or key in self._parked

    def order(self) -> list[Key]:
        parked = self._parked
        return [*sorted(parked, key=parked.__getitem__), *self._keys]

    def snapshot(self) -> tuple:
        # Where a key is kept (parked or not) is representation, not state: the order is the state.
        return (tuple(self.order()),)

    @property
    def num_parked(self) -> int:
        """Keys held aside by eviction because they were busy or protected (for tests and benchmarks)."""
        return len(self._parked)

    def check_invariants(self, evictable: Predicate | None = None) -> None:
        super().check_invariants(evictable)
        parked = self._parked
        assert not any(key in parked for key in self._keys), "lru: a key is both parked and in the order"
        assert len(set(parked.values())) == len(parked), "lru: two parked keys share a sequence number"
        assert all(seq <= self._seq for seq in parked.values()), "lru: a sequence number from the future"
        if evictable is not None:
            heaped = set(self._heap)
            lost = [key for key, seq in parked.items() if evictable(key) and (seq, key) not in heaped]
            assert not lost, f"lru: evictable parked keys missing from the heap: {lost}"

    def _insert(self, key: Key) -> None:
        self._keys[key] = None

    def _insert_all(self, keys: Sequence[Key]) -> None:
        keys_ = self._keys
        for key in keys:  # OrderedDict.update is several times slower than item assignment
            keys_[key] = None

    def _remove(self, key: Key) -> None:
        if self._keys.pop(key, _MISSING) is _MISSING:
            del self._parked[key]  # its heap entry, if any, is now stale

    def _remove_all(self, keys: Sequence[Key]) -> None:
        pop, parked = self._keys.pop, self._parked
        for key in keys:
            if pop(key, _MISSING) is _MISSING:
                del parked[key]

    def _touch(self, keys: Sequence[Key], is_ready: Predicate) -> None:
        # vLLM's LRU moves pending keys too; only ARC distinguishes them.
        keys_, parked = self._keys, self._parked
        move = keys_.move_to_end
        walk = reversed(keys)
        try:
            deque(map(move, walk), 0)  # every key in the ordered dict, the common case: all in C
            return
        except KeyError:
            pass
        # The key ``move`` failed on is the one ``walk`` yielded last, so the next unwalked index,
        # length_hint(walk), is its own.  (KeyError's argument is unreliable: a tuple key is unpacked.)
        key = keys[length_hint(walk)]
        if parked.pop(key, _MISSING) is not _MISSING:
            keys_[key] = None
        # Otherwise it is not resident: ignored.  The rest of the walk, without another exception.
        if not parked:
            deque(map(move, filter(keys_.__contains__, walk)), 0)
            return
        for key in walk:
            if key in keys_:
                move(key)
            elif parked.pop(key, _MISSING) is not _MISSING:
                keys_[key] = None

    def _evict(self, n: int, can_evict: Predicate) -> list[Key] | None:
        victims: list[Key] = []
        for key in self.order():
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        self._remove_all(victims)
        return victims

    def _evict_for_store(self, n: int, evictable: Predicate, protected: Collection[Key]) -> list[Key] | None:
        # 1. Parked keys that became evictable, oldest first: older than anything in the ordered dict.
        taken = self._pop_parked(n, evictable, protected) if self._heap else None
        want = n - len(taken) if taken else n
        front: list[Key] = []
        if want:
            # 2. The front of the ordered dict; what cannot go now is parked, so no later eviction walks it again.
            keys = self._keys
            park = None
            for key in keys:
                if evictable(key) and key not in protected:
                    front.append(key)
                    if len(front) == want:
                        break
                elif park is None:
                    park = [key]
                else:
                    park.append(key)
            else:
                # Too few.  Undo step 1; park nothing (a key parked after a victim that stays would
                # move ahead of it).  Rare: the store refuses most such calls by its evictable count.
                if taken:
                    heap, parked = self._heap, self._parked
                    for entry in taken:
                        parked[entry[1]] = entry[0]
                        heapq.heappush(heap, entry)
                return None
            if park is not None:
                self._park(park, evictable)
            for key in front:
                del keys[key]
        if taken:
            return [key for _, key in taken] + front
        return front

    def _pop_parked(self, n: int, evictable: Predicate, protected: Collection[Key]) -> list[tuple[int, Key]]:
        """Up to ``n`` evictable parked keys, oldest first, taken out of the parked table (heap entries kept)."""
        heap, parked = self._heap, self._parked
        taken: list[tuple[int, Key]] = []
        held: list[tuple[int, Key]] = []  # protected in this call: back on the heap afterwards
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            seq, key = entry
            if parked.get(key) != seq or not evictable(key):
                continue  # stale: touched, removed, evicted, or pinned again (re-reported when unpinned)
            if key in protected:
                held.append(entry)
                continue
            del parked[key]
            taken.append(entry)
        for entry in held:
            heapq.heappush(heap, entry)
        return taken

    def _park(self, park: list[Key], evictable: Predicate) -> None:
        keys, parked, heap = self._keys, self._parked, self._heap
        seq = self._seq
        for key in park:
            del keys[key]
            seq += 1
            parked[key] = seq
            if evictable(key):  # protected in this call only: it may go in the next one
                heapq.heappush(heap, (seq, key))
        self._seq = seq

    def _mark_evictable(self, keys: Collection[Key]) -> None:
        parked = self._parked
        if not parked:
            return
        heap = self._heap
        for key in parked.keys() & keys:
            heapq.heappush(heap, (parked[key], key))
        if len(heap) > 2 * len(parked) + 64:
            # Stale entries pile up when parked keys are touched or pinned again; drop them (and duplicates).
            heap[:] = [entry for entry in set(heap) if parked.get(entry[1]) == entry[0]]
            heapq.heapify(heap)


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
