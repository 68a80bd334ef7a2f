"""Swap at preemption through vLLM 0.33's offloading connector: ``TieredKVConnector``.

vLLM recomputes every preempted request; its ``OffloadingConnector`` stores
prompt blocks as they complete and, at a preemption, only flushes the
victim's stores already in flight.  This connector is that connector (its
scheduler and worker sides are vLLM's, extended, not copied) plus what a swap
needs, driven by the scheduler class (:mod:`.scheduler`), which decides per
victim:

* **Store at preemption.**  :meth:`TieredKVConnectorScheduler.store_at_preemption`
  runs before vLLM frees the victim's GPU blocks.  It offers the victim's
  computed full chunks to the CPU tier; the ones the tier lacks become one
  store job, and the job goes into the step's ``jobs_to_flush``: vLLM's worker
  submits and waits for those in ``handle_preemptions`` before the step's
  forward pass, so no block the job reads is written by anyone before it is
  read.  The job's source blocks are also fenced (``_block_id_to_pending_jobs``),
  so a later step that hands one of them out flushes the job again if it has
  still not been reported.  A partial last block has no key in vLLM 0.33 for
  an attention model (its connector stores a partial tail only for recurrent
  state), so it is recomputed after a swap, as vLLM recomputes it after a
  prefix hit.
* **While the store is in flight** its keys answer ``MISS`` to every lookup
  (:meth:`~.manager.TieredKVOffloadingManager.hide`): a victim scheduled again
  before its store is reported, or after it failed or was cancelled, recomputes
  what has not landed, and never loads a chunk that was not written whole.
  vLLM's own connector would defer the request until the job completes.
* **Until the victim resumes** the chunks of its swapped KV are pinned in the
  CPU tier (tiered_kv's store counts loads per key), so capacity eviction does
  not drop them; the pins go when the victim is scheduled again (its load then
  holds what it reads), finishes, or the cache is reset.
* **Resume** is vLLM's own path: the victim's ``num_computed_tokens`` is 0, so
  the scheduler looks its prefix up on the GPU, then through the connector in
  the CPU tier, and loads what it finds.
* **Failures.**  vLLM 0.33's worker side asserts that every transfer succeeded.
  :class:`TieredKVConnectorWorker` reports a failed job instead
  (:class:`TieredKVWorkerMetadata`): a failed store drops its keys
  (``complete_store(success=False)``); a failed load reports its GPU blocks as
  invalid (vLLM's ``invalid_block_ids``), and vLLM's scheduler recomputes from
  the first one (``kv_load_failure_policy`` ``"recompute"``, vLLM's default).

The connector needs tiered_kv's spec (:class:`~.spec.TieredKVOffloadingSpec`):
the quote and the pins need its CPU store.  One KV cache group of full
attention is supported for swaps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
    TransferJobStatus,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadKey
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.vllm.manager import TieredKVOffloadingManager
from tiered_kv.integrations.vllm.preemption_stats import PreemptionCounters
from tiered_kv.manager.pricing import CostModel, Quote, price


@dataclass
class TieredKVWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata plus the jobs a worker reported failed (``{job_id: count}``)."""

    failed_jobs: dict[int, int] = field(default_factory=dict)

    def mark_failed(self, job_id: int) -> None:
        self.failed_jobs[job_id] = 1

    def aggregate(self, other: Any) -> TieredKVWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = dict(self.failed_jobs)
        for job_id, n in getattr(other, "failed_jobs", {}).items():
            failed[job_id] = failed.get(job_id, 0) + n
        return TieredKVWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


@dataclass(frozen=True, slots=True)
class PreemptStore:
    """What a store at preemption did.

    Attributes:
        request_id: The victim.
        job_id: The store job (``None``: nothing to copy, the CPU tier held every chunk).
        num_chunks: Full chunks of computed KV the victim had (the swapped part).
        stored_keys: Keys the job writes (the chunks the CPU tier lacked).
        num_blocks: GPU blocks the job copies.
    """

    request_id: str
    job_id: int | None
    num_chunks: int
    stored_keys: tuple[OffloadKey, ...]
    num_blocks: int


def swap_supported(kv_cache_config: KVCacheConfig) -> str | None:
    """Why a swap at preemption is not supported for this KV cache layout, or ``None`` when it is."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"the model has {len(groups)} KV cache groups (a hybrid model); swaps support one"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        return f"its KV cache group is {type(spec).__name__}; swaps support full attention"
    return None


def _adopt(obj: Any, base: type, cls: type) -> Any:
    """Make vLLM's fully built ``obj`` an instance of its subclass ``cls`` (which only adds state).

    ``OffloadingConnector.__init__`` builds its scheduler and worker sides inline
    from a spec it does not keep; extending them in place keeps every line of
    vLLM's construction instead of a copy of it.
    """
    if type(obj) is not base:
        raise TypeError(f"expected vLLM's {base.__name__}, got {type(obj).__name__}")
    obj.__class__ = cls
    return obj


class TieredKVConnectorScheduler(OffloadingConnectorScheduler):
    """vLLM's offloading scheduler side, plus stores at preemption, pins until resume and failed jobs.

    Attributes:
        counters: Preemption counters, shared with the scheduler class, which adds
            the preemptions and the computed tokens; reported with vLLM's stats.
        manager: tiered_kv's CPU store behind vLLM's manager protocol.
    """

    manager: TieredKVOffloadingManager
    counters: PreemptionCounters

    @classmethod
    def adopt(cls, base: OffloadingConnectorScheduler) -> TieredKVConnectorScheduler:
        if not isinstance(base.manager, TieredKVOffloadingManager):
            raise ConfigError(
                "kv_connector TieredKVConnector needs tiered_kv's CPU store: set "
                '"spec_name": "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm" '
                f"in kv_connector_extra_config (the spec built {type(base.manager).__name__})"
            )
        self: TieredKVConnectorScheduler = _adopt(base, OffloadingConnectorScheduler, cls)
        self.counters = PreemptionCounters()
        self._reported = PreemptionCounters()
        self._preempt_jobs: dict[int, PreemptStore] = {}
        self._new_preempt_jobs: dict[int, TransferJob] = {}
        self._pinned: dict[str, list[OffloadKey]] = {}
        self._resume_loads: dict[int, int] = {}
        self._failed: set[int] = set()
        return self

    # ------------------------------------------------------------ facts for the quote
    def _computed_chunks(self, request: Request, num_computed_tokens: int) -> list[OffloadKey]:
        """Keys of the request's full chunks of computed KV, in order."""
        status = self._req_status.get(request.request_id)
        if status is None:
            return []
        status.update_offload_keys()
        group = self.config.kv_group_configs[0]
        keys = status.group_states[0].offload_keys
        return keys[: min(num_computed_tokens // group.tokens_per_chunk, len(keys))]

    def quote(self, request: Request, blocks: KVCacheBlocks, cost_model: CostModel) -> Quote:
        """Price preempting ``request`` now: its quote, from the same facts tiered_kv's manager gathers.

        The KV at stake is its computed tokens; a recompute frees the GPU
        blocks it alone holds; a swap copies the blocks of its full chunks the
        CPU tier lacks (present chunks, ready or being stored, are not copied
        again) and needs a CPU slot for each of those chunks.
        """
        table = blocks.blocks[0]
        n_tok = request.num_computed_tokens
        keys = self._computed_chunks(request, n_tok)
        store = self.manager.store
        missing = store.missing(keys)
        per_chunk = self.config.blocks_per_chunk
        moved = [table[i * per_chunk + b].block_id for i in missing for b in range(per_chunk)]
        freed = [b.block_id for b in table if b.ref_cnt == 1 and not b.is_null]
        room = store.room_for(keys) >= len(missing)
        return price(cost_model, request.request_id, n_tok, len(table), freed, moved, len(missing), room, True)

    # ------------------------------------------------------------ store at preemption
    def store_at_preemption(
        self, request: Request, num_computed_tokens: int, block_ids: Sequence[int]
    ) -> PreemptStore | None:
        """Store the victim's computed full chunks that the CPU tier lacks; ``None`` if it has no room.

        Called by the scheduler class before vLLM frees ``block_ids`` (the
        victim's table).  The job joins this step's metadata and its flush set.
        Chunks already ready on the CPU tier are pinned now; the stored ones
        when their job lands.  On ``None`` nothing changed.
        """
        self._acquire_step()
        rid = request.request_id
        keys = self._computed_chunks(request, num_computed_tokens)
        status = self._req_status.get(rid)
        if not keys or status is None:
            return PreemptStore(rid, None, 0, (), 0)
        store = self.manager.store
        ready = [k for k in keys if store.is_ready(k)]
        out = self.manager.prepare_store(keys, status.req_context)
        if out is None:
            return None
        if ready:
            store.prepare_load(ready)
            self._pinned.setdefault(rid, []).extend(ready)
        to_store = tuple(out.keys_to_store)
        if not to_store:
            return PreemptStore(rid, None, len(keys), (), 0)
        per_chunk = self.config.blocks_per_chunk
        index = {k: i for i, k in enumerate(keys)}
        src = [int(block_ids[index[k] * per_chunk + b]) for k in to_store for b in range(per_chunk)]
        job_id = self._generate_job_id()
        self._jobs[job_id] = TransferJobStatus(
            req_id=rid, pending_count=self.config.num_workers, keys=set(to_store), is_store=True, fenced_block_ids=src
        )
        for bid in src:
            self._block_id_to_pending_jobs.setdefault(bid, set()).add(job_id)
        spec = GPULoadStoreSpec(src, group_sizes=[len(src)], block_indices=[index[to_store[0]] * per_chunk])
        self._new_preempt_jobs[job_id] = TransferJob(req_id=rid, src_spec=spec, dst_spec=out.store_spec)
        done = PreemptStore(rid, job_id, len(keys), to_store, len(src))
        self._preempt_jobs[job_id] = done
        self.manager.hide(to_store)
        group = self.config.kv_group_configs[0]
        for k in to_store:
            self._events_tracker.record_store(request, group, index[k], k)
        return done

    def preempt_jobs_in_flight(self) -> dict[int, PreemptStore]:
        """Stores at preemption not reported yet (job id -> what it stores)."""
        return dict(self._preempt_jobs)

    def pinned_keys(self, request_id: str) -> list[OffloadKey]:
        """Chunks the CPU tier keeps pinned for a swapped victim until it resumes."""
        return list(self._pinned.get(request_id, ()))

    def _unpin(self, request_id: str) -> None:
        keys = self._pinned.pop(request_id, None)
        if keys:
            self.manager.store.complete_load(keys)

    # ------------------------------------------------------------ vLLM's hooks, extended
    def _build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        # A victim scheduled again holds what it loads through its own load job: its pins go.
        for rid in [r for r in self._pinned if not self._still_swapped(r)]:
            self._unpin(rid)
        meta = super()._build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        if self._new_preempt_jobs:
            meta.store_jobs.update(self._new_preempt_jobs)
            assert meta.jobs_to_flush is not None
            meta.jobs_to_flush.update(self._new_preempt_jobs)
            self._new_preempt_jobs = {}
        return meta

    def _still_swapped(self, request_id: str) -> bool:
        status = self._req_status.get(request_id)
        return status is not None and status.req.status == RequestStatus.PREEMPTED

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        before = set(self._current_batch_load_jobs)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if request.num_preemptions > 0:
            for job_id in set(self._current_batch_load_jobs) - before:
                dst = self._current_batch_load_jobs[job_id].dst_spec
                assert isinstance(dst, GPULoadStoreSpec)
                self._resume_loads[job_id] = len(dst.block_ids)

    def _update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadingWorkerMetadata):
            super()._update_connector_output(connector_output)
            return
        failed = getattr(meta, "failed_jobs", {})
        live = self._stale_job_threshold
        ours = {
            j
            for j in (*meta.completed_jobs, *failed)
            if j >= live and (j in self._preempt_jobs or j in self._failed or j in failed)
        }
        for job_id in sorted(ours):
            self._settle(job_id, meta.completed_jobs.get(job_id, 0), failed.get(job_id, 0))
        rest = OffloadingWorkerMetadata(
            completed_jobs={j: n for j, n in meta.completed_jobs.items() if j not in ours},
            transfer_stats=meta.transfer_stats,
        )
        super()._update_connector_output(dataclasses.replace(connector_output, kv_connector_worker_meta=rest))
        for job_id in [j for j in rest.completed_jobs if j in self._resume_loads and j not in self._jobs]:
            self.counters.blocks_loaded += self._resume_loads.pop(job_id)

    def _settle(self, job_id: int, num_ok: int, num_failed: int) -> None:
        """Count one job's worker reports; when every worker reported, commit it (or drop it if any failed).

        The same bookkeeping as vLLM's completion of a job, plus: a failed
        store drops its keys; a failed load only unpins (the worker reported
        its blocks invalid, and vLLM's scheduler recomputes them); a store at
        preemption that landed pins its chunks for the victim.
        """
        status = self._jobs.get(job_id)
        if status is None:
            return
        status.pending_count -= num_ok + num_failed
        if num_failed:
            self._failed.add(job_id)
        if status.pending_count > 0:
            return
        ok = job_id not in self._failed
        self._failed.discard(job_id)
        req_status = self._req_status.get(status.req_id)
        context = req_status.req_context if req_status is not None else None
        preempted = self._preempt_jobs.pop(job_id, None)
        keys = list(status.keys)
        if status.is_store:
            if preempted is not None:
                self.manager.unhide(keys)
            self.manager.complete_store(keys, context, success=ok)  # type: ignore[arg-type]
            if preempted is not None and ok:
                self.counters.blocks_stored += preempted.num_blocks
                if self._still_swapped(status.req_id):
                    self.manager.store.prepare_load(keys)
                    self._pinned.setdefault(status.req_id, []).extend(keys)
            elif not ok:
                self.counters.stores_failed += int(preempted is not None)
        else:
            self.manager.complete_load(keys, context)  # type: ignore[arg-type]
            if self._chunks_being_loaded:
                self._chunks_being_loaded.difference_update(keys)
            if not ok and self._resume_loads.pop(job_id, None) is not None:
                self.counters.loads_failed += 1
        if self._block_id_to_pending_jobs:
            self._remove_pending_job(job_id, status.fenced_block_ids)
            if req_status is not None and req_status.req.is_finished():
                self._remove_pending_job(job_id, status.deferred_fence_block_ids)
        del self._jobs[job_id]
        if req_status is not None:
            req_status.transfer_jobs.discard(job_id)
            if req_status.finished_signaled and not req_status.transfer_jobs:
                del self._req_status[status.req_id]

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._unpin(request.request_id)
        return super().request_finished(request)

    def _reset_cache(self) -> None:
        # The store forgets everything: pins first (a pinned key cannot be dropped), and the
        # stores at preemption in flight become vLLM's stale jobs, whose reports are ignored.
        for rid in list(self._pinned):
            self._unpin(rid)
        self.manager.unhide([k for job in self._preempt_jobs.values() for k in job.stored_keys])
        self._preempt_jobs.clear()
        self._failed.clear()
        self._resume_loads.clear()
        super()._reset_cache()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats()
        if self.counters != self._reported:
            if stats is None:
                stats = OffloadingConnectorStats()
            self.counters.report(stats, self._reported)
            self._reported = self.counters.copy()
        return stats


class TieredKVConnectorWorker(OffloadingConnectorWorker):
    """vLLM's offloading worker side, reporting failed jobs instead of asserting that none fails.

    A failed store is reported in :class:`TieredKVWorkerMetadata`; a failed load
    too, and its destination GPU blocks are returned by
    :meth:`take_load_errors` (vLLM's ``get_block_ids_with_load_errors``) while
    its request is reported received, so vLLM recomputes from the first block
    that did not load.
    """

    @classmethod
    def adopt(cls, base: OffloadingConnectorWorker) -> TieredKVConnectorWorker:
        self: TieredKVConnectorWorker = _adopt(base, OffloadingConnectorWorker, cls)
        self._connector_worker_meta = TieredKVWorkerMetadata()
        self._load_dst: dict[int, list[int]] = {}
        self._load_errors: set[int] = set()
        return self

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        for job_id, entry in metadata.load_jobs.items():
            assert isinstance(entry.dst_spec, GPULoadStoreSpec)
            self._load_dst[job_id] = [int(b) for b in entry.dst_spec.block_ids]
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        meta = self._connector_worker_meta
        assert isinstance(meta, TieredKVWorkerMetadata)
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            dst = self._load_dst.pop(job_id, None)
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
                meta.mark_completed(job_id)
            else:
                meta.mark_failed(job_id)
                if dst:
                    self._load_errors.update(dst)
            req_id = self._load_jobs.pop(job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def take_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed since the last call (vLLM's ``get_block_ids_with_load_errors``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> TieredKVWorkerMetadata | None:
        meta = self._connector_worker_meta
        assert isinstance(meta, TieredKVWorkerMetadata)
        if not meta.completed_jobs and not meta.failed_jobs:
            return None
        self._connector_worker_meta = TieredKVWorkerMetadata()
        return meta


class TieredKVConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` with tiered_kv's stores at preemption and failure reports.

    Configured with ``"kv_connector": "TieredKVConnector"``,
    ``"kv_connector_module_path": "tiered_kv.integrations.vllm"`` and tiered_kv's
    spec (``docs/integrations.md``); the scheduler class decides which victims it
    stores.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            self.connector_scheduler = TieredKVConnectorScheduler.adopt(self.connector_scheduler)
        if self.connector_worker is not None:
            self.connector_worker = TieredKVConnectorWorker.adopt(self.connector_worker)

    @property
    def preemption(self) -> TieredKVConnectorScheduler:
        """The scheduler side (the scheduler class stores victims through it)."""
        assert isinstance(self.connector_scheduler, TieredKVConnectorScheduler)
        return self.connector_scheduler

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        return worker.take_load_errors() if isinstance(worker, TieredKVConnectorWorker) else set()
