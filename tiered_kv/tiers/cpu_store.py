"""The CPU tier, and the protocol of every tier below the GPU: a block store keyed by block hash.

A store holds whole KV blocks, each under a key: the block's hash (``bytes`` or
``int``) for shareable prefix blocks, or a private key object for blocks that
belong to one request.  The verbs are those of vLLM 0.33.0's ``OffloadingManager``
(``vllm/v1/kv_offload/base.py``), so that the CPU tier, a disk tier and a remote
tier are interchangeable under the tier manager:

* ``lookup`` / ``lookup_prefix`` ask what is there;
* ``prepare_load`` pins blocks for a copy out of the store, ``complete_load``
  unpins them, ``touch`` records use;
* ``prepare_store`` reserves slots (evicting by policy), ``complete_store``
  makes the written blocks loadable or, on failure, drops them;
* ``remove`` drops blocks whose owner no longer needs them;
* ``take_events`` drains what was stored and removed, for external indexes.

:class:`CPUStore` implements it over a fixed set of slots: the blocks of the
pinned CPU KV tensor (layer 1); this module only decides which key owns which
slot.  The disk and remote stores subclass it
(:class:`~tiered_kv.tiers.keyed_store.KeyedStore`), where a slot is a unit of
capacity of their medium, and take the same verbs without a request.  It follows
vLLM 0.33.0's ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``)
with the same policy and its request scope (:class:`RequestContext`,
``on_new_request`` / ``on_request_finished`` / ``on_schedule_end``): the same
answers, the same evictions in the same order, the same slots (shifted by one:
our slot 0 is reserved, because transfer plans refuse block 0) and the same
events.  ``tests/test_store_vllm_parity.py`` replays seeded traces through
vLLM's own class and this one side by side and checks exactly that.  What it
adds on top of that protocol, for the tier manager: several loads of one key
(pins for swap-outs), ``remove`` of a request's private blocks, prefix and room
queries, and typed errors for calls vLLM only asserts.

A store is bookkeeping only.  It never touches memory and never imports torch:
it tells a copy engine *where* the bytes go
(:class:`~tiered_kv.tiers.store.LoadStoreSpec`) and the layer above moves them.

Life of an entry (``ref`` is the number of loads in flight)::

    absent --prepare_store--> PENDING --complete_store--> READY, ref 0 --prepare_load--> READY, ref > 0
     ^  ^                        |                          |    ^                             |
     |  +--complete_store(False)-+                          |    +--------complete_load--------+
     +------------- evicted by prepare_store, or remove ----+

Every public call checks all of its arguments, types included, before it
changes anything; misuse raises a :class:`~tiered_kv.errors.TieredKVError`
subclass naming what was wrong, and a store that cannot make room returns
``None`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError, RequestStateError
from tiered_kv.tiers.policies.base import CachePolicy
from tiered_kv.tiers.policies.factory import make_cache_policy
from tiered_kv.tiers.store import (
    Key,
    LoadStoreSpec,
    LookupResult,
    PrepareStoreOutput,
    StoreEntry,
    StoreEvent,
    StoreStats,
)

_HIT, _MISS, _HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
_NOT_KEYS = (None, True, False)  # never stored, so always missing: a caller's bug to name


def check_key(name: str, key: object) -> Key:
    """Return ``key`` if it can be a store key; else raise :class:`InvalidArgumentError`.

    ``None`` is refused (it is what a missing hash looks like) and so is
    ``bool``: ``True == 1`` would alias the block hashed to 1.
    """
    if key.__class__ is bool:
        raise InvalidArgumentError(f"{name} must be a hashable key that is not a bool, got {checks.describe(key)}")
    return checks.hashable(name, key)


def as_keys(name: str, keys: object) -> Sequence[Key]:
    """``keys`` as a list or tuple: itself if it is one, else its items in iteration order.

    vLLM 0.33's manager takes any collection of keys (its connector completes
    stores with a ``set``), so every collection is accepted; its iteration order
    is then the order.  ``bytes``, ``str`` and mappings are refused: they are
    collections of characters or of pairs, not of keys.
    """
    if keys.__class__ is list or keys.__class__ is tuple:
        return keys  # type: ignore[return-value]
    if isinstance(keys, str | bytes | bytearray | memoryview | dict) or not isinstance(keys, Collection):
        raise InvalidArgumentError(f"{name} must be a collection of keys, got {checks.describe(keys)}")
    return list(keys)


def check_keys(name: str, keys: object) -> Sequence[Key]:
    """Return ``keys`` as a list or tuple (see :func:`as_keys`) if it holds distinct valid keys.

    A key named twice in one call is a caller bug (a chained block hash cannot
    repeat within one request), and refusing it keeps every per-key
    precondition checkable before any change.
    """
    seq = as_keys(name, keys)
    key_set(name, seq)
    return seq


def keys_and_set(name: str, keys: object) -> tuple[Sequence[Key], set[Key]]:
    """``(check_keys(name, keys), key_set(name, keys))`` in one pass: the checked keys and their set.

    A store that needs both (C-level subset and disjointness tests against its
    own sets instead of a Python loop per key) builds the set once.  The checks
    of :func:`key_set` are inlined: this runs on every load and store.
    """
    cls = keys.__class__
    if cls is set or cls is frozenset:
        seq: Sequence[Key] = list(keys)  # type: ignore[call-overload]  # distinct by construction
    elif cls is list or cls is tuple:
        seq = keys  # type: ignore[assignment]
    else:
        seq = as_keys(name, keys)
    try:
        distinct = set(seq)
    except TypeError:
        return seq, key_set(name, seq)  # raises, naming the unhashable key
    if len(distinct) == len(seq) and None not in distinct and True not in distinct and False not in distinct:
        return seq, distinct
    return seq, key_set(name, seq)  # raises, or lets the keys 0 and 1 pass


def key_set(name: str, keys: object) -> set[Key]:
    """``set(keys)``, once ``keys`` has passed the checks of :func:`check_keys`; else raise as it says.

    Stores need the set anyway (all-or-nothing membership tests, the keys an
    eviction must spare), so building it doubles as the check: one C-level
    pass proves every key hashable and distinct.
    """
    if keys.__class__ is not list and keys.__class__ is not tuple:
        keys = list(keys) if keys.__class__ is set or keys.__class__ is frozenset else as_keys(name, keys)
    try:
        distinct = set(keys)  # type: ignore[arg-type]
    except TypeError:
        distinct = None
    # ``True in`` also matches the key 1 (equal hashes), so 0 and 1 take the exact path below.
    if (
        distinct is not None
        and len(distinct) == len(keys)  # type: ignore[arg-type]
        and None not in distinct
        and True not in distinct
        and False not in distinct
    ):
        return distinct
    seen: dict[Key, int] = {}
    for i, key in enumerate(keys):  # type: ignore[arg-type]
        check_key(f"{name}[{i}]", key)
        j = seen.setdefault(key, i)
        if j != i:
            raise InvalidArgumentError(f"{name} names key {checks.describe(key)} twice (positions {j} and {i})")
    return set(seen)


def _bad_key(name: str, key: object) -> NoReturn:
    check_key(name, key)  # raises for every key the fast paths hand it
    raise AssertionError(f"{name}: {key!r} was sent to the slow check but passes it")


# A frozen dataclass's generated __init__ sets each field through object.__setattr__
# by name; on the store's hottest return values that was half a microsecond per call.
# Writing the slots through their member descriptors gives the same object for
# about a third of that (benchmarks/bench_store.py).
_new = object.__new__
_set_medium = LoadStoreSpec.medium.__set__  # type: ignore[attr-defined]
_set_block_ids = LoadStoreSpec.block_ids.__set__  # type: ignore[attr-defined]
_set_keys_to_store = PrepareStoreOutput.keys_to_store.__set__  # type: ignore[attr-defined]
_set_store_spec = PrepareStoreOutput.store_spec.__set__  # type: ignore[attr-defined]
_set_evicted_keys = PrepareStoreOutput.evicted_keys.__set__  # type: ignore[attr-defined]


def make_spec(medium: str, block_ids: tuple[int, ...]) -> LoadStoreSpec:
    """``LoadStoreSpec(medium, block_ids)``, built without the generated ``__init__`` (same object, faster)."""
    spec = _new(LoadStoreSpec)
    _set_medium(spec, medium)
    _set_block_ids(spec, block_ids)
    return spec


def make_prepare_output(
    keys_to_store: list[Key], medium: str, block_ids: tuple[int, ...], evicted_keys: list[Key]
) -> PrepareStoreOutput:
    """``PrepareStoreOutput(keys_to_store, LoadStoreSpec(medium, block_ids), evicted_keys)``, built fast.

    Built as :func:`make_spec` builds, both records in one call.
    """
    spec = _new(LoadStoreSpec)
    _set_medium(spec, medium)
    _set_block_ids(spec, block_ids)
    out = _new(PrepareStoreOutput)
    _set_keys_to_store(out, keys_to_store)
    _set_store_spec(out, spec)
    _set_evicted_keys(out, evicted_keys)
    return out


@dataclass(slots=True, eq=False)
class RequestContext:
    """One request, as the stores see it (vLLM 0.33's ``ReqContext``, without its transfer parameters).

    It carries the end-token position of each of the request's keys, so that a
    store can rank a request's blocks by prefix order even when its stores arrive
    out of order: a request's tail is worth less than its head, because a later
    block is useless without every block before it.

    A key's position is fixed once set (it is where the block ends in the
    request's token sequence): moving it is a caller's bug, so it raises
    :class:`~tiered_kv.errors.RequestStateError` and changes nothing.  Two keys
    of one request share a position only in vLLM's hybrid models (one key per
    KV cache group, which we do not claim); the LRU policy then breaks the tie
    by comparing the keys, as vLLM does, so such keys must be orderable.

    Attributes:
        req_id: The request's id; a store tracks at most one open request per id.
    """

    req_id: Hashable
    _positions: dict[Key, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # A store keys its open requests by this id: one that cannot be a dict key is refused here,
        # by name, rather than with a bare TypeError from the first verb that takes the request.
        try:
            hash(self.req_id)
        except TypeError:
            raise InvalidArgumentError(f"req_id must be a hashable id, got {checks.describe(self.req_id)}") from None

    def set_position(self, key: Key, end_token: int) -> None:
        """Record that ``key``'s block ends at token ``end_token`` (>= 1) of this request.

        Raises:
            InvalidArgumentError: ``key`` is not a key or ``end_token`` not a count >= 1.
            RequestStateError: ``key`` already has another position.
        """
        check_key("key", key)
        checks.count("end_token", end_token, 1)
        old = self._positions.get(key)
        if old is not None and old != end_token:
            raise RequestStateError(
                f"request {self.req_id!r}: key {checks.describe(key)} already ends at token {old}, "
                f"cannot move it to {end_token}"
            )
        self._positions[key] = end_token

    def set_positions(self, keys: Sequence[Key], first_end: int, step: int) -> None:
        """Positions for consecutive blocks: ``keys[i]`` ends at ``first_end + i * step``, all or nothing.

        Raises:
            InvalidArgumentError, RequestStateError: as :meth:`set_position`; nothing is recorded.
        """
        checks.count("first_end", first_end, 1)
        checks.count("step", step, 1)
        keys = check_keys("keys", keys)
        positions = self._positions
        if positions.keys().isdisjoint(keys):
            # None set yet (every admission's call): nothing to check, one C-level test instead of a lookup per key.
            positions.update(zip(keys, range(first_end, first_end + len(keys) * step, step), strict=True))
            return
        for i, key in enumerate(keys):
            end = first_end + i * step
            old = positions.get(key)
            if old is not None and old != end:
                raise RequestStateError(
                    f"request {self.req_id!r}: key {checks.describe(key)} (keys[{i}]) already ends at token {old}, "
                    f"cannot move it to {end}"
                )
        positions.update(zip(keys, range(first_end, first_end + len(keys) * step, step), strict=True))

    def position(self, key: Key) -> int | None:
        """The end token set for ``key``, or ``None``."""
        return self._positions.get(key)


@dataclass(slots=True, eq=False)
class RequestAccess:
    """One open request's observations in one store (vLLM 0.33's ``_RequestCacheAccess``).

    The store hands them to the cache policy when the request finishes, so a
    policy can tell a block a request merely inserted from one it reused; a
    policy reads them and keeps one number of its own here (the LRU request rank).

    Attributes:
        context: The request's context (its id and its keys' positions).
        order: Keys first seen by a load or a store of this request, in the order seen.
        seen: ``set(order)``.
        inserted: Keys this request's stores reserved.
        reused: Ready keys this request read or offered again, that it had not inserted itself.
        store_misses: Keys this request offered while absent (a policy learns from each once).
        offered_present: Keys this request offered while resident; with ``store_misses``, every key it
            named to ``prepare_store`` (what ``complete_store`` may name).  Kept apart so that a fresh
            offer, the common one, updates one set instead of two.
        rank: The LRU policy's request rank; 0 until it assigns one.
    """

    context: RequestContext
    order: list[Key] = field(default_factory=list)
    seen: set[Key] = field(default_factory=set)
    inserted: set[Key] = field(default_factory=set)
    reused: set[Key] = field(default_factory=set)
    store_misses: set[Key] = field(default_factory=set)
    offered_present: set[Key] = field(default_factory=set)
    rank: int = 0

    def reset(self) -> None:
        """Forget every observation (the store was reset); the request stays open."""
        self.order.clear()
        self.seen.clear()
        self.inserted.clear()
        self.reused.clear()
        self.store_misses.clear()
        self.offered_present.clear()
        self.rank = 0

    def prefix_order(self) -> list[Key]:
        """The seen keys head to tail: by position when every one has one, else in the order seen."""
        pos = self.context._positions
        keys = self.order
        if pos.keys() >= self.seen:  # every seen key has a position (``seen`` is ``set(order)``), tested in C
            return sorted(keys, key=pos.__getitem__)
        return list(keys)


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


class CPUStore:
    """Pinned-CPU blocks keyed by block hash, with a pluggable cache policy and request scope.

    Invariants (the disk and remote stores keep them too):

    * ``num_used + num_free == capacity``; each slot is held by at most one key.
    * A pending entry is neither loadable nor evictable: its bytes are still
      being written, so a load would read garbage and an eviction would hand the
      slot to a second writer while the first copy still runs.
    * A pinned entry (``ref_cnt > 0``) is never evicted or removed: a copy is
      reading its slot.
    * A refused call (``None`` returned, or an error raised) changes nothing.

    Slot hand-out (vLLM's, shifted by one): never-used ids first, in ascending
    order from 1, then freed ids, last freed first.  Freed ids are pushed in the
    order entries leave: eviction order for ``prepare_store``, key order for
    ``remove`` and failed stores.

    Requests (vLLM 0.33's request scope): a caller opens a request with
    :meth:`on_new_request`, passes its :class:`RequestContext`
    to ``prepare_load`` / ``prepare_store`` / ``touch`` (which then count as that
    request's uses, ranked by the keys' positions), and closes it with
    :meth:`on_request_finished`, when the policy commits the request's
    recency.  ``complete_load`` and ``complete_store`` may come after the finish
    (copies in flight).  A call without a request is a use of no request.

    Attributes:
        medium: The name copy engines know the medium by (``"CPU"``; a lower tier's own below it).

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
        # Hooks left at the base's no-ops are not called: ARC learns at a request's finish and reads
        # evictability from the predicate at eviction, so its loads and completed stores call nothing.
        cls, base = type(self._policy), CachePolicy
        self._on_access = None if cls.on_request_access is base.on_request_access else self._policy.on_request_access
        self._mark_evictable = (
            None
            if cls.mark_evictable_all is base.mark_evictable_all and cls.mark_evictable is base.mark_evictable
            else self._policy.mark_evictable_all
        )
        self._mark_non_evictable = (
            None
            if cls.mark_non_evictable_all is base.mark_non_evictable_all
            and cls.mark_non_evictable is base.mark_non_evictable
            else self._policy.mark_non_evictable_all
        )

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
            if self._on_access is not None:
                self._on_access(new, rec)
        if reused:
            inserted = rec.inserted
            rec.reused.update(reused if inserted.isdisjoint(reused) else reused - inserted)

    # ------------------------------------------------------------------ queries
    def lookup(self, key: Key, req: RequestContext | None = None) -> LookupResult:
        """Whether ``key`` is ready, pending or absent (counted in :attr:`stats`)."""
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
        """How many leading ``keys`` are ready; a pending key ends the prefix (its bytes cannot be loaded yet)."""
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
        """Indexes of the ``keys`` that are not resident (not even pending), in order, without counting queries."""
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

        Pins keep the slots from being evicted or removed until
        :meth:`complete_load`.  Without a request, recency is not changed here
        (call :meth:`touch`).

        Raises:
            BlockStateError: a key is absent or pending.
            RequestStateError: ``req`` is not open.  Nothing changes in either case.
        """
        keys, named = keys_and_set("keys", keys)
        rec = None
        if req is not None:
            rec = self._requests.get(req.req_id) if req.__class__ is RequestContext else None
            if rec is None or rec.context is not req:  # _request's checks, as in prepare_store
                rec = self._request(req, "load")
        slots, pins, pending = self._slots, self._pins, self._pending
        # Set comparisons run in C: a generator per key was a tenth of the load's time.
        if not (slots.keys() >= named and pending.isdisjoint(named)):
            self._refuse("load", keys)
        if pins.keys().isdisjoint(named):  # the common case: no key is being loaded already
            pins.update(dict.fromkeys(keys, 1))
            if self._mark_non_evictable is not None:
                self._mark_non_evictable(keys)
        else:
            idle = [key for key in keys if key not in pins]
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
            if idle and self._mark_non_evictable is not None:
                self._mark_non_evictable(idle)
        if rec is not None and named:  # an empty load is no access (vLLM's manager records none)
            seen = rec.seen
            if seen.isdisjoint(named):  # _observe's common case, inlined: a first load of these keys
                seen.update(named)
                rec.order.extend(keys)
                if self._on_access is not None:
                    self._on_access(keys, rec)
                inserted = rec.inserted
                rec.reused.update(named if inserted.isdisjoint(named) else named - inserted)
            else:
                self._observe(rec, keys, named, named)
        spec = _new(LoadStoreSpec)  # make_spec, inlined
        _set_medium(spec, self.medium)
        _set_block_ids(spec, tuple(map(slots.__getitem__, keys)))
        return spec

    def touch(self, keys: Sequence[Key], req: RequestContext | None = None) -> None:
        """Record a use of ``keys``; unknown keys are ignored.

        Keys are walked in reverse, so the *first* key ends most recent.  The
        keys of one request form a prefix chain, and a later block is useless
        without every block before it: evicting from the tail of a chain first
        keeps the longest loadable prefix.
        """
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
        if idle and self._mark_evictable is not None:
            self._mark_evictable(idle)

    # ------------------------------------------------------------------- stores
    def prepare_store(self, keys: Sequence[Key], req: RequestContext | None = None) -> PrepareStoreOutput | None:
        """Reserve a slot for each absent key, evicting by policy; with ``req``, that request's offer.

        Present keys (pending or ready) are skipped and protected: the eviction
        never picks one of the given keys, because the caller is about to rely
        on them.  New entries are pending until :meth:`complete_store`.  As in vLLM 0.33, the offer is
        observed (ARC learns from ghosts, the request records what it saw)
        before the store knows whether it fits.

        Returns:
            The keys to copy, their slots and what was evicted; or ``None`` when
            too few entries are evictable, and then no entry or slot changed.

        Raises:
            RequestStateError: ``req`` is not open; nothing changes.
        """
        keys, named = keys_and_set("keys", keys)
        rec = None
        if req is not None:
            # _request's checks, inlined for the common case (the exact class, an open request).
            rec = self._requests.get(req.req_id) if req.__class__ is RequestContext else None
            if rec is None or rec.context is not req:
                rec = self._request(req, "store")
        if not named:
            return make_prepare_output([], self.medium, (), [])
        slots, pending, policy = self._slots, self._pending, self._policy
        if slots.keys().isdisjoint(named):
            # A fresh chunk (no key resident), the common offer: whole-set updates in C, no filter per key.
            to_store = list(keys)
            if rec is not None:
                misses, seen = rec.store_misses, rec.seen
                if seen.isdisjoint(named):  # then so are the misses: every store miss is seen
                    policy.on_store_miss(to_store, rec)
                    misses.update(named)
                    seen.update(named)
                    rec.order.extend(keys)
                    if self._on_access is not None:
                        self._on_access(keys, rec)
                else:
                    new = [key for key in to_store if key not in misses]
                    if new:
                        policy.on_store_miss(new, rec)
                        misses.update(new)
                    new = [key for key in keys if key not in seen]
                    if new:
                        seen.update(new)
                        rec.order.extend(new)
                        if self._on_access is not None:
                            self._on_access(new, rec)
            else:
                policy.on_store_miss(to_store, None)
        else:
            to_store = [key for key in keys if key not in slots]
            if rec is not None:
                misses = rec.store_misses
                new = to_store if misses.isdisjoint(named) else [key for key in to_store if key not in misses]
                if new:
                    policy.on_store_miss(new, rec)
                    misses.update(new)
                present = [key for key in keys if key in slots]
                rec.offered_present.update(present)
                ready = [key for key in present if key not in pending]
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
        n = len(to_store)
        self._allocation_sizes.append(n)
        need = n - self._capacity + len(slots)
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
        start = self._next_fresh
        if start + n <= self._num_blocks:  # never-used ids left: _allocate's first case, inlined
            self._next_fresh = start + n
            block_ids: tuple[int, ...] = tuple(range(start, start + n))
        else:
            block_ids = self._allocate(n)
        slots.update(zip(to_store, block_ids, strict=True))
        pending.update(to_store)
        policy.insert_all(to_store, rec)
        if rec is not None:
            rec.inserted.update(to_store)
        return make_prepare_output(to_store, self.medium, block_ids, evicted)

    def complete_store(self, keys: Sequence[Key], success: bool = True, req: RequestContext | None = None) -> None:
        """Finish stores: pending keys become ready, or with ``success=False`` are dropped.

        Keys that are not pending are ignored, as in vLLM: a caller may pass the
        whole collection it offered (a completion for a key this store never
        reserved is not reported).  With an open ``req``, a key that is absent
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
                slots, misses, present = self._slots, rec.store_misses, rec.offered_present
                # Nearly always every key was offered while absent: one C-level subset test, the per-key
                # scan (which names the culprit) only when it fails.
                for i, key in enumerate(() if misses.issuperset(named) else keys):
                    if key not in slots and key not in misses and key not in present:
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
        if success:
            if self._mark_evictable is not None:
                self._mark_evictable(done)
        else:
            slots, free, remove = self._slots, self._free_ids, self._policy.remove
            for key in done:
                remove(key)
                free.append(slots.pop(key))
        if self.enable_events:
            self._events.append(StoreEvent(done, self.medium, not success, not success))

    def remove(self, keys: Sequence[Key]) -> None:
        """Drop ready, unpinned entries now (private blocks whose owner is done).

        Raises:
            BlockStateError: A key is absent, pending or pinned; nothing changes.
        """
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
        """Return the queued events (oldest first) and start a new batch."""
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
        """Slot ids in the medium, including the reserved id 0."""
        return self._num_blocks

    @property
    def capacity(self) -> int:
        """Blocks the store can hold: ``num_blocks - 1`` (slot 0 is reserved)."""
        return self._capacity

    @property
    def num_used(self) -> int:
        """Slots held by an entry, pending or ready."""
        return len(self._slots)

    @property
    def num_free(self) -> int:
        """Slots held by no entry."""
        return self._capacity - len(self._slots)

    @property
    def usage(self) -> float:
        """``num_used / capacity``: occupied slots, evictable ones included (0 for a store of no capacity)."""
        return len(self._slots) / self._capacity if self._capacity else 0.0

    @property
    def num_pinned(self) -> int:
        """Entries with a load in flight (``ref_cnt > 0``)."""
        return len(self._pins)

    @property
    def num_pending(self) -> int:
        """Entries whose store is in flight."""
        return len(self._pending)

    @property
    def num_evictable(self) -> int:
        """Ready entries with no load in flight: what eviction may pick from."""
        return len(self._slots) - len(self._pending) - len(self._pins)

    @property
    def stats(self) -> StoreStats:
        """Cumulative hit/query/eviction counters."""
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
        """Every resident entry, in the policy's order (LRU: least recent first)."""
        slots, pending, pins = self._slots, self._pending, self._pins
        return [StoreEntry(key, slots[key], key not in pending, pins.get(key, 0)) for key in self._policy.order()]

    def check_invariants(self) -> None:
        """Assert the store's invariants (O(num_blocks); for tests and debugging)."""
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
