"""The tier manager's ownership audit (O(blocks); for tests and debugging).

Every reference on a GPU block is an entry of some request's block table or a
hold of a copy in flight, and every pin in the CPU store is a swapped request's
copy, a load in flight or a move of the tiers below the CPU: nothing else may own anything, so a block nobody
owns is free and a block somebody owns is never handed out.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.manager.transfers import Transfers
from tiered_kv.tiers.cpu_store import CPUStore as BlockStore
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import PlanKind


def check_ownership(
    gpu: KVCacheManager,
    store: BlockStore,
    transfers: Transfers,
    swapped: Mapping[Hashable, Sequence[Key] | None],
    other_pins: Mapping[Key, int] | None = None,
) -> None:
    """Assert that ref counts and pins are exactly their owners.

    Args:
        gpu: The GPU tables and pool.
        store: The CPU store (an empty one without a CPU tier).
        transfers: The copies in flight.
        swapped: Every request the manager holds, with the store keys of its
            swapped copy (``None`` while its KV is on the GPU).
    """
    pool = gpu.block_pool
    pool.check_invariants()
    owners = [0] * pool.num_blocks
    for rid, keys in swapped.items():
        table = gpu.get_blocks(rid)
        assert keys is None or not table or any(t.plan.request_id == rid for t in transfers), (
            f"{rid!r} is swapped out but holds a GPU table"
        )
        for b in table:
            owners[b.block_id] += 1
    for bid, n in transfers.gpu_hold_counts().items():
        owners[bid] += n
    for b in pool.blocks[1:]:
        assert b.ref_cnt == owners[b.block_id], f"GPU block {b.block_id}: {b.ref_cnt} refs, {owners[b.block_id]} owners"
    store.check_invariants()
    pins: dict[Key, int] = dict(other_pins or {})
    for keys in swapped.values():
        for k in keys or ():
            pins[k] = pins.get(k, 0) + 1
    for t in transfers:
        loading = getattr(t.payload, "keys", ()) if t.plan.kind is PlanKind.ONBOARD else ()
        for k in (*loading, *getattr(t.payload, "pinned", ())):
            pins[k] = pins.get(k, 0) + 1
    for e in store.entries():
        if e.ready:
            assert e.ref_cnt == pins.get(e.key, 0), f"store key {e.key!r}: {e.ref_cnt} pins, {pins.get(e.key)} owners"
