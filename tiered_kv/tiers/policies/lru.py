"""LRU cache policy with vLLM 0.33.0's request-scoped recency (``kv_offload/cpu/policies/lru.py``)."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence

from tiered_kv.tiers.policies.base import CachePolicy, Predicate
from tiered_kv.tiers.request_access import RequestAccess
from tiered_kv.tiers.store import Key

Rank = tuple[int, int]


class LRUPolicy(CachePolicy):
    """Least recently used first, where "recent" is ranked per request.

    Every resident key has a rank; the smallest rank is evicted first.  Ranks
    come from one counter:

    * a key used on its own (a touch, a store without a position) takes the
      next value, ``(clock, 0)``;
    * a request takes one value for all its keys, when it first stores or sees
      one, and a key it stores or sees at end token ``p`` is ranked
      ``(request_rank, -p)``: within a request the tail goes before the head,
      because a later block is useless without every block before it;
    * when a request finishes, its keys are re-ranked one by one from tail to
      head, so its head ends most recent.

    Recency is logical: a pinned or pending key is ranked like any other and
    only skipped by eviction.  Evictable keys wait in a min-heap of
    ``(rank, key)``; entries go stale when a key is re-ranked or pinned and are
    dropped when popped (the heap is rebuilt when stale entries outnumber live
    ones).  Ranks are distinct unless two keys of one request share a position
    (vLLM's hybrid models); only then does the heap compare keys, as vLLM's does.
    """

    name = "lru"

    def __init__(self, capacity: int, is_ready: Predicate) -> None:
        super().__init__(capacity, is_ready)
        self._rank: dict[Key, Rank] = {}
        self._evictable: set[Key] = set()
        self._heap: list[tuple[Rank, Key]] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def order(self) -> list[Key]:
        rank = self._rank
        return sorted(rank, key=rank.__getitem__)

    def snapshot(self) -> tuple:
        return (tuple(self.order()),)

    def rank(self, key: Key) -> Rank | None:
        """``key``'s rank (smallest goes first), or ``None`` if it is not resident."""
        return self._rank.get(key)

    def _request_rank(self, req: RequestAccess) -> int:
        if not req.rank:
            self._clock += 1
            req.rank = self._clock
        return req.rank

    def _rerank(self, keys: Iterable[Key]) -> None:
        """Give each resident key of ``keys``, in turn, the next rank."""
        rank, evictable = self._rank, self._evictable
        clock = self._clock
        moved = []
        for key in keys:
            if key in rank:
                clock += 1
                rank[key] = (clock, 0)
                if key in evictable:
                    moved.append(key)
        self._clock = clock
        self._repush(moved)

    def _repush(self, moved: Sequence[Key]) -> None:
        if not moved:
            return
        rank, heap = self._rank, self._heap
        if len(moved) >= max(64, len(self._evictable) // 4):
            # Re-ranking a long prefix: one heapify is cheaper than that many pushes.
            self._rebuild()
            return
        push = heapq.heappush
        for key in moved:
            push(heap, (rank[key], key))
        self._compact()

    def _rebuild(self) -> None:
        rank = self._rank
        self._heap = [(rank[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _compact(self) -> None:
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild()

    def insert(self, key: Key, req: RequestAccess | None) -> None:
        position = None if req is None else req.context._positions.get(key)
        if position is None:
            self._clock += 1
            self._rank[key] = (self._clock, 0)
        else:
            self._rank[key] = (self._request_rank(req), -position)  # type: ignore[arg-type]

    def remove(self, key: Key) -> None:
        del self._rank[key]
        self._evictable.discard(key)  # its heap entry, if any, is now stale

    def touch(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        self._rerank(reversed(keys))

    def on_store_miss(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        return  # a touch of absent keys: nothing to re-rank

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        r = self._request_rank(req)
        rank, evictable, positions = self._rank, self._evictable, req.context._positions
        moved = []
        for key in keys:
            position = positions.get(key)
            if position is None or key not in rank:
                continue
            new = (r, -position)
            if rank[key] >= new:
                continue  # already as recent (a later request saw it)
            rank[key] = new
            if key in evictable:
                moved.append(key)
        self._repush(moved)

    def on_request_finished(
        self, keys: Sequence[Key], insertion_only: Collection[Key], reused: Collection[Key], req: RequestAccess
    ) -> None:
        self._rerank(reversed(keys))

    def clear(self) -> None:
        self._rank.clear()
        self._evictable.clear()
        self._heap.clear()
        self._clock = 0

    def evict(self, n: int, protected: Collection[Key], evictable: Predicate) -> list[Key] | None:
        rank, live, heap = self._rank, self._evictable, self._heap
        pop, push = heapq.heappop, heapq.heappush
        picked: list[tuple[Rank, Key]] = []
        picked_keys: set[Key] = set()
        held: list[tuple[Rank, Key]] = []
        while heap and len(picked) < n:
            entry = pop(heap)
            key = entry[1]
            if key not in live or rank.get(key) != entry[0] or key in picked_keys:
                continue  # stale, or a duplicate left by a pin and unpin without a re-rank
            if key in protected:
                held.append(entry)
                continue
            picked.append(entry)
            picked_keys.add(key)
        if len(picked) < n:
            for entry in picked:
                push(heap, entry)
            for entry in held:
                push(heap, entry)
            return None
        for entry in held:
            push(heap, entry)
        victims = []
        for _, key in picked:
            live.remove(key)
            del rank[key]
            victims.append(key)
        self._compact()
        return victims

    def mark_evictable(self, key: Key) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._rank[key], key))
        self._compact()

    def mark_evictable_all(self, keys: Sequence[Key]) -> None:
        self._evictable.update(keys)
        self._repush(keys)

    def mark_non_evictable(self, key: Key) -> None:
        self._evictable.remove(key)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._evictable <= self._rank.keys(), "lru: evictable keys that are not resident"
        live = {key for r, key in self._heap if key in self._evictable and self._rank[key] == r}
        assert live == self._evictable, f"lru: evictable keys missing from the heap: {self._evictable - live}"
