"""The interface of every tier below the GPU: a block store keyed by block hash.

A store holds whole KV blocks, each under a key: the block's hash (``bytes`` or
``int``) for shareable prefix blocks, or a private key object for blocks that
belong to one request.  The verbs are those of vLLM 0.33.0's ``OffloadingManager``
(``vllm/v1/kv_offload/base.py``), so that the CPU tier, a disk tier and a remote
tier are interchangeable under the tier manager.  The CPU store
(:class:`~tiered_kv.tiers.cpu_store.CPUStore`) follows vLLM 0.33.0's request-scoped
protocol (:class:`RequestContext`, ``on_new_request`` / ``on_request_finished`` /
``on_schedule_end``); the disk and remote stores accept the same verbs without a
request:

* ``lookup`` / ``lookup_prefix`` ask what is there;
* ``prepare_load`` pins blocks for a copy out of the store, ``complete_load``
  unpins them, ``touch`` records use;
* ``prepare_store`` reserves slots (evicting by policy), ``complete_store``
  makes the written blocks loadable or, on failure, drops them;
* ``remove`` drops blocks whose owner no longer needs them;
* ``take_events`` drains what was stored and removed, for external indexes.

A store is bookkeeping only.  It never touches memory and never imports torch:
it tells a copy engine *where* the bytes go (:class:`LoadStoreSpec`) and the
layer above moves them.

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

import abc
import enum
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError, RequestStateError

Key = Hashable
"""A block hash (``bytes`` or ``int``), or a private key object for a request's own blocks."""


class LookupResult(enum.Enum):
    """What ``lookup`` found for one key."""

    MISS = "miss"
    HIT = "hit"  # ready: may be loaded now
    HIT_PENDING = "hit_pending"  # a store of it is in flight: do not store it again, do not load it yet


@dataclass(frozen=True, slots=True)
class LoadStoreSpec:
    """Where blocks live in one medium, for a copy engine.

    Attributes:
        medium: The medium the slots are in: ``"CPU"`` for the CPU store, a lower
            tier's own (``"DISK"``, ``"REMOTE"``) for the stores below it.
        block_ids: One slot per key, in the order the keys were given.
    """

    medium: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided.

    Attributes:
        keys_to_store: The given keys that were absent (neither pending nor
            ready), in the given order; now pending.  The caller copies exactly
            these and then calls ``complete_store``.
        store_spec: One slot per key of ``keys_to_store``, in that order.
        evicted_keys: What was evicted to make room, in eviction order.  Their
            slots may be among ``store_spec.block_ids``.
    """

    keys_to_store: list[Key]
    store_spec: LoadStoreSpec
    evicted_keys: list[Key]


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


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Keys that became loadable (``removed=False``) or left the store (``removed=True``).

    A pending entry dropped because its store failed is reported as vLLM 0.33
    reports it: ``removed=True, metadata_only=True`` (its slot was released, but
    it was never announced as stored, so it is no public eviction).  When the
    events are taken, such an event keeps only the keys that are still absent:
    a retry may have stored the key again meanwhile.
    """

    keys: list[Key]
    medium: str
    removed: bool
    metadata_only: bool = False


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


@dataclass(frozen=True, slots=True)
class StoreEntry:
    """One resident entry, as :meth:`BlockStore.entries` reports it.

    Attributes:
        key: The entry's key.
        block_id: Its slot in the medium.
        ready: False while its store is in flight.
        ref_cnt: Loads in flight (always 0 while pending).
    """

    key: Key
    block_id: int
    ready: bool
    ref_cnt: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was built (callers take differences for rates).

    Attributes:
        queries: Keys looked up (one per ``lookup``, ``len(keys)`` per ``lookup_prefix``).
        hits: Keys found ready.
        pending_hits: Keys found pending (``lookup`` only; vLLM counts these as hits).
        evictions: Entries evicted to make room (``remove`` is not an eviction).
    """

    queries: int = 0
    hits: int = 0
    pending_hits: int = 0
    evictions: int = 0


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
    own sets instead of a Python loop per key) builds the set once.
    """
    if keys.__class__ is not list and keys.__class__ is not tuple:
        keys = as_keys(name, keys)
    return keys, key_set(name, keys)  # type: ignore[return-value]


def key_set(name: str, keys: object) -> set[Key]:
    """``set(keys)``, once ``keys`` has passed the checks of :func:`check_keys`; else raise as it says.

    Stores need the set anyway (all-or-nothing membership tests, the keys an
    eviction must spare), so building it doubles as the check: one C-level
    pass proves every key hashable and distinct.
    """
    if keys.__class__ is not list and keys.__class__ is not tuple:
        keys = as_keys(name, keys)
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


class BlockStore(abc.ABC):
    """A tier below the GPU, keyed by block hash; one implementation per medium.

    Invariants every implementation keeps:

    * ``num_used + num_free == capacity``; each slot is held by at most one key.
    * A pending entry is neither loadable nor evictable: its bytes are still
      being written, so a load would read garbage and an eviction would hand the
      slot to a second writer while the first copy still runs.
    * A pinned entry (``ref_cnt > 0``) is never evicted or removed: a copy is
      reading its slot.
    * A refused call (``None`` returned, or an error raised) changes nothing.

    Attributes:
        medium: The name copy engines know the medium by (``"CPU"``, ...).
    """

    medium: str

    @abc.abstractmethod
    def lookup(self, key: Key) -> LookupResult:
        """Whether ``key`` is ready, pending or absent (counted in :attr:`stats`)."""

    @abc.abstractmethod
    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` are ready; stops at the first that is not.

        A pending key ends the prefix: its bytes cannot be loaded yet.
        """

    @abc.abstractmethod
    def contains(self, key: Key) -> bool:
        """Whether ``key`` is resident, ready or pending, without counting a query."""

    def missing(self, keys: Sequence[Key]) -> list[int]:
        """Indexes of the ``keys`` that are not resident (not even pending), in order, without counting queries."""
        contains = self.contains
        return [i for i, key in enumerate(keys) if not contains(key)]

    @abc.abstractmethod
    def is_ready(self, key: Key) -> bool:
        """Whether ``key`` is resident and loadable, without counting a query."""

    @abc.abstractmethod
    def room_for(self, keys: Sequence[Key]) -> int:
        """How many absent keys a ``prepare_store(keys)`` could take now, protecting every key of ``keys``."""

    @abc.abstractmethod
    def prepare_load(self, keys: Sequence[Key]) -> LoadStoreSpec:
        """Pin every key (ref +1) for a copy out of the store; return their slots.

        Every key must be ready.  Pins keep the slots from being evicted or
        removed until :meth:`complete_load`.  Without a request, recency is
        not changed here (call :meth:`touch`); the CPU store's request-scoped
        form counts it as that request's use, as vLLM 0.33 does.

        Raises:
            BlockStateError: A key is absent or pending; nothing is pinned.
        """

    @abc.abstractmethod
    def touch(self, keys: Sequence[Key]) -> None:
        """Record a use of ``keys``; unknown keys are ignored.

        Keys are walked in reverse, so the *first* key ends most recent.  The
        keys of one request form a prefix chain, and a later block is useless
        without every block before it: evicting from the tail of a chain first
        keeps the longest loadable prefix.
        """

    @abc.abstractmethod
    def complete_load(self, keys: Sequence[Key]) -> None:
        """Unpin every key (ref -1) once the copy that read it has finished.

        Raises:
            BlockStateError: A key is absent, pending or not pinned; nothing changes.
        """

    @abc.abstractmethod
    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        """Reserve a slot for each given key that is absent, evicting by policy if needed.

        Keys already present (pending or ready) are skipped and protected: the
        eviction never picks one of the given keys, because the caller is about
        to rely on them.  New entries are pending until :meth:`complete_store`.

        Returns:
            The keys to copy, their slots and what was evicted; or ``None`` if
            not enough entries are evictable, in which case nothing changed
            (nothing evicted, nothing reserved).
        """

    @abc.abstractmethod
    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """Finish stores: pending keys become ready, or with ``success=False`` are dropped.

        Keys that are not pending are ignored, as in vLLM.  That lets a caller
        pass the whole list it gave to :meth:`prepare_store`, including keys
        that were already present and so were never reserved; it also means a
        completion for a key this store never reserved is not reported.
        """

    @abc.abstractmethod
    def remove(self, keys: Sequence[Key]) -> None:
        """Drop ready, unpinned entries now (private blocks whose owner is done).

        Raises:
            BlockStateError: A key is absent, pending or pinned; nothing changes.
        """

    @abc.abstractmethod
    def take_events(self) -> list[StoreEvent]:
        """Return the queued events (oldest first) and start a new batch."""

    @property
    @abc.abstractmethod
    def num_blocks(self) -> int:
        """Slot ids in the medium, including the reserved id 0."""

    @property
    def capacity(self) -> int:
        """Blocks the store can hold: ``num_blocks - 1`` (slot 0 is reserved)."""
        return self.num_blocks - 1

    @property
    @abc.abstractmethod
    def num_used(self) -> int:
        """Slots held by an entry, pending or ready."""

    @property
    def num_free(self) -> int:
        """Slots held by no entry."""
        return self.capacity - self.num_used

    @property
    @abc.abstractmethod
    def num_pinned(self) -> int:
        """Entries with a load in flight (``ref_cnt > 0``)."""

    @property
    @abc.abstractmethod
    def num_pending(self) -> int:
        """Entries whose store is in flight."""

    @property
    @abc.abstractmethod
    def num_evictable(self) -> int:
        """Ready entries with no load in flight: what eviction may pick from."""

    @property
    def usage(self) -> float:
        """``num_used / capacity``: occupied slots, evictable ones included (0 for a store of no capacity)."""
        return self.num_used / self.capacity if self.capacity else 0.0

    @property
    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """Cumulative hit/query/eviction counters."""

    @abc.abstractmethod
    def entries(self) -> list[StoreEntry]:
        """Every resident entry, in the policy's order (LRU: least recent first)."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Assert the store's invariants (O(num_blocks); for tests and debugging)."""
