"""The records a store exchanges with its callers: keys, lookup answers, slots, events, entries, counters.

Plain data only.  The store protocol itself, its invariants and the life of an
entry are documented with the one class that implements it,
:class:`~tiered_kv.tiers.cpu_store.CPUStore` (the disk and remote stores
subclass it).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class StoreEntry:
    """One resident entry, as :meth:`~tiered_kv.tiers.cpu_store.CPUStore.entries` reports it.

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
