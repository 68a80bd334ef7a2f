"""A tiered_kv store below the CPU (disk, Redis) as a vLLM 0.33 ``SecondaryTierManager``.

vLLM's ``TieringOffloadingManager`` owns the CPU tier (the *primary*) and
cascades every chunk stored there to each secondary tier; a chunk a secondary
tier holds is promoted back into a primary slot before the GPU loads it.  The
secondary tier sees the primary only as ``primary_kv_view``, a two-dimensional
memoryview whose row ``c`` is chunk slot ``c``.

This class is that tier over a tiered_kv :class:`~tiered_kv.tiers.keyed_store.KeyedStore`
and its :class:`~tiered_kv.tiers.io_engine.BlockIOEngine`, staging through the
primary view (a :class:`~tiered_kv.tiers.chunk_buffer.ChunkBuffer`):

* ``submit_store`` / ``submit_load`` reserve in the store (``prepare_store``,
  ``prepare_load``) on the scheduler's thread and hand one plan to the I/O
  engine, whose worker threads read or write the primary rows; they return at once.
* ``get_finished_jobs`` commits finished plans in the store, block by block
  (what landed is stored; a load that found a block missing or corrupt makes
  the store forget it) and reports one ``JobResult`` per job.  A load that
  failed in part names its ``successful_keys``, so vLLM keeps exactly the
  chunks that arrived whole and checked.
* ``lookup`` asks the store: ``HIT`` for a ready block, ``RETRY`` while this
  tier's own store of it is in flight, else ``MISS``.

Invariants: every job vLLM submits is reported exactly once by
``get_finished_jobs``; a primary row is touched only by the I/O of the job
that names it, until that job is reported (vLLM pins those rows meanwhile);
nothing wrong is ever loaded: the engine checks each block's header and CRC
before reporting it landed, and a job whose block failed does not report it
among its successful keys.  The store is touched only on the caller's thread
(vLLM calls a tier under its manager lock), never from the I/O threads.
"""

from __future__ import annotations

import abc
import inspect
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiered_kv.errors import ConfigError, TieredKVError
from tiered_kv.integrations.vllm._vllm import VLLM_VERSION
from tiered_kv.integrations.vllm.extra_config import VLLM_TIERING_KEYS, check_keys
from tiered_kv.tiers.chunk_buffer import ChunkBuffer
from tiered_kv.tiers.io_engine import BlockIOEngine
from tiered_kv.tiers.io_handle import BlockIOHandle, BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import ChunkGeometry, KVNamespace
from tiered_kv.tiers.store import LookupResult as StoreLookup
from tiered_kv.transfer.plan import TransferPlan

_LOOKUP = {StoreLookup.HIT: LookupResult.HIT, StoreLookup.HIT_PENDING: LookupResult.RETRY}


@dataclass(slots=True)
class _Job:
    """A vLLM job in flight: its reservation in the store and the engine's handle (``None``: nothing to move)."""

    job: TransferJob
    store: bool
    keys: list[OffloadKey]
    handle: BlockIOHandle | None


def default_layout(offloading_spec: Any) -> str:
    """A layout tag from what vLLM's offloading config says about a chunk's bytes.

    Two vLLM instances share stored chunks only if their tags are equal: the same
    model dtype, tokens per hash and blocks per chunk, KV layout and tensor-parallel
    slice.  A spec without that config (a test double) gets a tag naming only the version.
    """
    cfg = getattr(offloading_spec, "config", None)
    parts = [f"vllm-{VLLM_VERSION}-cpu-chunk"]
    try:
        parts += [
            f"dtype={cfg.model.dtype}",
            f"tokens_per_hash={cfg.cache.tokens_per_hash}",
            f"blocks_per_chunk={cfg.cache.blocks_per_chunk}",
            f"kv_layout={cfg.kv_cache_layout}",
            f"canonical={cfg.canonical_layout}",
            f"rank={cfg.parallel.rank}/{cfg.parallel.world_size}",
        ]
    except AttributeError:
        pass
    return ";".join(parts)


_FACTORY_KEYS = ("type", "module_path", "backpressure")  # read by vLLM's SecondaryTierFactory, never passed on


def tier_keys(cls: type) -> tuple[list[str], list[str]]:
    """The keys a tier class takes from its config (its keyword-only arguments, along its MRO) and the required ones."""
    known: dict[str, bool] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                known.setdefault(p.name, p.default is p.empty)
    return sorted(known), sorted(k for k, required in known.items() if required)


def check_tier_config(cls: type, tier_type: str, config: dict[str, Any]) -> None:
    """Refuse a tier's unknown or missing keys, naming them and the known ones, before anything is built.

    vLLM's tier factory passes every key of a tier's entry to its constructor, where a
    misspelled key (``"fsynk"``) would be a bare ``TypeError``.
    """
    known, required = tier_keys(cls)
    where = f"secondary_tiers entry of type {tier_type!r}"
    check_keys(where, config, [*known, *_FACTORY_KEYS])
    missing = [k for k in required if k not in config]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}; the known keys are {known}")


def default_model(offloading_spec: Any) -> str | None:
    """The model name vLLM's offloading config carries, if any."""
    name = getattr(getattr(getattr(offloading_spec, "config", None), "model", None), "name", None)
    return name if isinstance(name, str) and name else None


class StoreTier(SecondaryTierManager, abc.ABC):
    """A secondary tier over a tiered_kv keyed store and its I/O engine (subclasses build the two).

    Args:
        offloading_spec, primary_kv_view, tier_type, backpressure_detector: As vLLM's
            ``SecondaryTierManager`` (vLLM's tier factory passes them).
        model: The namespace's model name; default: the model vLLM's config names.
        hash_scheme: What makes a key meaningful (vLLM's block-hash function and seed);
            two instances share chunks only if it is equal.
        layout: The layout tag of a chunk's bytes; default: :func:`default_layout`.
        policy: The store's cache policy (``"lru"`` or ``"arc"``).
        locality: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's per-request tier filters read it);
            default: the subclass's :attr:`default_locality`.

    Raises:
        TieredKVError: a bad argument, or a medium that cannot be opened; nothing is left open.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE
    default_locality: ClassVar[Locality] = Locality.LOCAL

    def __new__(cls, *args: Any, **kwargs: Any) -> StoreTier:
        # Checked before Python binds the keywords to __init__, which would raise a bare TypeError.
        standard = ("offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector")
        tier_type = kwargs.get("tier_type", args[2] if len(args) > 2 else cls.__name__)
        check_tier_config(cls, str(tier_type), {k: v for k, v in kwargs.items() if k not in standard})
        spec = kwargs.get("offloading_spec", args[0] if args else None)
        extra = getattr(spec, "extra_config", None)
        if isinstance(extra, dict):
            check_keys("kv_connector_extra_config", extra, VLLM_TIERING_KEYS)
        return super().__new__(cls)

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        model: str | None = None,
        hash_scheme: str = "vllm-block-hash",
        layout: str | None = None,
        policy: str = "lru",
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if locality is not None and str(locality).upper() not in Locality.__members__:
            raise TieredKVError(f"locality must be LOCAL or REMOTE, got {locality!r}")
        self.locality = Locality[str(locality).upper()] if locality is not None else self.default_locality
        model = model if model is not None else default_model(offloading_spec)
        if model is None:
            raise TieredKVError(f"the {tier_type} tier needs a 'model' key: vLLM's config names no model")
        self.buffer = ChunkBuffer(primary_kv_view)
        tag = layout if layout is not None else default_layout(offloading_spec)
        try:
            geometry = ChunkGeometry(self.buffer.block_bytes, tag)
            self.namespace = KVNamespace(model, geometry, hash_scheme)
            self.store, self.io = self._open(self.namespace, self.buffer, policy)
        except BaseException:
            self.buffer.release()  # vLLM unmaps its region after a failed start; no view of it may remain
            raise
        self._jobs: dict[int, _Job] = {}
        self._done: list[JobResult] = []
        self._plan_ids = itertools.count(1)

    @abc.abstractmethod
    def _open(self, namespace: KVNamespace, buffer: ChunkBuffer, policy: str) -> tuple[KeyedStore, BlockIOEngine]:
        """Build the store and its I/O engine staging through ``buffer``."""

    # ------------------------------------------------------------ vLLM's interface
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP.get(self.store.lookup(bytes(key)), LookupResult.MISS)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Any, req_context: ReqContext) -> None:
        present = [bytes(k) for k in keys if self.store.is_ready(bytes(k))]
        if present:
            self.store.touch(present)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        rows = dict(zip(keys, (int(c) for c in job_metadata.chunk_ids), strict=True))
        try:
            out = self.store.prepare_store(keys)
        except TieredKVError:
            out = None  # a key the medium cannot name: the job fails, nothing was reserved
        if out is None:  # no room that is not pinned or pending: nothing is stored, vLLM keeps the primary copy
            self._done.append(JobResult(job_metadata.job_id, False))
            return
        todo = list(out.keys_to_store)  # keys already here are skipped, as vLLM's CPU tier does
        plan = self._plan("CPU", self.store.medium, [self.buffer.slot(rows[k]) for k in todo], out.store_spec.block_ids)
        self._start(_Job(job_metadata, True, todo, None), plan)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        rows = [self.buffer.slot(int(c)) for c in job_metadata.chunk_ids]
        try:
            spec = self.store.prepare_load(keys)
        except TieredKVError:  # gone since the lookup (evicted, forgotten): a miss, nothing pinned
            self._done.append(JobResult(job_metadata.job_id, False, successful_keys=()))
            return
        plan = self._plan(self.store.medium, "CPU", spec.block_ids, rows)
        self._start(_Job(job_metadata, False, keys, None), plan)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        for job_id in [j for j, job in self._jobs.items() if job.handle is None or job.handle.done()]:
            self._done.append(self._finish(self._jobs.pop(job_id)))
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        # Every plan ends: the engine's workers finish each batch they started, and none is cancelled.
        for job in list(self._jobs.values()):
            if job.handle is not None:
                job.handle.wait()

    def shutdown(self) -> None:
        self.drain_jobs()
        list(self.get_finished_jobs())
        self.io.close()
        self.buffer.release()  # vLLM unmaps the primary region next; no view of it may remain

    # ------------------------------------------------------------ plumbing
    def _plan(self, src: str, dst: str, src_ids: Any, dst_ids: Any) -> TransferPlan:
        return TransferPlan(next(self._plan_ids), src, dst, tuple(src_ids), tuple(dst_ids))

    def _start(self, job: _Job, plan: TransferPlan) -> None:
        if plan.num_blocks:
            job.handle = self.io.submit(plan)
        self._jobs[job.job.job_id] = job

    def _finish(self, job: _Job) -> JobResult:
        handle, keys = job.handle, job.keys
        elapsed = time.monotonic() - job.job.submit_time
        if handle is None:  # nothing to move: every key was already stored here
            return JobResult(job.job.job_id, True, transfer_time=elapsed, transfer_bytes=0)
        landed = handle.landed_keys()
        nbytes = len(landed) * self.buffer.block_bytes
        if job.store:
            ok = set(landed)
            self.store.complete_store(landed, True)
            self.store.complete_store([k for k in keys if k not in ok], False)
            return JobResult(job.job.job_id, len(ok) == len(keys), transfer_time=elapsed, transfer_bytes=nbytes)
        self.store.complete_load(keys)
        bad = handle.keys_with(BlockOutcome.MISSING, BlockOutcome.CORRUPT)
        if bad:
            self.store.forget(bad)
        if len(landed) == len(keys):
            return JobResult(job.job.job_id, True, transfer_time=elapsed, transfer_bytes=nbytes)
        return JobResult(
            job.job.job_id,
            False,
            successful_keys=[OffloadKey(k) for k in landed],
            transfer_time=elapsed,
            transfer_bytes=nbytes,
        )
