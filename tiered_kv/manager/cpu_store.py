"""The CPU tier: a :class:`~tiered_kv.manager.store.BlockStore` over a fixed set of slots.

The slots are the blocks of the pinned CPU KV tensor (layer 1); this module only
decides which key owns which slot.  Decisions match vLLM's
``CPUOffloadingManager`` with the same policy, so a trace replayed against both
evicts the same keys in the same order and hands out the same slots (shifted by
one: our slot 0 is reserved, because transfer plans refuse block 0).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NoReturn

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.manager.store import (
    BlockStore,
    Key,
    LoadStoreSpec,
    LookupResult,
    PrepareStoreOutput,
    StoreEntry,
    StoreEvent,
    StoreStats,
    check_key,
    key_set,
    make_prepare_output,
    make_spec,
)
from tiered_kv.manager.store_policies import CachePolicy, make_cache_policy

_HIT, _MISS, _HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
_NOT_KEYS = (None, True, False)  # never stored, so always missing: a caller's bug to name


def _bad_key(name: str, key: object) -> NoReturn:
    check_key(name, key)  # raises for every key the fast paths hand it
    raise AssertionError(f"{name}: {key!r} was sent to the slow check but passes it")


class CPUStore(BlockStore):
    """Pinned-CPU blocks keyed by block hash, with a pluggable cache policy.

    Slot hand-out (vLLM's block pool, shifted by one): never-used ids first, in
    ascending order from 1, then freed ids, last freed first.  Freed ids are
    pushed in the order entries leave: eviction order for ``prepare_store``,
    key order for ``remove`` and failed stores.

    State is kept in a few containers, so that whole calls run as set and
    dict operations in C rather than as per-key Python: ``_slots`` (every
    resident key -> its slot), ``_pending`` (resident keys whose store is in
    flight), ``_pinned`` (ready keys with at least one load in flight) and
    ``_extra_pins`` (key -> loads beyond the first, for the rare key that two
    loads read at once).  A key is evictable when resident, not pending and not
    pinned, so the gauges are sizes, not counters that could drift.

    Args:
        num_blocks: Slot ids in the medium, including the reserved id 0 (>= 2);
            the store holds ``num_blocks - 1`` blocks.
        policy: Cache policy name, a key of
            :data:`~tiered_kv.manager.store_policies.CACHE_POLICIES`.
        enable_events: Queue :class:`~tiered_kv.manager.store.StoreEvent` for
            ``take_events`` (off by default, as in vLLM, so nobody has to drain).
    """

    medium = "CPU"

    def __init__(self, num_blocks: int, policy: str = "lru", enable_events: bool = False) -> None:
        if num_blocks.__class__ is not int or num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be an int >= 2 (slot 0 is reserved), got {checks.describe(num_blocks)}"
            )
        checks.flag("enable_events", enable_events)
        self._policy: CachePolicy = make_cache_policy(policy, num_blocks - 1)
        self._num_blocks = num_blocks
        self._capacity = num_blocks - 1
        self.enable_events = enable_events
        self._slots: dict[Key, int] = {}
        self._pending: set[Key] = set()
        self._pinned: set[Key] = set()
        self._extra_pins: dict[Key, int] = {}
        self._next_fresh = 1  # ids >= this were never handed out
        self._free_ids: list[int] = []  # freed ids; the last one is handed out first
        self._events: list[StoreEvent] = []
        self._hits = self._pending_hits = self._misses = self._evictions = 0
        # The policy asks these per key; closures over the (never rebound) containers
        # skip the attribute lookups of a bound method.
        slots, pending, pinned = self._slots, self._pending, self._pinned

        def evictable(key: Key) -> bool:
            return key not in pending and key not in pinned

        def ready(key: Key) -> bool:
            return key in slots and key not in pending

        self._evictable = evictable
        self._ready = ready

    def __repr__(self) -> str:
        return (
            f"CPUStore(num_blocks={self._num_blocks}, policy={self._policy.name!r}, used={self.num_used}, "
            f"pending={self.num_pending}, pinned={self.num_pinned})"
        )

    # ------------------------------------------------------------------ queries
    def lookup(self, key: Key) -> LookupResult:
        # The same checks as check_key, inlined: this is called once per block of every prompt.
        if key is None or key is True or key is False:
            _bad_key("key", key)
        try:
            resident = key in self._slots
        except TypeError:
            _bad_key("key", key)
        if resident:
            if key in self._pending:
                self._pending_hits += 1
                return _HIT_PENDING
            self._hits += 1
            return _HIT
        self._misses += 1
        return _MISS

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        key_set("keys", keys)
        slots, pending = self._slots, self._pending
        n = 0
        for key in keys:
            if key not in slots or key in pending:
                break
            n += 1
        self._hits += n
        self._misses += len(keys) - n
        return n

    def contains(self, key: Key) -> bool:
        """Whether ``key`` is resident, ready or pending (no statistics are counted)."""
        if key is None or key is True or key is False:
            _bad_key("key", key)
        try:
            return key in self._slots
        except TypeError:
            _bad_key("key", key)

    def is_ready(self, key: Key) -> bool:
        """Whether ``key`` is resident and loadable (no statistics are counted)."""
        if key is None or key is True or key is False:
            _bad_key("key", key)
        try:
            return key in self._slots and key not in self._pending
        except TypeError:
            _bad_key("key", key)

    def oldest_evictable(self, n: int) -> list[Key]:
        """The first ``n`` ready, unpinned keys in the policy's order (the next eviction victims, roughly).

        Cheaper than :meth:`entries` when ``n`` is small: it stops at the ``n``-th.
        """
        checks.count("n", n)
        out: list[Key] = []
        if n:
            evictable = self._evictable
            for key in self._policy.order():
                if evictable(key):
                    out.append(key)
                    if len(out) == n:
                        break
        return out

    def num_loads(self, key: Key) -> int:
        """Loads in flight that read ``key`` (its pins); 0 when it is absent or pending."""
        check_key("key", key)
        return self._pin_count(key)

    def room_for(self, keys: Sequence[Key]) -> int:
        """How many absent keys a ``prepare_store`` that protects all of ``keys`` could take now.

        Free slots, plus evictable entries that are not among ``keys``.  The
        tier manager prices a swap-out with it and sizes saves before eviction
        by it, without trying a store it might have to undo.
        """
        named, slots = key_set("keys", keys), self._slots
        busy = (named & self._pending) | (named & self._pinned)  # small sets: never a walk of the store
        return self.num_free + self.num_evictable - (sum(map(slots.__contains__, named)) - len(busy))

    def missing(self, keys: Sequence[Key]) -> list[int]:
        try:  # priced per preemption candidate: keys are checked only as far as the answer needs
            out = [i for i, key in enumerate(keys) if key not in self._slots]  # type: ignore[arg-type]
        except TypeError:
            out = None
        if out is None or keys.__class__ not in (list, tuple) or any(keys[i] in _NOT_KEYS for i in out):
            key_set("keys", keys)  # raises, naming the problem (or lets the keys 0 and 1 pass)
        return out

    # -------------------------------------------------------------------- loads
    def _refuse(self, verb: str, keys: Sequence[Key]) -> None:
        """Raise for the first of ``keys`` that is absent or pending, if any (the slow path of a refused call)."""
        for i, key in enumerate(keys):
            if key not in self._slots or key in self._pending:
                why = "it is not stored" if key not in self._slots else "its store is still in flight"
                raise BlockStateError(
                    f"cannot {verb} key {checks.describe(key)} (keys[{i}]) in the {self.medium} store: {why}"
                )

    def prepare_load(self, keys: Sequence[Key]) -> LoadStoreSpec:
        wanted = key_set("keys", keys)
        slots, pinned = self._slots, self._pinned
        if not slots.keys() >= wanted or not self._pending.isdisjoint(wanted):
            self._refuse("load", keys)
        if pinned.isdisjoint(wanted):
            pinned |= wanted
        else:
            extra = self._extra_pins
            for key in wanted:
                if key in pinned:
                    extra[key] = extra.get(key, 0) + 1
                else:
                    pinned.add(key)
        return make_spec(self.medium, tuple(map(slots.__getitem__, keys)))

    def touch(self, keys: Sequence[Key]) -> None:
        key_set("keys", keys)
        self._policy._touch(keys, self._ready)

    def complete_load(self, keys: Sequence[Key]) -> None:
        named = key_set("keys", keys)
        pinned, extra = self._pinned, self._extra_pins
        if not pinned >= named:
            self._refuse("complete the load of", keys)
            for i, key in enumerate(keys):  # absent or pending is refused above; what is left is unpinned
                if key not in pinned:
                    raise BlockStateError(
                        f"cannot complete the load of key {checks.describe(key)} (keys[{i}]) "
                        f"in the {self.medium} store: it is not being loaded"
                    )
        if extra and not extra.keys().isdisjoint(named):
            for key in extra.keys() & named:  # ``named`` is this call's own set: free to shrink
                named.discard(key)  # still read by another load
                if extra[key] == 1:
                    del extra[key]
                else:
                    extra[key] -= 1
        pinned -= named
        if named:
            self._policy._mark_evictable(named)

    # ------------------------------------------------------------------- stores
    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        slots = self._slots
        if (keys.__class__ is list or keys.__class__ is tuple) and len(keys) == 1:
            # A decode step completes one block per request, so one key is the commonest
            # call: check it inline (the same checks as key_set) instead of building a set.
            key = keys[0]
            if key is None or key is True or key is False:
                key_set("keys", keys)
            try:
                present = key in slots
            except TypeError:
                key_set("keys", keys)
            if present:
                return make_prepare_output([], self.medium, (), [])
            to_store = [key]
            protected: Collection[Key] = keys
        else:
            protected = key_set("keys", keys)
            to_store = [key for key in keys if key not in slots]
            if not to_store:
                return make_prepare_output([], self.medium, (), [])
        pending = self._pending
        need = len(to_store) - self._capacity + len(slots)
        if need > 0:
            if need > len(slots) - len(pending) - len(self._pinned):  # cheap refusal before the policy looks
                return None
            evicted = self._policy._evict_for_store(need, self._evictable, protected)
            if evicted is None:
                return None
            free = self._free_ids
            for key in evicted:
                free.append(slots.pop(key))
            self._evictions += len(evicted)
            if self.enable_events:
                self._events.append(StoreEvent(list(evicted), self.medium, True))
        else:
            evicted = []
        if len(to_store) == 1:
            key = to_store[0]
            block_id = self._next_fresh
            if block_id < self._num_blocks:  # never-used ids first, ascending
                self._next_fresh = block_id + 1
            else:
                block_id = self._free_ids.pop()  # then the last freed
            block_ids: tuple[int, ...] = (block_id,)
            slots[key] = block_id
            pending.add(key)
        else:
            block_ids = self._allocate(len(to_store))
            slots.update(zip(to_store, block_ids, strict=True))
            pending.update(to_store)
        self._policy._insert_all(to_store)
        return make_prepare_output(to_store, self.medium, block_ids, evicted)

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        named = key_set("keys", keys)
        if success is not True and success is not False:
            checks.flag("success", success)
        pending = self._pending
        if success:
            if self.enable_events:
                done = pending & named
                if done:
                    self._events.append(StoreEvent([key for key in keys if key in done], self.medium, False))
            before = len(pending)
            pending -= named  # one pass; keys that are not pending are ignored, as in vLLM
            if len(pending) != before:
                # ``named`` may include keys that were ready already; the policy re-checks each.
                self._policy._mark_evictable(named)
        else:
            dropped = [key for key in keys if key in pending]
            if not dropped:
                return
            pending.difference_update(dropped)
            self._free_ids.extend(map(self._slots.pop, dropped))
            self._policy._remove_all(dropped)

    def remove(self, keys: Sequence[Key]) -> None:
        named = key_set("keys", keys)
        slots = self._slots
        if not slots.keys() >= named or not self._pending.isdisjoint(named):
            self._refuse("remove", keys)
        if not self._pinned.isdisjoint(named):
            for i, key in enumerate(keys):
                if key in self._pinned:
                    raise BlockStateError(
                        f"cannot remove key {checks.describe(key)} (keys[{i}]) from the {self.medium} store: "
                        f"{self._pin_count(key)} load(s) in flight read it"
                    )
        if not keys:
            return
        self._free_ids.extend(map(slots.pop, keys))
        self._policy._remove_all(keys)
        if self.enable_events:
            self._events.append(StoreEvent(list(keys), self.medium, True))

    def take_events(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- internals
    def _allocate(self, n: int) -> tuple[int, ...]:
        start = self._next_fresh
        fresh = min(n, self._num_blocks - start)
        self._next_fresh = start + fresh
        if fresh == n:
            return tuple(range(start, start + n))
        free = self._free_ids
        reused = n - fresh
        ids = (*range(start, start + fresh), *free[: -reused - 1 : -1])  # the last freed first
        del free[-reused:]
        return ids

    # ------------------------------------------------------------------- gauges
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_evictable(self) -> int:
        # vLLM's CPU usage gauge counts (used - evictable); ours counts every used slot.
        return len(self._slots) - len(self._pending) - len(self._pinned)

    @property
    def stats(self) -> StoreStats:
        hits, pending_hits = self._hits, self._pending_hits
        return StoreStats(hits + pending_hits + self._misses, hits, pending_hits, self._evictions)

    @property
    def policy(self) -> CachePolicy:
        """The cache policy, for inspection (its order, ARC's lists); changing it breaks the store."""
        return self._policy

    def free_block_ids(self) -> list[int]:
        """The free slots in the order ``prepare_store`` will hand them out."""
        return [*range(self._next_fresh, self._num_blocks), *reversed(self._free_ids)]

    def entries(self) -> list[StoreEntry]:
        slots, pending, pin_count = self._slots, self._pending, self._pin_count
        return [StoreEntry(key, slots[key], key not in pending, pin_count(key)) for key in self._policy.order()]

    def _pin_count(self, key: Key) -> int:
        return 1 + self._extra_pins.get(key, 0) if key in self._pinned else 0

    def check_invariants(self) -> None:
        slots, pending, pinned, extra = self._slots, self._pending, self._pinned, self._extra_pins
        order = self._policy.order()
        assert len(order) == len(slots) and set(order) == set(slots), "policy and slots disagree"
        held = list(slots.values())
        free = self.free_block_ids()
        assert sorted(held + free) == list(range(1, self._num_blocks)), f"slots lost or shared: {held}, {free}"
        assert pending <= slots.keys(), f"pending keys that are not resident: {pending - slots.keys()}"
        assert pinned <= slots.keys(), f"pinned keys that are not resident: {pinned - slots.keys()}"
        assert pending.isdisjoint(pinned), f"pinned keys whose store is in flight: {pending & pinned}"
        assert extra.keys() <= pinned, f"extra pins on keys that are not pinned: {extra.keys() - pinned}"
        assert all(n.__class__ is int and n > 0 for n in extra.values()), f"bad extra pin counts: {extra}"
        assert self.num_used + self.num_free == self.capacity, "used + free != capacity"
        self._policy.check_invariants(self._evictable)
