"""LRU cache policy with vLLM 0.33.0's request-scoped recency (``kv_offload/cpu/policies/lru.py``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable, Sequence
from itertools import pairwise

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
    only skipped by eviction.  Evictable keys sit in buckets, one per rank's
    first component (a request's value, or a lone key's own value), each a map
    key -> second component; the bucket values are kept in a sorted list (new
    values come from the counter, so almost always go at its end).  Eviction
    walks buckets in ascending value and each bucket in ascending
    ``(second component, key)``: exactly the order of ``(rank, key)``, the
    order of vLLM's heap, ties included, with no stale entries to pop.  Ranks
    are distinct unless two keys of one request share a position (vLLM's
    hybrid models); only then are keys compared, as vLLM's heap does.
    """

    name = "lru"

    def __init__(self, capacity: int, is_ready: Predicate) -> None:
        super().__init__(capacity, is_ready)
        self._rank: dict[Key, Rank] = {}
        self._evictable: set[Key] = set()
        # Evictable keys by their rank's first component; a bucket is dropped when empty.
        self._buckets: dict[int, dict[Key, int]] = {}
        # Ascending, no duplicates; entries before ``_head`` have no bucket, later ones may not.
        self._values: list[int] = []
        self._head = 0
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

    def _bucket(self, value: int) -> dict[Key, int]:
        """The bucket of ``value``, made (and listed in order) if it has none."""
        bucket = self._buckets.get(value)
        if bucket is not None:
            return bucket
        bucket = self._buckets[value] = {}
        values = self._values
        if not values or value > values[-1]:
            values.append(value)
            return bucket
        pos = bisect_left(values, value)
        if pos == len(values) or values[pos] != value:
            values.insert(pos, value)
        if pos < self._head:
            self._head = pos
        return bucket

    def _unfile(self, key: Key, value: int) -> None:
        buckets = self._buckets
        bucket = buckets[value]
        del bucket[key]
        if not bucket:
            del buckets[value]
            self._compact()

    def _compact(self) -> None:
        # Dead values are skipped by eviction; drop them once they outnumber the live ones.
        values = self._values
        if len(values) >= max(64, 2 * len(self._buckets)):
            buckets = self._buckets
            self._values = [v for v in values[self._head :] if v in buckets]
            self._head = 0

    def _move(self, key: Key, old: Rank, new: Rank) -> None:
        """Refile an evictable key whose rank changed from ``old`` to ``new``."""
        if old[0] == new[0]:
            self._buckets[old[0]][key] = new[1]
            return
        self._bucket(new[0])[key] = new[1]
        self._unfile(key, old[0])

    def _rerank(self, keys: Iterable[Key]) -> None:
        """Give each resident key of ``keys``, in turn, the next rank."""
        rank, evictable, buckets, values = self._rank, self._evictable, self._buckets, self._values
        clock = self._clock
        emptied = False
        for key in keys:
            old = rank.get(key)
            if old is not None:
                clock += 1
                rank[key] = (clock, 0)
                if key in evictable:
                    # ``clock`` exceeds every value in use, so its bucket goes at the end.
                    buckets[clock] = {key: 0}
                    values.append(clock)
                    bucket = buckets[old[0]]
                    del bucket[key]
                    if not bucket:
                        del buckets[old[0]]
                        emptied = True
        self._clock = clock
        if emptied:
            self._compact()

    def insert(self, key: Key, req: RequestAccess | None) -> None:
        position = None if req is None else req.context._positions.get(key)
        if position is None:
            self._clock += 1
            self._rank[key] = (self._clock, 0)
        else:
            self._rank[key] = (self._request_rank(req), -position)  # type: ignore[arg-type]

    def insert_all(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        # ``insert`` of each key, inlined: the method call per key (25k calls) was 9% of prepare_store's
        # time under cProfile (benchmarks/bench_store.py, 2000 requests).
        rank = self._rank
        positions = None if req is None else req.context._positions
        if positions is None:
            clock = self._clock
            for key in keys:
                clock += 1
                rank[key] = (clock, 0)
            self._clock = clock
            return
        r = 0
        for key in keys:
            position = positions.get(key)
            if position is None:
                self._clock += 1
                rank[key] = (self._clock, 0)
            else:
                if not r:
                    r = self._request_rank(req)  # type: ignore[arg-type]
                rank[key] = (r, -position)

    def remove(self, key: Key) -> None:
        old = self._rank.pop(key)
        if key in self._evictable:
            self._evictable.remove(key)
            self._unfile(key, old[0])

    def touch(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        self._rerank(reversed(keys))

    def on_store_miss(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        return  # a touch of absent keys: nothing to re-rank

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        r = self._request_rank(req)  # assigned at the first access even when nothing is resident
        rank, evictable, positions = self._rank, self._evictable, req.context._positions
        if rank.keys().isdisjoint(keys):
            # A fresh chunk's offer: none of its keys is resident yet, so no rank moves.  One C-level
            # test instead of two lookups per key (a third of this hook's calls, bench_store.py).
            return
        for key in keys:
            position = positions.get(key)
            if position is None:
                continue
            old = rank.get(key)
            if old is None:
                continue
            new = (r, -position)
            if old >= new:
                continue  # already as recent (a later request saw it)
            rank[key] = new
            if key in evictable:
                self._move(key, old, new)

    def on_request_finished(
        self, keys: Sequence[Key], insertion_only: Collection[Key], reused: Collection[Key], req: RequestAccess
    ) -> None:
        self._rerank(reversed(keys))

    def clear(self) -> None:
        self._rank.clear()
        self._evictable.clear()
        self._buckets.clear()
        self._values.clear()
        self._head = 0
        self._clock = 0

    def evict(self, n: int, protected: Collection[Key], evictable: Predicate) -> list[Key] | None:
        buckets, values = self._buckets, self._values
        victims: list[Key] = []
        i, end = self._head, len(values)
        # Values before the first live one stay dead: skip them for good.
        while i < end and values[i] not in buckets:
            i += 1
        self._head = i
        while i < end:
            bucket = buckets.get(values[i])
            i += 1
            if bucket is None:
                continue
            if len(bucket) == 1:
                for key in bucket:
                    if key not in protected:
                        victims.append(key)
            else:
                for _minor, key in sorted([(minor, key) for key, minor in bucket.items()]):
                    if key not in protected:
                        victims.append(key)
                        if len(victims) == n:
                            break
            if len(victims) == n:
                break
        else:
            return None
        rank, live = self._rank, self._evictable
        emptied = False
        for key in victims:
            live.remove(key)
            value = rank.pop(key)[0]
            bucket = buckets[value]
            del bucket[key]
            if not bucket:
                del buckets[value]
                emptied = True
        if emptied:
            self._compact()
        return victims

    def mark_evictable(self, key: Key) -> None:
        self._evictable.add(key)
        value, minor = self._rank[key]
        self._bucket(value)[key] = minor

    def mark_evictable_all(self, keys: Sequence[Key]) -> None:
        rank, evictable, buckets = self._rank, self._evictable, self._buckets
        for key in keys:
            if key not in evictable:
                evictable.add(key)
                value, minor = rank[key]
                bucket = buckets.get(value)
                if bucket is None:
                    bucket = self._bucket(value)
                bucket[key] = minor

    def mark_non_evictable(self, key: Key) -> None:
        self._evictable.remove(key)
        self._unfile(key, self._rank[key][0])

    def mark_non_evictable_all(self, keys: Sequence[Key]) -> None:
        # ``mark_non_evictable`` of each key, inlined, compacting at most once per call.
        rank, evictable, buckets = self._rank, self._evictable, self._buckets
        evictable.difference_update(keys)
        emptied = False
        for key in keys:
            value = rank[key][0]
            bucket = buckets[value]
            del bucket[key]
            if not bucket:
                del buckets[value]
                emptied = True
        if emptied:
            self._compact()

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._evictable <= self._rank.keys(), "lru: evictable keys that are not resident"
        filed = {key: (value, minor) for value, bucket in self._buckets.items() for key, minor in bucket.items()}
        assert filed.keys() == self._evictable, f"lru: evictable keys not filed: {self._evictable ^ filed.keys()}"
        assert all(self._rank[key] == r for key, r in filed.items()), "lru: a key filed under a stale rank"
        values = self._values
        assert all(a < b for a, b in pairwise(values)), "lru: bucket values out of order"
        assert self._buckets.keys() <= set(values[self._head :]), "lru: a bucket missing from the value list"
