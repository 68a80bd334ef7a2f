"""LRU cache policy with vLLM 0.33.0's request-scoped recency (``kv_offload/cpu/policies/lru.py``)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

from tiered_kv.tiers.policies.base import CachePolicy, Predicate
from tiered_kv.tiers.store import Key

if TYPE_CHECKING:  # the store owns these records and imports the policies
    from tiered_kv.tiers.cpu_store import RequestAccess

Rank = tuple[int, int]


# Stale bucket entries are dropped all at once when they outnumber the live ones this many times over
# (and the floor).  At 1x, bench_manager.py (400 steps, last_admitted) rebuilt 10 times, 0.031 s of its 2.04 s
# under cProfile; the rebuild is O(evictable keys), so a larger factor divides its amortized cost.
_STALE_FACTOR = 4
_STALE_FLOOR = 64


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
    only skipped by eviction.

    Evictable keys sit in buckets, one per rank's first component (a
    request's value, or a lone key's own value), each a map key -> second
    component; the bucket values are kept in a sorted list (new values come
    from the counter, so almost always go at its end).  Eviction walks buckets
    in ascending value and each bucket in ascending ``(second component,
    key)``: exactly the order of ``(rank, key)``, the order of vLLM's heap,
    ties included.  Ranks are distinct unless two keys of one request share a
    position (vLLM's hybrid models); only then are keys compared, as vLLM's
    heap does.

    Like vLLM's heap, the buckets may hold stale entries, which eviction
    skips (and drops): an entry ``key -> minor`` in bucket ``value`` is live
    exactly when ``key`` is evictable and its rank is ``(value, minor)``.
    So pinning a key only takes it out of the evictable set, unpinning files
    it again only if its rank moved meanwhile, and a rank change files the
    key under its new rank without taking it out of the old bucket.  Every
    evictable key is filed under its rank; ``_stale`` counts the other
    entries, and when they outnumber the live ones (several times over) the buckets are rebuilt
    from the evictable keys.

    Re-ranking ``n`` keys at once (a finished request, a touch) gives them
    consecutive values ``c .. c+n-1``; nothing else can take a value in
    between, so they are stored as one run, ``(c, i)`` for ``i`` in
    ``0 .. n-1``, filed in one bucket: the same order as ``(c + i, 0)``,
    which :meth:`rank` reports.  Request ranks have ``minor = -p < 0``, run
    ranks ``minor >= 0``, so the two never mix in a bucket.
    """

    name = "lru"

    def __init__(self, capacity: int, is_ready: Predicate) -> None:
        super().__init__(capacity, is_ready)
        self._rank: dict[Key, Rank] = {}
        self._evictable: set[Key] = set()
        # Entries by their rank's first component (live and stale ones); a bucket is dropped when empty.
        self._buckets: dict[int, dict[Key, int]] = {}
        # Ascending, no duplicates; entries before ``_head`` have no bucket, later ones may not.
        self._values: list[int] = []
        self._head = 0
        self._clock = 0
        # Bucket entries that are not live: their total count minus ``len(_evictable)``.
        self._stale = 0
        # Values whose bucket iterates in eviction order (ascending ``(minor, key)``): eviction then takes
        # its victims from the front instead of sorting the whole bucket again for every few victims.
        self._sorted: set[int] = set()

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
        r = self._rank.get(key)
        if r is None or r[1] <= 0:
            return r
        return (r[0] + r[1], 0)  # the ``i``-th key of a run started at ``c`` holds value ``c + i``

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
        self._sorted.discard(value)
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

    def _compact(self) -> None:
        # Dead values are skipped by eviction; drop them once they outnumber the live ones.
        values = self._values
        if len(values) >= max(64, 2 * len(self._buckets)):
            buckets = self._buckets
            self._values = [v for v in values[self._head :] if v in buckets]
            self._head = 0

    def _add_stale(self, n: int) -> None:
        self._stale += n
        if self._stale > max(_STALE_FLOOR, _STALE_FACTOR * len(self._evictable)):
            self._rebuild()

    def _rebuild(self) -> None:
        """File every evictable key under its rank, and nothing else (drops every stale entry)."""
        rank = self._rank
        buckets: dict[int, dict[Key, int]] = {}
        for key in self._evictable:
            value, minor = rank[key]
            bucket = buckets.get(value)
            if bucket is None:
                buckets[value] = {key: minor}
            else:
                bucket[key] = minor
        self._buckets = buckets
        self._values = sorted(buckets)
        self._head = 0
        self._stale = 0
        self._sorted = set()

    def _rerank(self, keys: Iterable[Key]) -> None:
        """Give each resident key of ``keys``, in turn, the next rank: one run."""
        rank, evictable = self._rank, self._evictable
        start = self._clock + 1
        i = 0
        run: dict[Key, int] = {}
        for key in keys:
            if key in rank:
                rank[key] = (start, i)
                if key in evictable:
                    run[key] = i
                i += 1
        if not i:
            return
        self._clock = start + i - 1
        if run:
            # ``start`` exceeds every value in use, so its bucket goes at the end.  The keys' old
            # entries stay where they are, stale.
            self._buckets[start] = run
            self._values.append(start)
            self._sorted.add(start)  # filed in ascending ``i``
            self._add_stale(len(run))

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
        value = self._rank.pop(key)[0]
        if key in self._evictable:
            self._evictable.remove(key)
            buckets = self._buckets
            bucket = buckets[value]
            del bucket[key]
            if not bucket:
                del buckets[value]
                self._compact()

    def touch(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        self._rerank(reversed(keys))

    def on_store_miss(self, keys: Sequence[Key], req: RequestAccess | None) -> None:
        return  # a touch of absent keys: nothing to re-rank

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        r = req.rank or self._request_rank(req)  # assigned at the first access even when nothing is resident
        rank, evictable, positions = self._rank, self._evictable, req.context._positions
        if rank.keys().isdisjoint(keys):
            # A fresh chunk's offer: none of its keys is resident yet, so no rank moves.  One C-level
            # test instead of two lookups per key (a third of this hook's calls, bench_store.py).
            return
        # Every moved key goes to bucket ``r``, its old entry left stale: one bucket lookup per call
        # instead of a refile per key (17k refiles per 400-step bench_manager.py run, each a bucket
        # lookup, a delete and maybe a compaction).
        target: dict[Key, int] | None = None
        before = 0
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
                if target is None:
                    target = self._bucket(r)
                    before = len(target)
                    self._sorted.discard(r)
                target[key] = -position
        if target is not None:
            # Each new entry leaves one stale behind (a refile within bucket ``r`` leaves none).
            self._add_stale(len(target) - before)

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
        self._stale = 0
        self._sorted.clear()

    def evict(self, n: int, protected: Collection[Key], evictable: Predicate) -> list[Key] | None:
        buckets, values, rank, live, ordered = self._buckets, self._values, self._rank, self._evictable, self._sorted
        victims: list[Key] = []
        purged = 0  # stale entries dropped on the way (they would be walked again by every eviction)
        i, end = self._head, len(values)
        # Values before the first live one stay dead: skip them for good.
        while i < end and values[i] not in buckets:
            i += 1
        self._head = i
        while i < end:
            value = values[i]
            i += 1
            bucket = buckets.get(value)
            if bucket is None:
                continue
            if value in ordered or len(bucket) == 1:
                # In eviction order already: take victims from the front, dropping the stale entries passed.
                dead = []
                for key, minor in bucket.items():
                    if key in live and rank[key] == (value, minor):
                        if key not in protected:
                            victims.append(key)
                            if len(victims) == n:
                                break
                    else:
                        dead.append(key)
                if dead:
                    purged += len(dead)
                    for key in dead:
                        del bucket[key]
                    if not bucket:
                        del buckets[value]
            else:
                # Live entries only, sorted once; the bucket is refiled in that order (and without its stale
                # entries), so the next eviction from it takes its victims from the front.
                items = [(minor, key) for key, minor in bucket.items() if key in live and rank[key] == (value, minor)]
                purged += len(bucket) - len(items)
                if not items:
                    del buckets[value]
                    continue
                items.sort()
                buckets[value] = {key: minor for minor, key in items}
                ordered.add(value)
                for _minor, key in items:
                    if key not in protected:
                        victims.append(key)
                        if len(victims) == n:
                            break
            if len(victims) == n:
                break
        else:
            self._stale -= purged
            return None
        self._stale -= purged
        for key in victims:
            live.remove(key)
            value = rank.pop(key)[0]
            bucket = buckets[value]
            del bucket[key]
            if not bucket:
                del buckets[value]
        self._compact()
        return victims

    def mark_evictable(self, key: Key) -> None:
        self.mark_evictable_all((key,))

    def mark_evictable_all(self, keys: Sequence[Key]) -> None:
        rank, evictable, buckets, ordered = self._rank, self._evictable, self._buckets, self._sorted
        revived = 0
        for key in keys:
            if key not in evictable:
                evictable.add(key)
                value, minor = rank[key]
                bucket = buckets.get(value)
                if bucket is None:
                    bucket = self._bucket(value)
                elif key in bucket:
                    # Still filed from before it was pinned: its entry (now under the same rank) is live again.
                    revived += 1
                else:
                    ordered.discard(value)
                bucket[key] = minor
        self._stale -= revived

    def mark_non_evictable(self, key: Key) -> None:
        self._evictable.remove(key)
        self._add_stale(1)  # its entry stays filed, skipped by eviction while the key is pinned

    def mark_non_evictable_all(self, keys: Sequence[Key]) -> None:
        evictable = self._evictable
        n = len(evictable)
        evictable.difference_update(keys)
        self._stale += n - len(evictable)  # _add_stale, inlined: once per load
        if self._stale > max(_STALE_FLOOR, _STALE_FACTOR * len(evictable)):
            self._rebuild()

    def check_invariants(self) -> None:
        super().check_invariants()
        rank, evictable = self._rank, self._evictable
        assert evictable <= rank.keys(), "lru: evictable keys that are not resident"
        entries = 0
        for value, bucket in self._buckets.items():
            assert bucket, f"lru: empty bucket {value}"
            entries += len(bucket)
        unfiled = [k for k in evictable if self._buckets.get(rank[k][0], {}).get(k, None) != rank[k][1]]
        assert not unfiled, f"lru: evictable keys not filed under their rank: {unfiled}"
        assert self._stale == entries - len(evictable), (
            f"lru: {self._stale} stale entries counted, {entries - len(evictable)} filed"
        )
        clock = self._clock
        assert all(r[0] + max(r[1], 0) <= clock for r in rank.values()), "lru: a rank beyond the clock"
        values = self._values
        assert all(a < b for a, b in pairwise(values)), "lru: bucket values out of order"
        assert self._buckets.keys() <= set(values[self._head :]), "lru: a bucket missing from the value list"
