"""What a store remembers of one open request: the keys it saw, in prefix order, and how.

vLLM 0.33's ``CPUOffloadingManager`` keeps the same facts per request (its
``_RequestCacheAccess``) and hands them to the cache policy when the request
finishes, so a policy can tell a block a request merely inserted from one it
reused.  The store owns these records; a policy reads them and keeps one number
of its own here (the LRU request rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_kv.tiers.store import Key, RequestContext


@dataclass(slots=True, eq=False)
class RequestAccess:
    """One open request's observations in one store.

    Attributes:
        context: The request's context (its id and its keys' positions).
        order: Keys first seen by a load or a store of this request, in the order seen.
        seen: ``set(order)``.
        inserted: Keys this request's stores reserved.
        reused: Ready keys this request read or offered again, that it had not inserted itself.
        store_misses: Keys this request offered while absent (a policy learns from each once).
        offered: Every key this request named to ``prepare_store`` (what ``complete_store`` may name).
        rank: The LRU policy's request rank; 0 until it assigns one.
    """

    context: RequestContext
    order: list[Key] = field(default_factory=list)
    seen: set[Key] = field(default_factory=set)
    inserted: set[Key] = field(default_factory=set)
    reused: set[Key] = field(default_factory=set)
    store_misses: set[Key] = field(default_factory=set)
    offered: set[Key] = field(default_factory=set)
    rank: int = 0

    def reset(self) -> None:
        """Forget every observation (the store was reset); the request stays open."""
        self.order.clear()
        self.seen.clear()
        self.inserted.clear()
        self.reused.clear()
        self.store_misses.clear()
        self.offered.clear()
        self.rank = 0

    def prefix_order(self) -> list[Key]:
        """The seen keys head to tail: by position when every one has one, else in the order seen."""
        pos = self.context._positions
        keys = self.order
        if pos.keys() >= self.seen:  # every seen key has a position (``seen`` is ``set(order)``), tested in C
            return sorted(keys, key=pos.__getitem__)
        return list(keys)
