"""tiered_kv's remote tier under vLLM's CPU tier.

Configured as ``{"type": "RedisTier", "module_path": "tiered_kv.integrations.vllm", "url": ...}``.

Chunks live in a Redis (or Valkey) server that several vLLM instances share,
under keys prefixed by the namespace, each one value written by one ``SET``
(a reader sees all of a chunk or none) and checked by its CRC on every load
(:mod:`tiered_kv.tiers.redis_store`, :mod:`tiered_kv.tiers.redis_io`).

A lookup asks the server (one round trip) so that chunks another instance
stored are found.  Every call has a short socket timeout and passes a
breaker: a server that is down or slow answers "miss" (counted in
``store.remote_stats``) and never holds vLLM's scheduler longer than one
timeout per back-off period; stores and loads that meet it fail, and vLLM
keeps (or recomputes) the chunks.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import Locality
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiered_kv.integrations.vllm.store_tier import StoreTier
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.io_engine import BlockIOEngine, FaultHook
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.redis_io import RedisIO
from tiered_kv.tiers.redis_store import RedisStore, connect


class RedisTier(StoreTier):
    """vLLM secondary tier over a :class:`RedisStore`.

    Args:
        url: The server (``redis://host:port/db``, required).
        timeout_s: Socket timeout of every call (the longest a lookup can wait).
        index_blocks: Entries of the local index (:class:`RedisStore`).
        ttl_s: Seconds a chunk lives after it is stored or last loaded; ``None``: the server decides.
        load_workers, store_workers: Threads of the I/O engine.
        model, hash_scheme, layout, policy: As :class:`StoreTier`.
        fault_hook: Fault injection for tests (:data:`FaultHook`).
    """

    # A network store shared by instances: vLLM's tier filters see it as remote storage, its hits as external.
    default_locality = Locality.REMOTE
    cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        url: str,
        timeout_s: float = 0.5,
        index_blocks: int = 65536,
        ttl_s: float | None = None,
        load_workers: int = 4,
        store_workers: int = 2,
        fault_hook: FaultHook | None = None,
        **namespace: Any,
    ) -> None:
        self._url, self._timeout_s = url, timeout_s
        self._store_args = dict(index_blocks=index_blocks, ttl_s=ttl_s)
        self._io_args = dict(load_workers=load_workers, store_workers=store_workers, fault_hook=fault_hook)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **namespace)

    def _open(self, namespace: KVNamespace, buffer: ChunkBuffer, policy: str) -> tuple[KeyedStore, BlockIOEngine]:
        store = RedisStore(connect(self._url, self._timeout_s), namespace, policy=policy, **self._store_args)
        return store, RedisIO(buffer, store, **self._io_args)
