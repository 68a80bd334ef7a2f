"""The remote tier: blocks as values on a Redis server (:class:`~tiered_kv.tiers.redis_store.RedisStore`).

Needs the optional ``redis`` package (``pip install 'tiered-kv[redis]'``) only
when one is built: the configuration alone imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.tier_kind import TierConfig, register_tier_kind

if TYPE_CHECKING:
    from tiered_kv.storage.kv_storage import KVStorage  # its module needs torch: configs alone do not


@register_tier_kind
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RedisTierConfig(TierConfig):
    """A remote tier on a Redis server.

    Attributes:
        server: A ``redis://`` URL, or a client (anything with ``pipeline``).
        ttl_s: Seconds a block lives on the server after it is stored or last
            loaded (``None``: the server's own eviction decides).
    """

    type: ClassVar[str] = "redis"
    medium: ClassVar[str] = "REMOTE"
    # A Redis server across a 10 GbE network: 1.25 GB/s line rate.  50 us a block: the fit of
    # bench_tier_links.py gave 41 us a block on localhost (16-block pipelines), to which a network
    # adds its round trip, shared by a pipeline.  The pure-Python client alone tops out near
    # 0.2 GB/s (measured here); give a measured TierLink where it is the bottleneck.
    default_link: ClassVar[TierLink] = TierLink(bytes_per_s=1.25e9, block_latency_s=50e-6)

    server: Any
    ttl_s: float | None = None

    def build(self, namespace: KVNamespace, cpu_storage: KVStorage) -> tuple[CPUStore, Any]:
        from tiered_kv.tiers.redis_io import RedisIO
        from tiered_kv.tiers.redis_store import RedisStore

        store = RedisStore(self.server, namespace, ttl_s=self.ttl_s)
        return store, RedisIO(cpu_storage, store)
