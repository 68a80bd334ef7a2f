"""Moves blocks between the CPU tier and a Redis server, one pipeline per batch.

A store batch takes two round trips: claims and existence checks for every
block, then one ``SET NX`` per block it may write (with the TTL) and the
release of its claims; see :mod:`tiered_kv.tiers.redis_store` for why that
stores each block once and never publishes part of one.  A load batch is one
round trip of ``GET`` (``GETEX`` with the TTL, which keeps a block that is
being used alive); each value's header and CRC are checked before a byte of it
reaches the CPU slot.

A batch that meets a server error (refused connection, timeout) fails as a
whole with ``ERROR`` and trips the breaker, so the batches after it fail fast
instead of each waiting for a timeout.  Nothing is lost: a failed store leaves
the block in the CPU tier, a failed load leaves it on the server, and either
may be tried again.  A ``SET`` that the server applied before the connection
broke published a whole block, which a later lookup finds.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from tiered_kv import checks
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.tiers.block_format import BlockHeader, FormatError, payload_crc
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.io_engine import BlockIOEngine, FaultHook, Job, check_geometry
from tiered_kv.tiers.io_handle import BlockOutcome
from tiered_kv.tiers.redis_store import RedisStore


class RedisIO(BlockIOEngine):
    """The I/O engine of a :class:`RedisStore`.

    Args:
        host: The CPU tier's storage, or a raw buffer of chunks (see :class:`BlockIOEngine`).
        store: The remote store (client, key names, TTL, breaker).
        load_workers, store_workers, batch_blocks, fault_hook: As :class:`BlockIOEngine`;
            a batch is one pipeline.  The fault hook runs for each block before its
            batch reaches the server.
    """

    def __init__(
        self,
        host: KVStorage | ChunkBuffer | memoryview | Any,
        store: RedisStore,
        load_workers: int = 4,
        store_workers: int = 2,
        batch_blocks: int = 16,
        fault_hook: FaultHook | None = None,
    ) -> None:
        checks.instance("store", store, RedisStore)
        check_geometry(host, store.namespace, "remote")
        super().__init__(host, store, load_workers, store_workers, batch_blocks, fault_hook)
        self._remote = store
        self._client = store.client
        self._health = store.health
        self._errors = store.server_errors
        self._ns = store.namespace.digest
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------ stores
    def _store_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        for job in batch:
            self._fault("store", job.key)
        if not self._health.available():
            return [BlockOutcome.ERROR] * len(batch)
        store = self._remote
        outcomes = [BlockOutcome.ERROR] * len(batch)
        try:
            pipe = self._client.pipeline(transaction=False)
            for job in batch:
                pipe.set(store.claim_key(job.key), self.owner, nx=True, px=store.claim_ttl_ms)
                pipe.exists(store.data_key(job.key))
            replies = pipe.execute()
            pipe = self._client.pipeline(transaction=False)
            set_at: dict[int, int] = {}  # batch position -> position of its SET's reply
            commands = 0
            for i, job in enumerate(batch):
                claimed, exists = bool(replies[2 * i]), bool(replies[2 * i + 1])
                if exists:  # stored by someone already: nothing to send but housekeeping
                    outcomes[i] = BlockOutcome.PRESENT
                    if store.ttl_ms is not None:
                        pipe.pexpire(store.data_key(job.key), store.ttl_ms)
                        commands += 1
                    if claimed:
                        pipe.delete(store.claim_key(job.key))
                        commands += 1
                elif not claimed:
                    outcomes[i] = BlockOutcome.BUSY
                else:
                    set_at[i] = commands
                    pipe.set(store.data_key(job.key), self._blob(job), nx=True, px=store.ttl_ms)
                    pipe.delete(store.claim_key(job.key))
                    commands += 2
            replies = pipe.execute() if commands else []
        except self._errors as exc:
            self._health.failure(exc)
            return [BlockOutcome.ERROR] * len(batch)
        self._health.success()
        for i, at in set_at.items():
            # SET NX refused: another writer published it after our check (its claim had expired).
            outcomes[i] = BlockOutcome.OK if replies[at] else BlockOutcome.PRESENT
        return outcomes

    def _blob(self, job: Job) -> bytearray:
        segments = self.host.segments(job.host_block)
        header = BlockHeader.encode(self._ns, job.key, self.host.block_bytes, payload_crc(segments))
        blob = bytearray(len(header) + self.host.block_bytes)
        blob[: len(header)] = header
        pos = len(header)
        for seg in segments:
            blob[pos : pos + len(seg)] = seg
            pos += len(seg)
        return blob

    # ------------------------------------------------------------ loads
    def _load_batch(self, batch: list[Job]) -> list[BlockOutcome]:
        for job in batch:
            self._fault("load", job.key)
        if not self._health.available():
            return [BlockOutcome.ERROR] * len(batch)
        store = self._remote
        try:
            pipe = self._client.pipeline(transaction=False)
            for job in batch:
                if store.ttl_ms is None:
                    pipe.get(store.data_key(job.key))
                else:
                    pipe.getex(store.data_key(job.key), px=store.ttl_ms)
            values = pipe.execute()
        except self._errors as exc:
            self._health.failure(exc)
            return [BlockOutcome.ERROR] * len(batch)
        self._health.success()
        return [self._land(job, value) for job, value in zip(batch, values, strict=True)]

    def _land(self, job: Job, value: bytes | None) -> BlockOutcome:
        if value is None:
            return BlockOutcome.MISSING
        view = memoryview(value)
        try:
            header = BlockHeader.decode(view, self._ns, job.key, self.host.block_bytes)
        except FormatError:
            return BlockOutcome.CORRUPT
        payload = view[header.size :]
        if len(payload) != header.payload_bytes or payload_crc([payload]) != header.payload_crc:
            return BlockOutcome.CORRUPT
        pos = 0
        for seg in self.host.segments(job.host_block):
            seg[:] = payload[pos : pos + len(seg)]
            pos += len(seg)
        return BlockOutcome.OK
