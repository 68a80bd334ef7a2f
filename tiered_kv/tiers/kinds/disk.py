"""The disk tier: a directory of block files (:class:`~tiered_kv.tiers.disk_store.DiskStore`) and its DiskIO."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tiered_kv import checks
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.link import TierLink
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.tier_kind import TierConfig, register_tier_kind

if TYPE_CHECKING:
    from tiered_kv.storage.kv_storage import KVStorage  # its module needs torch: configs alone do not


@register_tier_kind
@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig(TierConfig):
    """A disk tier in ``path``, using at most ``capacity_bytes``.

    Attributes:
        path: Its directory (made if missing; one store uses it at a time).
        capacity_bytes: Bytes its block files may use.
        fsync: Durability of its writes (see :mod:`~tiered_kv.tiers.disk_io`).
    """

    type: ClassVar[str] = "disk"
    medium: ClassVar[str] = "DISK"
    # A local NVMe disk.  2 GB/s: DiskIO loads of 2 MiB blocks measured here at 1.2-2.5 GB/s from
    # the virtio disk (bench_tiers.py, docs/benchmarks.md; PCIe 3.0 x4 NVMe datasheets give about
    # 3.5 GB/s sequential).  40 us a block: measured here, the fit of bench_tier_links.py (DiskIO,
    # 4 load threads: open, header check, preadv, CRC, close) gave 39.5-40.6 us.
    default_link: ClassVar[TierLink] = TierLink(bytes_per_s=2.0e9, block_latency_s=40e-6)

    path: str | os.PathLike[str]
    capacity_bytes: int = 1 << 30
    fsync: str = "none"

    def __post_init__(self) -> None:
        TierConfig.__post_init__(self)
        checks.instance("DiskTierConfig.path", self.path, (str, os.PathLike))
        checks.count("DiskTierConfig.capacity_bytes", self.capacity_bytes, 1)
        from tiered_kv.tiers.disk_io import FSYNC_POLICIES  # its module needs torch: configs alone do not

        checks.choice("DiskTierConfig.fsync", self.fsync, FSYNC_POLICIES)

    def build(self, namespace: KVNamespace, cpu_storage: KVStorage) -> tuple[CPUStore, Any]:
        from tiered_kv.tiers.disk_io import DiskIO

        store = DiskStore(self.path, namespace, self.capacity_bytes)
        try:
            return store, DiskIO(cpu_storage, store, fsync=self.fsync)
        except BaseException:
            store.close()
            raise
