"""The CPU store as a prefix cache: stores of cached GPU blocks, and loads of prefix hits.

* **Write-through**: a request's full prompt blocks are stored once computed.
* **On-evict**: the cached blocks nearest eviction (the front of the GPU free
  queue) are stored before an allocation can take them.  Each is held while
  copied, so no allocation can hand it out mid-copy, and is given back in
  place, so holding it does not change the eviction order.
* **Onboarding**: a new request's prefix found on the CPU is loaded into fresh
  GPU blocks; the request runs once the load lands.

A store copy holds the GPU blocks it reads; a load pins the store blocks it
reads.  Either way nothing a copy touches changes hands until it settles.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.manager.transfers import Transfer, Transfers
from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import CPU, GPU, PlanKind


@dataclass(slots=True)
class _Load:
    keys: list[Key]
    upto_tokens: int  # the request's KV is whole up to here once the load lands


class Offloader:
    """Stores of GPU blocks to the store, and loads of prefix hits from it."""

    def __init__(
        self,
        gpu: KVCacheManager,
        store: CPUStore,
        transfers: Transfers,
        contexts: Mapping[Hashable, RequestContext] | None = None,
    ) -> None:
        self.gpu = gpu
        #: The store's context of each open request (the manager's); stores and loads of a request are its uses.
        self.contexts: Mapping[Hashable, RequestContext] = contexts if contexts is not None else {}
        self.store = store
        self.transfers = transfers

    def _store(
        self, blocks: list[KVCacheBlock], keys: list[Key], rid: object, in_place: bool, num_layers: int = 0
    ) -> Transfer | None:
        ctx = self.contexts.get(rid) if rid is not None else None
        prep = self.store.prepare_store(keys, ctx) if ctx is not None else self.store.prepare_store(keys)
        if prep is None or not prep.keys_to_store:  # no room, or nothing absent
            return None
        by_key = dict(zip(keys, blocks, strict=True))
        src = [by_key[k] for k in prep.keys_to_store]
        ids = [b.block_id for b in src]
        plan = self.transfers.plan(
            GPU, CPU, ids, prep.store_spec.block_ids, PlanKind.OFFLOAD, rid, num_layers=num_layers, gated=num_layers > 0
        )
        return self.transfers.start(plan, gpu_holds=src, in_place=in_place, payload=list(prep.keys_to_store))

    def write_through(self, request: Request, start: int, end: int, gated_layers: int = 0) -> Transfer | None:
        """Store full blocks ``[start, end)`` of a running request.

        Their KV is final and written; or, with ``gated_layers``, it is being
        written by the step about to run, and the copy of each layer waits
        for compute to open it (a layer-wise store of a prefill).
        """
        if len(request.block_hashes) < end:
            self.gpu.hasher.update(request)
        table = self.gpu.get_blocks(request.request_id)
        keys: list[Hashable] = list(request.block_hashes[start:end])
        ctx = self.contexts.get(request.request_id)
        bs = self.gpu.block_size
        # Positions are set over [0, n) at admission and then over contiguous ranges from there on, so a
        # last key already at its end token means every key is: setting them again changes nothing (half
        # of bench_manager.py's 1,014 set_positions calls were such).
        if ctx is not None and keys and ctx.position(keys[-1]) != end * bs:
            ctx.set_positions(keys, (start + 1) * bs, bs)
        return self._store(list(table[start:end]), keys, request.request_id, False, gated_layers)

    def save_window(self, window: int) -> Transfer | None:
        """Store the cached blocks among the first ``window`` of the GPU free queue that the store lacks.

        Stores take the store's least valuable blocks; never those holding the
        window's own blocks, or the next top-up would store them again and the
        two would chase each other forever.  So every key of the window is
        protected, and only as many new ones are stored as fit without them.
        """
        store = self.store
        by_key: dict[Key, KVCacheBlock] = {}  # the first block of each hash, in queue order
        for b in self.gpu.block_pool.peek_free_blocks(window):
            if b.block_hash is not None:
                by_key.setdefault(b.block_hash, b)
        keys, blocks = list(by_key), list(by_key.values())
        absent = [i for i, k in enumerate(keys) if not store.contains(k)]
        if not absent:
            return None
        room = store.room_for(keys)
        take = set(absent[:room])
        if not take:
            return None
        # Present keys ride along only to be protected; prepare_store skips them.
        order = [i for i in range(len(keys)) if i in take or i not in absent]
        return self._store([blocks[i] for i in order], [keys[i] for i in order], None, True)

    def cpu_hits(self, request: Request, start: int) -> list[Key]:
        """Keys of the request's prefix blocks found ready in the store, from block ``start`` on.

        The last prompt token is always computed (its logits are needed), so
        its block is never a hit, as on the GPU.
        """
        last = (request.num_tokens - 1) // self.gpu.block_size
        rest = request.block_hashes[start:last]
        return list(rest[: self.store.lookup_prefix(rest)])

    def start_load(self, request: Request, keys: list[Key], dst: list[KVCacheBlock], upto_tokens: int) -> Transfer:
        """Pin prefix hits in the store and copy them into ``dst``, the request's fresh GPU blocks."""
        ctx = self.contexts.get(request.request_id)
        if ctx is not None:
            spec = self.store.prepare_load(keys, ctx)  # a use of the request, as in vLLM 0.33 (no touch)
        else:
            spec = self.store.prepare_load(keys)
            self.store.touch(keys)
        plan = self.transfers.plan(
            CPU, GPU, spec.block_ids, [b.block_id for b in dst], PlanKind.ONBOARD, request.request_id, True
        )
        return self.transfers.start(plan, payload=_Load(list(keys), upto_tokens))

    def settle_load(self, request: Request, t: Transfer) -> int:
        """Unpin; on success cache the loaded blocks and return the tokens loaded, else return 0.

        A failed load leaves the request's GPU table to the caller to free: its
        fresh blocks were never cached, so nobody can have read them.
        """
        job: _Load = t.payload
        self.store.complete_load(job.keys)
        if not t.ok:
            return 0
        self.gpu.cache_blocks(request, job.upto_tokens)
        return len(job.keys) * self.gpu.block_size

    def settle_store(self, t: Transfer) -> list[KVCacheBlock]:
        """Commit or drop a finished store, then give back the GPU blocks it held; return them."""
        keys: list[Key] = t.payload  # the keys the store reserved
        self.store.complete_store(keys, t.ok)
        return self.transfers.release(t)
