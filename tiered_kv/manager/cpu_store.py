"""The CPU tier: a :class:`~tiered_kv.manager.store.BlockStore` over a fixed set of slots.

The slots are the blocks of the pinned CPU KV tensor (layer 1); this module only
decides which key owns which slot.  Decisions match vLLM's
``CPUOffloadingManager`` with the same policy, so a trace replayed against both
evicts the same keys in the same order and hands out the same slots (shifted by
one: our slot 0 is reserved, because transfer plans refuse block 0).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    check_keys,
)
from tiered_kv.manager.store_policies import CachePolicy, make_cache_policy

_PENDING = -1


class _Slot:
    """A resident entry: its slot and its ref count.

    ``ref_cnt`` is ``-1`` while the store is in flight (vLLM's encoding: one
    field answers both "loadable?" and "evictable?"), ``0`` when ready and
    evictable, and the number of loads in flight when pinned.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = _PENDING


class CPUStore(BlockStore):
    """Pinned-CPU blocks keyed by block hash, with a pluggable cache policy.

    Slot hand-out (vLLM's block pool, shifted by one): never-used ids first, in
    ascending order from 1, then freed ids, last freed first.  Freed ids are
    pushed in the order entries leave: eviction order for ``prepare_store``,
    key order for ``remove`` and failed stores.

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
        self.enable_events = enable_events
        self._entries: dict[Key, _Slot] = {}
        self._next_fresh = 1  # ids >= this were never handed out
        self._free_ids: list[int] = []  # freed ids; the last one is handed out first
        self._num_pending = 0
        self._num_evictable = 0
        self._num_pinned = 0
        self._events: list[StoreEvent] = []
        self._queries = self._hits = self._pending_hits = self._evictions = 0

    def __repr__(self) -> str:
        return (
            f"CPUStore(num_blocks={self._num_blocks}, policy={self._policy.name!r}, used={self.num_used}, "
            f"pending={self._num_pending}, pinned={self._num_pinned})"
        )

    # ------------------------------------------------------------------ queries
    def lookup(self, key: Key) -> LookupResult:
        check_key("key", key)
        self._queries += 1
        entry = self._entries.get(key)
        if entry is None:
            return LookupResult.MISS
        if entry.ref_cnt == _PENDING:
            self._pending_hits += 1
            return LookupResult.HIT_PENDING
        self._hits += 1
        return LookupResult.HIT

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        check_keys("keys", keys)
        entries = self._entries
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.ref_cnt == _PENDING:
                break
            n += 1
        self._queries += len(keys)
        self._hits += n
        return n

    def contains(self, key: Key) -> bool:
        """Whether ``key`` is resident, ready or pending (no statistics are counted)."""
        return check_key("key", key) in self._entries

    def is_ready(self, key: Key) -> bool:
        """Whether ``key`` is resident and loadable (no statistics are counted)."""
        entry = self._entries.get(check_key("key", key))
        return entry is not None and entry.ref_cnt != _PENDING

    def oldest_evictable(self, n: int) -> list[Key]:
        """The first ``n`` ready, unpinned keys in the policy's order (the next eviction victims, roughly).

        Cheaper than :meth:`entries` when ``n`` is small: it stops at the ``n``-th.
        """
        checks.count("n", n)
        out: list[Key] = []
        if n:
            entries = self._entries
            for key in self._policy.order():
                if entries[key].ref_cnt == 0:
                    out.append(key)
                    if len(out) == n:
                        break
        return out

    def num_loads(self, key: Key) -> int:
        """Loads in flight that read ``key`` (its pins); 0 when it is absent or pending."""
        entry = self._entries.get(check_key("key", key))
        return entry.ref_cnt if entry is not None and entry.ref_cnt > 0 else 0

    def room_for(self, keys: Sequence[Key]) -> int:
        """How many absent keys a ``prepare_store`` that protects all of ``keys`` could take now.

        Free slots, plus evictable entries that are not among ``keys``.  The
        tier manager prices a swap-out with it and sizes saves before eviction
        by it, without trying a store it might have to undo.
        """
        check_keys("keys", keys)
        protected = 0
        for key in set(keys):
            entry = self._entries.get(key)
            if entry is not None and entry.ref_cnt == 0:
                protected += 1
        return self.num_free + self._num_evictable - protected

    # -------------------------------------------------------------------- loads
    def _ready(self, verb: str, keys: Sequence[Key]) -> list[_Slot]:
        """The entries of ``keys``, refusing any that is absent or pending."""
        out = []
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or entry.ref_cnt == _PENDING:
                why = "it is not stored" if entry is None else "its store is still in flight"
                raise BlockStateError(
                    f"cannot {verb} key {checks.describe(key)} (keys[{i}]) in the {self.medium} store: {why}"
                )
            out.append(entry)
        return out

    def prepare_load(self, keys: Sequence[Key]) -> LoadStoreSpec:
        check_keys("keys", keys)
        slots = self._ready("load", keys)
        for entry in slots:
            if entry.ref_cnt == 0:
                self._num_evictable -= 1
                self._num_pinned += 1
            entry.ref_cnt += 1
        return LoadStoreSpec(self.medium, tuple(entry.block_id for entry in slots))

    def touch(self, keys: Sequence[Key]) -> None:
        check_keys("keys", keys)
        self._policy.touch(keys, self._is_ready)

    def complete_load(self, keys: Sequence[Key]) -> None:
        check_keys("keys", keys)
        slots = self._ready("complete the load of", keys)
        for i, entry in enumerate(slots):
            if entry.ref_cnt == 0:
                raise BlockStateError(
                    f"cannot complete the load of key {checks.describe(keys[i])} (keys[{i}]) "
                    f"in the {self.medium} store: it is not being loaded"
                )
        for entry in slots:
            entry.ref_cnt -= 1
            if entry.ref_cnt == 0:
                self._num_evictable += 1
                self._num_pinned -= 1

    # ------------------------------------------------------------------- stores
    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        check_keys("keys", keys)
        entries = self._entries
        to_store = [key for key in keys if key not in entries]
        if not to_store:
            return PrepareStoreOutput([], LoadStoreSpec(self.medium, ()), [])
        need = len(to_store) - self.num_free
        evicted: list[Key] = []
        if need > 0:
            if need > self._num_evictable:  # cheap refusal before the policy scans anything
                return None
            protected = set(keys)

            def can_evict(key: Key) -> bool:
                return entries[key].ref_cnt == 0 and key not in protected

            victims = self._policy.evict(need, can_evict)
            if victims is None:
                return None
            for key in victims:
                self._free_ids.append(entries.pop(key).block_id)
            self._num_evictable -= len(victims)
            self._evictions += len(victims)
            if self.enable_events:
                self._events.append(StoreEvent(list(victims), self.medium, True))
            evicted = victims
        block_ids = self._allocate(len(to_store))
        for key, block_id in zip(to_store, block_ids, strict=True):
            entries[key] = _Slot(block_id)
            self._policy.insert(key)
        self._num_pending += len(to_store)
        return PrepareStoreOutput(to_store, LoadStoreSpec(self.medium, tuple(block_ids)), evicted)

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        check_keys("keys", keys)
        checks.flag("success", success)
        entries = self._entries
        pending = [key for key in keys if (e := entries.get(key)) is not None and e.ref_cnt == _PENDING]
        if not pending:
            return
        self._num_pending -= len(pending)
        if success:
            for key in pending:
                entries[key].ref_cnt = 0
            self._num_evictable += len(pending)
            if self.enable_events:
                self._events.append(StoreEvent(pending, self.medium, False))
        else:
            for key in pending:
                self._free_ids.append(entries.pop(key).block_id)
                self._policy.remove(key)

    def remove(self, keys: Sequence[Key]) -> None:
        check_keys("keys", keys)
        slots = self._ready("remove", keys)
        for i, entry in enumerate(slots):
            if entry.ref_cnt > 0:
                raise BlockStateError(
                    f"cannot remove key {checks.describe(keys[i])} (keys[{i}]) from the {self.medium} store: "
                    f"{entry.ref_cnt} load(s) in flight read it"
                )
        if not keys:
            return
        for key in keys:
            self._free_ids.append(self._entries.pop(key).block_id)
            self._policy.remove(key)
        self._num_evictable -= len(keys)
        if self.enable_events:
            self._events.append(StoreEvent(list(keys), self.medium, True))

    def take_events(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- internals
    def _is_ready(self, key: Key) -> bool:
        return self._entries[key].ref_cnt != _PENDING

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self._num_blocks - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        free = self._free_ids
        ids.extend(free.pop() for _ in range(n - fresh))
        return ids

    # ------------------------------------------------------------------- gauges
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_used(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_pending(self) -> int:
        return self._num_pending

    @property
    def num_evictable(self) -> int:
        # vLLM's CPU usage gauge counts (used - evictable); ours counts every used slot.
        return self._num_evictable

    @property
    def stats(self) -> StoreStats:
        return StoreStats(self._queries, self._hits, self._pending_hits, self._evictions)

    @property
    def policy(self) -> CachePolicy:
        """The cache policy, for inspection (its order, ARC's lists); changing it breaks the store."""
        return self._policy

    def free_block_ids(self) -> list[int]:
        """The free slots in the order ``prepare_store`` will hand them out."""
        return [*range(self._next_fresh, self._num_blocks), *reversed(self._free_ids)]

    def entries(self) -> list[StoreEntry]:
        entries = self._entries
        return [
            StoreEntry(key, e.block_id, e.ref_cnt != _PENDING, max(e.ref_cnt, 0))
            for key, e in ((key, entries[key]) for key in self._policy.order())
        ]

    def check_invariants(self) -> None:
        entries = self._entries
        order = self._policy.order()
        assert len(order) == len(entries) and set(order) == set(entries), "policy and entries disagree"
        held = [e.block_id for e in entries.values()]
        slots = sorted(held + self.free_block_ids())
        assert slots == list(range(1, self._num_blocks)), f"slots lost, shared or out of range: {slots}"
        refs = [e.ref_cnt for e in entries.values()]
        assert min(refs, default=0) >= _PENDING, f"negative ref count: {refs}"
        assert self._num_pending == refs.count(_PENDING), "pending count drifted"
        assert self._num_evictable == refs.count(0), "evictable count drifted"
        assert self._num_pinned == len(refs) - refs.count(_PENDING) - refs.count(0), "pinned count drifted"
        assert self.num_used + self.num_free == self.capacity, "used + free != capacity"
