"""The CPU tier: a :class:`~tiered_kv.tiers.store.BlockStore` over a fixed set of slots.

The slots are the blocks of the pinned CPU KV tensor (layer 1); this module only
decides which key owns which slot.  It follows vLLM 0.33.0's
``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``) with the same
policy: the same answers, the same evictions in the same order, the same slots
(shifted by one: our slot 0 is reserved, because transfer plans refuse block 0)
and the same events.  ``tests/test_store_vllm_parity.py`` replays seeded traces
through vLLM's own class and this one side by side and checks exactly that.

What this store adds on top of that protocol, for the tier manager: several
loads of one key (pins for swap-outs), ``remove`` of a request's private
blocks, prefix and room queries, and typed errors for calls vLLM only asserts.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError, RequestStateError
from tiered_kv.tiers.policies.base import CachePolicy
from tiered_kv.tiers.policies.factory import make_cache_policy
from tiered_kv.tiers.request_access import RequestAccess
from tiered_kv.tiers.store import (
    BlockStore,
    Key,
    LoadStoreSpec,
    LookupResult,
    PrepareStoreOutput,
    RequestContext,
    StoreEntry,
    StoreEvent,
    StoreStats,
    as_keys,
    check_key,
    check_keys,
    key_set,
    keys_and_set,
    make_prepare_output,
    make_spec,
)

_HIT, _MISS, _HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
_NOT_KEYS = (None, True, False)  # never stored, so always missing: a caller's bug to name


def _bad_key(name: str, key: object) -> NoReturn:
    check_key(name, key)  # raises for every key the fast paths hand it
    raise AssertionError(f"{name}: {key!r} was sent to the slow check but passes it")


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """What ``get_stats`` reports (vLLM 0.33's CPU gauges and allocation sizes).

    Attributes:
        usage: Slots held by entries that are not evictable (pending or pinned), over capacity.
        write_usage: Pending entries over capacity.
        read_usage: ``max(usage - write_usage, 0)``: pinned entries over capacity.
        allocation_sizes: Keys each ``prepare_store`` tried to reserve since the last call, in call order.
    """

    usage: float
    write_usage: float
    read_usage: float
    allocation_sizes: tuple[int, ...]


class CPUStore(BlockStore):
    """Pinned-CPU blocks keyed by block hash, with a pluggable cache policy and request scope.

    Slot hand-out (vLLM's, shifted by one): never-used ids first, in ascending
    order from 1, then freed ids, last freed first.  Freed ids are pushed in the
    order entries leave: eviction order for ``prepare_store``, key order for
    ``remove`` and failed stores.

    Requests (vLLM 0.33's request scope): a caller opens a request with
    :meth:`on_new_request`, passes its :class:`~tiered_kv.tiers.store.RequestContext`
    to ``prepare_load`` / ``prepare_store`` / ``touch`` (which then count as that
    request's uses, ranked by the keys' positions), and closes it with
    :meth:`on_request_finished`, when the policy commits the request's
    recency.  ``complete_load`` and ``complete_store`` may come after the finish
    (copies in flight).  A call without a request is a use of no request.

    Args:
        num_blocks: Slot ids in the medium, including the reserved id 0 (>= 1);
            the store holds ``num_blocks - 1`` blocks (none for 1, as vLLM's
            manager of zero chunks: every ``prepare_store`` that needs a slot
            returns ``None``).
        policy: A cache policy name (see :mod:`tiered_kv.tiers.policies.factory`).
        enable_events: Queue :class:`~tiered_kv.tiers.store.StoreEvent` for
            ``take_events`` (off by default, as in vLLM, so nobody has to drain).
        policy_module_path: The module that defines ``policy``, for a policy of
            one's own that is not registered.
    """

    medium = "CPU"

    def __init__(
        self, num_blocks: int, policy: str = "lru", enable_events: bool = False, policy_module_path: str | None = None
    ) -> None:
        # 1 is a store that holds nothing (slot 0 is reserved), as vLLM's manager of 0 chunks is: every
        # store is refused for room and its gauges read 0 (vLLM's test_cpu_manager_reports_cache_usage_gauge).
        if num_blocks.__class__ is not int or num_blocks < 1:
            raise InvalidArgumentError(
                "num_blocks must be an int >= 1 (slot 0 is reserved: 1 holds nothing), "
                f"got {checks.describe(num_blocks)}"
            )
        checks.flag("enable_events", enable_events)
        self._num_blocks = num_blocks
        self._capacity = num_blocks - 1
        self.enable_events = enable_events
        self._slots: dict[Key, int] = {}
        self._pending: set[Key] = set()
        self._pins: dict[Key, int] = {}  # ready keys with loads in flight -> how many
        self._next_fresh = 1  # ids >= this were never handed out
        self._free_ids: list[int] = []  # freed ids; the last one is handed out first
        self._events: list[StoreEvent] = []
        self._requests: dict[Hashable, RequestAccess] = {}
        self._allocation_sizes: list[int] = []
        self._hits = self._pending_hits = self._misses = self._evictions = 0
        slots, pending, pins = self._slots, self._pending, self._pins

        def evictable(key: Key) -> bool:
            return key not in pending and key not in pins

        def ready(key: Key) -> bool:
            return key in slots and key not in pending

        self._evictable = evictable
        self._policy: CachePolicy = make_cache_policy(policy, num_blocks - 1, ready, policy_module_path)

    def __repr__(self) -> str:
        return (
            f"CPUStore(num_blocks={self._num_blocks}, policy={self._policy.name!r}, used={self.num_used}, "
            f"pending={self.num_pending}, pinned={self.num_pinned})"
        )

    # ----------------------------------------------------------------- requests
    def on_new_request(self, req: RequestContext) -> None:
        """Open ``req``: its loads and stores are now its uses.

        Raises:
            RequestStateError: a request with this id is already open.
        """
        checks.instance("req", req, RequestContext)
        if req.req_id in self._requests:
            raise RequestStateError(f"request {req.req_id!r} is already open in the {self.medium} store")
        self._requests[req.req_id] = RequestAccess(req)

    def on_request_finished(self, req: RequestContext) -> None:
        """Close ``req``: the policy commits its uses, head to tail (LRU re-ranks, ARC promotes reuses).

        Raises:
            RequestStateError: ``req`` is not open (finished before new, or twice).
        """
        rec = self._request(req, "finish")
        del self._requests[req.req_id]
        self._policy.on_request_finished(rec.prefix_order(), rec.inserted - rec.reused, rec.reused, rec)

    def on_schedule_end(
        self, new_req_ids: Collection[Hashable] = (), preempted_req_ids: Collection[Hashable] = ()
    ) -> None:
        """The end of a scheduler step (vLLM 0.33's ``on_schedule_end``).

        vLLM 0.33's CPU manager defers nothing to it, and neither does this
        store; it checks its arguments, so a driver's mistake shows here.  A
        request scheduled and finished within one step is no longer open, so
        the ids are not checked against the open requests.

        Raises:
            InvalidArgumentError: an argument is not a collection of hashable ids.
        """
        for name, ids in (("new_req_ids", new_req_ids), ("preempted_req_ids", preempted_req_ids)):
            if ids.__class__ is tuple or ids.__class__ is list:
                # One C-level pass proves every id hashable (vLLM's manager does nothing here; a
                # Python loop per id ran at 0.5x its speed, benchmarks/bench_store.py).
                try:
                    if not ids or None not in set(ids):  # type: ignore[arg-type]
                        continue
                except TypeError:
                    pass
            for i, rid in enumerate(as_keys(name, ids)):
                checks.hashable(f"{name}[{i}]", rid)

    def open_requests(self) -> list[Hashable]:
        """Ids of the open requests, in the order they were opened."""
        return list(self._requests)

    def _request(self, req: object, verb: str) -> RequestAccess:
        if req.__class__ is not RequestContext:
            checks.instance("req", req, RequestContext)
        rec = self._requests.get(req.req_id)  # type: ignore[attr-defined]
        if rec is None or rec.context is not req:
            raise RequestStateError(
                f"cannot {verb} for request {req.req_id!r}: it is not open in the {self.medium} store "  # type: ignore[attr-defined]
                "(call on_new_request first; a finished request takes no new loads or stores)"
            )
        return rec

    def _observe(self, rec: RequestAccess, keys: Sequence[Key], named: set[Key], reused: set[Key] | None) -> None:
        """Record ``keys`` (whose set is ``named``) as seen by ``rec``, and ``reused`` as its reuses.

        Set operations decide the common cases (all new, none inserted by this
        request) in C; only a mixed call filters key by key.
        """
        seen = rec.seen
        new = keys if seen.isdisjoint(named) else [key for key in keys if key not in seen]
        if new:
            seen.update(new)
            rec.order.extend(new)
            self._policy.on_request_access(new, rec)
        if reused:
            inserted = rec.inserted
            rec.reused.update(reused if inserted.isdisjoint(reused) else reused - inserted)

    # ------------------------------------------------------------------ queries
    def lookup(self, key: Key, req: RequestContext | None = None) -> LookupResult:
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
        keys = check_keys("keys", keys)
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
        """The first ``n`` ready, unpinned keys in the policy's order (the next eviction victims, roughly)."""
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
        return self._pins.get(key, 0)

    def room_for(self, keys: Sequence[Key]) -> int:
        """How many absent keys a ``prepare_store`` that protects all of ``keys`` could take now.

        Free slots, plus evictable entries that are not among ``keys``.
        """
        named, slots, pending, pins = key_set("keys", keys), self._slots, self._pending, self._pins
        protected_evictable = sum(1 for key in named if key in slots and key not in pending and key not in pins)
        return self.num_free + self.num_evictable - protected_evictable

    def missing(self, keys: Sequence[Key]) -> list[int]:
        try:  # priced per preemption candidate: keys are checked only as far as the answer needs
            out = [i for i, key in enumerate(keys) if key not in self._slots]  # type: ignore[arg-type]
        except TypeError:
            out = None
        if out is None or keys.__class__ not in (list, tuple) or any(keys[i] in _NOT_KEYS for i in out):
            key_set("keys", keys)  # raises, naming the problem (or lets the keys 0 and 1 pass)
        return out  # type: ignore[return-value]

    # -------------------------------------------------------------------- loads
    def _refuse(self, verb: str, keys: Sequence[Key]) -> None:
        """Raise for the first of ``keys`` that is absent or pending, if any."""
        for i, key in enumerate(keys):
            if key not in self._slots or key in self._pending:
                why = "it is not stored" if key not in self._slots else "its store is still in flight"
                raise BlockStateError(
                    f"cannot {verb} key {checks.describe(key)} (keys[{i}]) in the {self.medium} store: {why}"
                )

    def prepare_load(self, keys: Sequence[Key], req: RequestContext | None = None) -> LoadStoreSpec:
        """Pin every key (one more load each) and return their slots; with ``req``, a use by that request.

        Raises:
            BlockStateError: a key is absent or pending.
            RequestStateError: ``req`` is not open.  Nothing changes in either case.
        """
        keys, named = keys_and_set("keys", keys)
        rec = self._request(req, "load") if req is not None else None
        slots, pins, pending = self._slots, self._pins, self._pending
        # Set comparisons run in C: a generator per key was a tenth of the load's time.
        if not (slots.keys() >= named and pending.isdisjoint(named)):
            self._refuse("load", keys)
        if pins.keys().isdisjoint(named):  # the common case: no key is being loaded already
            pins.update(dict.fromkeys(keys, 1))
            self._policy.mark_non_evictable_all(keys)
        else:
            idle = [key for key in keys if key not in pins]
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
            if idle:
                self._policy.mark_non_evictable_all(idle)
        if rec is not None:
            self._observe(rec, keys, named, named)
        return make_spec(self.medium, tuple(map(slots.__getitem__, keys)))

    def touch(self, keys: Sequence[Key], req: RequestContext | None = None) -> None:
        keys = check_keys("keys", keys)
        rec = self._request(req, "touch") if req is not None else None
        self._policy.touch(keys, rec)

    def complete_load(self, keys: Sequence[Key], req: RequestContext | None = None) -> None:
        """Unpin every key once the copy that read it has finished (``req`` may be finished by now).

        Raises:
            BlockStateError: a key is absent, pending or not being loaded; nothing changes.
        """
        keys, named = keys_and_set("keys", keys)
        pins = self._pins
        if not pins.keys() >= named:
            self._refuse("complete the load of", keys)
            for i, key in enumerate(keys):
                if key not in pins:
                    raise BlockStateError(
                        f"cannot complete the load of key {checks.describe(key)} (keys[{i}]) "
                        f"in the {self.medium} store: it is not being loaded"
                    )
        idle = []
        for key in keys:
            n = pins[key]
            if n == 1:
                del pins[key]
                idle.append(key)
            else:
                pins[key] = n - 1
        if idle:
            self._policy.mark_evictable_all(idle)

    # ------------------------------------------------------------------- stores
    def prepare_store(self, keys: Sequence[Key], req: RequestContext | None = None) -> PrepareStoreOutput | None:
        """Reserve a slot for each absent key, evicting by policy; with ``req``, that request's offer.

        Present keys are skipped and protected.  As in vLLM 0.33, the offer is
        observed (ARC learns from ghosts, the request records what it saw)
        before the store knows whether it fits.

        Returns:
            The keys to copy, their slots and what was evicted; or ``None`` when
            too few entries are evictable, and then no entry or slot changed.

        Raises:
            RequestStateError: ``req`` is not open; nothing changes.
        """
        keys, named = keys_and_set("keys", keys)
        rec = self._request(req, "store") if req is not None else None
        slots, pending = self._slots, self._pending
        # A fresh chunk (no key resident) is the common offer: one C-level test instead of a filter.
        fresh = slots.keys().isdisjoint(named)
        to_store = list(keys) if fresh else [key for key in keys if key not in slots]
        policy = self._policy
        if rec is not None:
            misses = rec.store_misses
            new = to_store if misses.isdisjoint(named) else [key for key in to_store if key not in misses]
            if new:
                policy.on_store_miss(new, rec)
                misses.update(new)
            rec.offered.update(named)
            if fresh:
                self._observe(rec, keys, named, None)
            else:
                ready = [key for key in keys if key in slots and key not in pending]
                if ready:
                    keep = set(to_store)
                    keep.update(ready)
                    self._observe(rec, [key for key in keys if key in keep], keep, set(ready))
                elif to_store:
                    self._observe(rec, to_store, set(to_store), None)
        elif to_store:
            policy.on_store_miss(to_store, None)
        if not to_store:
            return make_prepare_output([], self.medium, (), [])
        self._allocation_sizes.append(len(to_store))
        need = len(to_store) - self._capacity + len(slots)
        if need > 0:
            if need > len(slots) - len(pending) - len(self._pins):
                return None
            evicted = policy.evict(need, named, self._evictable)
            if evicted is None:
                return None
            self._free_ids.extend(map(slots.pop, evicted))  # in eviction order, as vLLM frees them
            self._evictions += len(evicted)
            if self.enable_events:
                self._events.append(StoreEvent(list(evicted), self.medium, True))
        else:
            evicted = []
        block_ids = self._allocate(len(to_store))
        slots.update(zip(to_store, block_ids, strict=True))
        pending.update(to_store)
        policy.insert_all(to_store, rec)
        if rec is not None:
            rec.inserted.update(to_store)
        return make_prepare_output(to_store, self.medium, block_ids, evicted)

    def complete_store(self, keys: Sequence[Key], success: bool = True, req: RequestContext | None = None) -> None:
        """Finish stores: pending keys become ready, or with ``success=False`` are dropped.

        Keys that are not pending are ignored, as in vLLM: a caller may pass the
        whole collection it offered.  With an open ``req``, a key that is absent
        and that ``req`` never offered is a caller's bug.

        Raises:
            BlockStateError: with an open ``req``, a key is absent and was never
                offered by it; nothing changes.
        """
        keys, named = keys_and_set("keys", keys)
        if success is not True and success is not False:
            checks.flag("success", success)
        if req is not None:
            if req.__class__ is not RequestContext:  # the exact class skips isinstance's ABC machinery
                checks.instance("req", req, RequestContext)
            rec = self._requests.get(req.req_id)
            if rec is not None and rec.context is req:
                slots, offered = self._slots, rec.offered
                # Nearly always every key was offered: one C-level subset test, the per-key scan
                # (which names the culprit) only when it fails.
                for i, key in enumerate(() if offered.issuperset(named) else keys):
                    if key not in slots and key not in offered:
                        raise BlockStateError(
                            f"cannot complete the store of key {checks.describe(key)} (keys[{i}]) in the "
                            f"{self.medium} store: request {req.req_id!r} never prepared it"
                        )
        pending = self._pending
        # Usually every key is pending (a caller completes what it stored): a subset test in C.
        done = list(keys) if pending.issuperset(named) else [key for key in keys if key in pending]
        if not done:
            return
        pending.difference_update(done)
        policy = self._policy
        if success:
            policy.mark_evictable_all(done)
        else:
            slots, free, remove = self._slots, self._free_ids, policy.remove
            for key in done:
                remove(key)
                free.append(slots.pop(key))
        if self.enable_events:
            self._events.append(StoreEvent(done, self.medium, not success, not success))

    def remove(self, keys: Sequence[Key]) -> None:
        keys = check_keys("keys", keys)
        slots = self._slots
        if not all(key in slots and key not in self._pending for key in keys):
            self._refuse("remove", keys)
        for i, key in enumerate(keys):
            if key in self._pins:
                raise BlockStateError(
                    f"cannot remove key {checks.describe(key)} (keys[{i}]) from the {self.medium} store: "
                    f"{self._pins[key]} load(s) in flight read it"
                )
        if not keys:
            return
        remove = self._policy.remove
        for key in keys:
            remove(key)
        self._free_ids.extend(map(slots.pop, keys))
        if self.enable_events:
            self._events.append(StoreEvent(list(keys), self.medium, True))

    def take_events(self) -> list[StoreEvent]:
        events, self._events = self._events, []
        out = []
        slots = self._slots
        for event in events:
            if event.metadata_only:
                # A retry may have stored the key again since its failed store was queued.
                keys = [key for key in event.keys if key not in slots]
                if not keys:
                    continue
                if len(keys) != len(event.keys):
                    event = StoreEvent(keys, event.medium, True, True)
            out.append(event)
        return out

    def reset_cache(self) -> None:
        """Drop every entry and the policy's state; open requests stay open, with nothing observed.

        vLLM's scheduler guarantees no copy is in flight across a reset; here
        that is checked, because a reused slot would be written twice.

        Raises:
            BlockStateError: a store or a load is in flight; nothing changes.
        """
        if self._pending or self._pins:
            raise BlockStateError(
                f"cannot reset the {self.medium} store: {len(self._pending)} store(s) and "
                f"{len(self._pins)} load(s) are in flight"
            )
        self._slots.clear()
        self._free_ids.clear()
        self._next_fresh = 1
        self._policy.clear()
        for rec in self._requests.values():
            rec.reset()

    def get_stats(self) -> StoreUsage:
        """The usage gauges now and the allocation sizes since the last call (which it clears)."""
        cap = self._capacity or 1  # a store of no capacity holds nothing: its gauges read 0, as vLLM's do
        usage = (len(self._pending) + len(self._pins)) / cap
        write = len(self._pending) / cap
        sizes = tuple(self._allocation_sizes)
        self._allocation_sizes.clear()
        return StoreUsage(usage, write, max(usage - write, 0.0), sizes)

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
        return len(self._pins)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_evictable(self) -> int:
        return len(self._slots) - len(self._pending) - len(self._pins)

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
        slots, pending, pins = self._slots, self._pending, self._pins
        return [StoreEntry(key, slots[key], key not in pending, pins.get(key, 0)) for key in self._policy.order()]

    def check_invariants(self) -> None:
        slots, pending, pins = self._slots, self._pending, self._pins
        order = self._policy.order()
        assert len(order) == len(slots) and set(order) == set(slots), "policy and slots disagree"
        held = list(slots.values())
        free = self.free_block_ids()
        assert sorted(held + free) == list(range(1, self._num_blocks)), f"slots lost or shared: {held}, {free}"
        assert pending <= slots.keys(), f"pending keys that are not resident: {pending - slots.keys()}"
        assert pins.keys() <= slots.keys(), f"pinned keys that are not resident: {pins.keys() - slots.keys()}"
        assert pending.isdisjoint(pins), f"pinned keys whose store is in flight: {pending & pins.keys()}"
        assert all(n.__class__ is int and n > 0 for n in pins.values()), f"bad pin counts: {pins}"
        assert self.num_used + self.num_free == self.capacity, "used + free != capacity"
        self._policy.check_invariants()
