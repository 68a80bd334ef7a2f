"""The tiers below one manager's CPU tier, built together and shut down in order.

A driver (the engine, a user's own loop) builds a :class:`TierStack` from the
manager's CPU store and the CPU tier's tensor, then hands its chain and I/O
engines to :meth:`TierManager.attach_tiers <tiered_kv.manager.TierManager.attach_tiers>`.
The stack owns what it built: :meth:`TierStack.close` stops the I/O engines
first (they finish what is queued) and then releases the disk directory.
"""

from __future__ import annotations

import os
from typing import Any

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tiers.chain import DEMOTE_MODES, TierChain, TierPolicy
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.disk_io import FSYNC_POLICIES, DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.io_engine import BlockIOEngine
from tiered_kv.tiers.namespace import KVNamespace
from tiered_kv.tiers.redis_store import RedisStore


class TierStack:
    """CPU -> disk -> remote (either may be left out): stores, their chain and their I/O engines.

    Args:
        cpu_store: The manager's CPU store (the chain's tier 0).
        cpu_storage: The CPU tier's tensor (the staging area of every I/O engine).
        namespace: What the stored KV is compatible with (model, KV shape, hash scheme).
        disk_dir: Directory of the disk tier (``None``: no disk tier).
        disk_bytes: Bytes the disk tier may use.
        redis: A ``redis://`` URL or a client of the remote tier (``None``: no remote tier).
        remote_ttl_s: Seconds a block lives on the server after it is stored or last loaded.
        demote: Policy of every tier that has one below it: ``"write_back"``,
            ``"write_through"`` or ``"none"`` (the last tier demotes nothing).
        writeback_reserve: For write-back: least recent blocks kept held below (at most
            what the tier below holds).
        fsync: Durability of disk writes (see :mod:`~tiered_kv.tiers.disk_io`).

    Raises:
        InvalidArgumentError: a bad argument, or neither a disk nor a remote tier.
        StorageError: the disk directory cannot be used (unwritable, or in use).
        MissingDependencyError: a remote tier without the ``redis`` package.
        Whatever fails, nothing stays open.
    """

    def __init__(
        self,
        cpu_store: CPUStore,
        cpu_storage: KVStorage,
        namespace: KVNamespace,
        *,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 1 << 30,
        redis: Any = None,
        remote_ttl_s: float | None = None,
        demote: str = "write_back",
        writeback_reserve: int = 16,
        fsync: str = "none",
    ) -> None:
        checks.instance("cpu_store", cpu_store, CPUStore)
        checks.instance("cpu_storage", cpu_storage, KVStorage)
        checks.instance("namespace", namespace, KVNamespace)
        if disk_dir is None and redis is None:
            raise InvalidArgumentError("a tier stack needs disk_dir= or redis= (or both)")
        if disk_dir is not None:
            checks.instance("disk_dir", disk_dir, (str, os.PathLike))
        checks.count("disk_bytes", disk_bytes, 1)
        checks.choice("demote", demote, DEMOTE_MODES)
        checks.count("writeback_reserve", writeback_reserve)
        checks.choice("fsync", fsync, FSYNC_POLICIES)
        if cpu_storage.num_blocks != cpu_store.num_blocks or cpu_storage.spec != namespace.spec:
            raise InvalidArgumentError(
                f"the CPU tier's tensor ({cpu_storage.num_blocks} blocks of {cpu_storage.spec}) does not match its "
                f"store ({cpu_store.num_blocks} blocks) and the namespace's KV spec ({namespace.spec})"
            )
        self.disk: DiskStore | None = None
        self.remote: RedisStore | None = None
        self.engines: dict[str, BlockIOEngine] = {}
        try:
            if redis is not None:  # first: it checks its arguments and connects lazily, so a refusal creates no files
                from tiered_kv.tiers.redis_io import RedisIO

                self.remote = RedisStore(redis, namespace, ttl_s=remote_ttl_s)
            if disk_dir is not None:
                self.disk = DiskStore(disk_dir, namespace, disk_bytes)
                self.engines[self.disk.medium] = DiskIO(cpu_storage, self.disk, fsync=fsync)
            if self.remote is not None:
                self.engines[self.remote.medium] = RedisIO(cpu_storage, self.remote)
        except BaseException:
            self.close()
            raise
        stores = [cpu_store, *(s for s in (self.disk, self.remote) if s is not None)]
        # A reserve larger than the tier below would evict there what it just wrote: cap it.
        policies = [TierPolicy(demote, min(writeback_reserve, below.capacity)) for below in stores[1:]]
        policies.append(TierPolicy("none"))
        self.chain = TierChain(list(zip(stores, policies, strict=True)))

    def close(self) -> None:
        """Stop the I/O engines (queued plans finish first), then release the disk directory."""
        for engine in self.engines.values():
            engine.close()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TierStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
