"""A CPU offloading store written in the structure of vLLM's ``CPUOffloadingManager`` + LRU policy.

This is *our* re-implementation of the structure, used as the speed anchor of
``bench_store.py``; it is not vLLM.  What it reproduces, because it is what a
call costs there:

* a manager that owns slot hand-out (never-used ids ascending, then a stack of
  freed ids), the evictable-block counter and its early refusal, the lookup
  counters, and events; and that asks a separate policy object for every
  per-key fact (``policy.get(key)`` per key, ``policy.insert`` per new block,
  ``mark_evictable`` / ``mark_non_evictable`` hooks on every ref-count edge);
* one status record per block (``ref_cnt``, ``block_id``; ``ref_cnt == -1``
  while the store is in flight) with an ``is_ready`` property;
* an LRU policy that is one ``OrderedDict`` of key -> status, least recent
  first; ``touch`` walks a copied list of the keys in reverse; ``evict`` scans
  from the front for ``ref_cnt == 0`` keys outside the protected set, gathers
  ``(key, status)`` pairs, and deletes them only once it has all of them;
* a request context argument on every call, and an ``on_request_finished``
  hook that the manager forwards to the policy (a no-op for LRU).

Where vLLM's own structure is slower than this one, this one takes the faster
road, so the ratio against it is, if anything, an under-estimate:

* the status record is a slotted dataclass by default; vLLM's is a
  ``ctypes.Structure``, whose construction and field access cost more
  (``status_cls=CBlockStatus`` selects a record in that shape);
* the load/store spec wraps a plain list of ids; vLLM's converts it to a NumPy
  array;
* the access-count tracker for store thresholds (off by default in vLLM) and
  the per-session policy hooks of newer releases are left out.

Slot ids start at 0 here; ``tiered_kv``'s store reserves slot 0 and starts at
1, so a replay compares ids shifted by one.
"""

from __future__ import annotations

import ctypes
import enum
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field


class VLookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


@dataclass
class ReqContext:
    """Per-request context passed on every call (only the id is used by LRU)."""

    req_id: str
    kv_transfer_params: dict | None = None
    _state: dict = field(default_factory=dict, repr=False)


@dataclass(slots=True)
class BlockStatus:
    """One offloaded block: its slot and how many loads read it (-1: store still in flight)."""

    block_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class CBlockStatus(ctypes.Structure):
    """The same record as a C structure, the way vLLM declares it (``--status ctypes``)."""

    _fields_ = [("ref_cnt", ctypes.c_int32), ("block_id", ctypes.c_int64)]

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.ref_cnt = -1
        self.block_id = block_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class VCPULoadStoreSpec:
    """Slot ids of a load or store in CPU memory."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass
class VPrepareStoreOutput:
    keys_to_store: list
    store_spec: VCPULoadStoreSpec
    evicted_keys: list


@dataclass
class VOffloadingEvent:
    keys: list
    medium: str
    removed: bool


class VCachePolicy:
    """Block organisation and victim choice; the manager keeps ref counts and slots."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    def get(self, key: object) -> BlockStatus | None:
        raise NotImplementedError

    def insert(self, key: object, block: BlockStatus) -> None:
        raise NotImplementedError

    def remove(self, key: object) -> None:
        raise NotImplementedError

    def touch(self, keys: Iterable, req_context: ReqContext) -> None:
        raise NotImplementedError

    def evict(self, n: int, protected: set) -> list[tuple[object, BlockStatus]] | None:
        raise NotImplementedError

    def mark_evictable(self, key: object) -> None:
        return

    def mark_non_evictable(self, key: object) -> None:
        return

    def on_request_finished(self, req_context: ReqContext) -> None:
        return


class VLRUPolicy(VCachePolicy):
    """Least recently used first, in one ordered dict of key -> status."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: OrderedDict[object, BlockStatus] = OrderedDict()

    def get(self, key: object) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: object, block: BlockStatus) -> None:
        self.blocks[key] = block

    def remove(self, key: object) -> None:
        del self.blocks[key]

    def touch(self, keys: Iterable, req_context: ReqContext) -> None:
        # Reverse walk: the first key of a chain ends most recent.
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def evict(self, n: int, protected: set) -> list[tuple[object, BlockStatus]] | None:
        if n == 0:
            return []
        picked: list[tuple[object, BlockStatus]] = []
        for key, block in self.blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                picked.append((key, block))
                if len(picked) == n:
                    break
        if len(picked) < n:
            return None
        for key, _ in picked:
            del self.blocks[key]
        return picked


class VCPUStoreManager:
    """The manager: slot pool, ref counts, counters and events around a policy."""

    def __init__(self, num_blocks: int, enable_events: bool = False, status_cls: type = BlockStatus) -> None:
        self.medium = VCPULoadStoreSpec.medium()
        self._num_blocks = num_blocks
        self._num_allocated_blocks = 0
        self._free_list: list[int] = []
        self._status_cls = status_cls
        self.events: list[VOffloadingEvent] | None = [] if enable_events else None
        self._policy: VCachePolicy = VLRUPolicy(cache_capacity=num_blocks)
        self._num_evictable_cache_blocks = 0
        self._num_write_pending_blocks = 0
        self.allocation_sizes_in_current_batch: list[int] = []
        self._lookups_delta = 0
        self._hits_delta = 0
        self._misses_delta = 0
        self._evictions_delta = 0

    # --- slot pool
    def _get_num_free_blocks(self) -> int:
        return len(self._free_list) + self._num_blocks - self._num_allocated_blocks

    def _allocate_blocks(self, keys: list) -> list[BlockStatus]:
        num_fresh = min(len(keys), self._num_blocks - self._num_allocated_blocks)
        num_reused = len(keys) - num_fresh
        assert len(self._free_list) >= num_reused
        blocks = []
        for _ in range(num_fresh):
            blocks.append(self._status_cls(self._num_allocated_blocks))
            self._num_allocated_blocks += 1
        for _ in range(num_reused):
            blocks.append(self._status_cls(self._free_list.pop()))
        return blocks

    def _free_block(self, block: BlockStatus) -> None:
        self._free_list.append(block.block_id)

    def _get_load_store_spec(self, keys: Iterable, blocks: Iterable[BlockStatus]) -> VCPULoadStoreSpec:
        return VCPULoadStoreSpec([block.block_id for block in blocks])

    # --- the manager's verbs
    def lookup(self, key: object, req_context: ReqContext) -> VLookupResult:
        block = self._policy.get(key)
        if block is None:
            result = VLookupResult.MISS
        elif not block.is_ready:
            result = VLookupResult.HIT_PENDING
        else:
            result = VLookupResult.HIT
        if result == VLookupResult.MISS:
            self._lookups_delta += 1
            self._misses_delta += 1
        elif result in (VLookupResult.HIT, VLookupResult.HIT_PENDING):
            self._lookups_delta += 1
            self._hits_delta += 1
        return result

    def prepare_load(self, keys: Collection, req_context: ReqContext) -> VCPULoadStoreSpec:
        blocks = []
        for key in keys:
            block = self._policy.get(key)
            assert block is not None, f"{key!r} is not offloaded"
            assert block.is_ready, f"{key!r} is still being written"
            if block.ref_cnt == 0:
                self._policy.mark_non_evictable(key)
                self._num_evictable_cache_blocks -= 1
                assert self._num_evictable_cache_blocks >= 0
            block.ref_cnt += 1
            blocks.append(block)
        return self._get_load_store_spec(keys, blocks)

    def touch(self, keys: Collection, req_context: ReqContext) -> None:
        self._policy.touch(keys, req_context)

    def complete_load(self, keys: Collection, req_context: ReqContext) -> None:
        for key in keys:
            block = self._policy.get(key)
            assert block is not None, f"{key!r} is not offloaded"
            assert block.ref_cnt > 0, f"{key!r} is not being loaded"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._num_evictable_cache_blocks += 1
                self._policy.mark_evictable(key)

    def prepare_store(self, keys: Collection, req_context: ReqContext) -> VPrepareStoreOutput | None:
        keys_list = list(keys)
        keys_to_store = [k for k in keys_list if self._policy.get(k) is None]
        if not keys_to_store:
            return VPrepareStoreOutput(keys_to_store=[], store_spec=self._get_load_store_spec([], []), evicted_keys=[])
        self.allocation_sizes_in_current_batch.append(len(keys_to_store))
        num_to_evict = len(keys_to_store) - self._get_num_free_blocks()
        to_evict: list = []
        if num_to_evict > 0:
            if num_to_evict > self._num_evictable_cache_blocks:
                return None
            # Keys given in this call stay: the caller is about to rely on them.
            protected = set(keys_list)
            evicted = self._policy.evict(num_to_evict, protected)
            if evicted is None:
                return None
            self._evictions_delta += len(evicted)
            self._num_evictable_cache_blocks -= len(evicted)
            assert self._num_evictable_cache_blocks >= 0
            for key, block in evicted:
                self._free_block(block)
                to_evict.append(key)
        if to_evict and self.events is not None:
            self.events.append(VOffloadingEvent(keys=to_evict, medium=self.medium, removed=True))
        blocks = self._allocate_blocks(keys_to_store)
        assert len(blocks) == len(keys_to_store), "slot pool handed out the wrong number of slots"
        for key, block in zip(keys_to_store, blocks, strict=False):
            self._policy.insert(key, block)
        self._num_write_pending_blocks += len(keys_to_store)
        store_spec = self._get_load_store_spec(keys_to_store, blocks)
        return VPrepareStoreOutput(keys_to_store=keys_to_store, store_spec=store_spec, evicted_keys=to_evict)

    def complete_store(self, keys: Collection, req_context: ReqContext, success: bool = True) -> None:
        stored: list = []
        if success:
            for key in keys:
                block = self._policy.get(key)
                if block is not None and not block.is_ready:
                    block.ref_cnt = 0
                    self._num_write_pending_blocks -= 1
                    self._num_evictable_cache_blocks += 1
                    self._policy.mark_evictable(key)
                    stored.append(key)
        else:
            for key in keys:
                block = self._policy.get(key)
                if block is not None and not block.is_ready:
                    self._num_write_pending_blocks -= 1
                    self._policy.remove(key)
                    self._free_block(block)
        if stored and self.events is not None:
            self.events.append(VOffloadingEvent(keys=stored, medium=self.medium, removed=False))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._policy.on_request_finished(req_context)

    def take_events(self) -> Iterator[VOffloadingEvent]:
        if self.events is not None:
            yield from self.events
            self.events.clear()

    # --- for the benchmark's checks only
    def resident(self) -> list[tuple[object, int, int]]:
        """(key, slot, ref_cnt) of every resident block, least recent first."""
        blocks = self._policy.blocks  # type: ignore[attr-defined]
        return [(key, block.block_id, block.ref_cnt) for key, block in blocks.items()]
