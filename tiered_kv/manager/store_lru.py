"""LRU cache policy of a block store, with vLLM's eviction order and busy keys parked aside."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Collection, Sequence
from operator import length_hint

from tiered_kv.manager.store import Key
from tiered_kv.manager.store_policy import CachePolicy, Predicate

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
