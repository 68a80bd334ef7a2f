"""tiered_kv's disk tier under vLLM's CPU tier.

Configured as ``{"type": "DiskTier", "module_path": "tiered_kv.integrations.vllm", "root": ..., ...}``.

One file per chunk under ``<root>/<namespace>/``, written to a temporary name
and renamed once whole, framed with the namespace, the key and a CRC-32
(:mod:`tiered_kv.tiers.disk_store`, :mod:`tiered_kv.tiers.disk_io`).  So a
crash never leaves a half-written chunk under a chunk's name, a restart
re-indexes the files that check and ignores the rest, and a full disk or a
corrupt file ends as a miss: nothing wrong reaches vLLM's primary tier.
"""

from __future__ import annotations

from typing import Any

from tiered_kv.integrations.vllm.store_tier import StoreTier
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_engine import BlockIOEngine, FaultHook
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import KVNamespace


class DiskTier(StoreTier):
    """vLLM secondary tier over a :class:`DiskStore`.

    Tier config keys (besides ``type`` and ``module_path``), passed by vLLM's tier factory:

    Args:
        root: Directory holding one subdirectory per namespace (required).
        capacity_bytes: Disk bytes the tier may use (required; a chunk file takes its
            payload plus header rounded up to 4 KiB).
        fsync: ``"none"``, ``"data"`` or ``"full"`` (:mod:`tiered_kv.tiers.disk_io`).
        load_workers, store_workers: Threads of the I/O engine.
        model, hash_scheme, layout, policy: As :class:`StoreTier`.
        fault_hook: Fault injection for tests (:data:`FaultHook`).
    """

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        root: str,
        capacity_bytes: int,
        fsync: str = "none",
        load_workers: int = 4,
        store_workers: int = 2,
        fault_hook: FaultHook | None = None,
        **namespace: Any,
    ) -> None:
        self._root, self._capacity = root, capacity_bytes
        self._io_args = dict(fsync=fsync, load_workers=load_workers, store_workers=store_workers, fault_hook=fault_hook)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **namespace)

    def _open(self, namespace: KVNamespace, buffer: ChunkBuffer, policy: str) -> tuple[KeyedStore, BlockIOEngine]:
        store = DiskStore(self._root, namespace, self._capacity, policy=policy)
        try:
            return store, DiskIO(buffer, store, **self._io_args)
        except BaseException:
            store.close()
            raise

    def shutdown(self) -> None:
        super().shutdown()
        self.store.close()
