"""A rig for preemption inside vLLM 0.33 on the CPU: vLLM's real scheduler, connector and worker side, real bytes.

* The scheduler is vLLM's ``Scheduler`` (or ``AsyncScheduler``) or tiered_kv's
  ``TieredKVScheduler``, with tiered_kv's ``TieredKVConnector`` (or none).
* The worker side is the connector's own worker role (``TieredKVConnector`` built
  with ``KVConnectorRole.WORKER``, its KV caches registered as vLLM's model runner
  registers them), driven in the order vLLM's GPU model runner drives it:
  ``handle_preemptions``, ``start_load_kv`` (before the forward pass for sync
  loads, after it otherwise), the forward pass, ``wait_for_save``,
  ``get_finished``, ``get_block_ids_with_load_errors``, ``build_connector_worker_meta``.
* Its copy engine is :class:`ByteWorker` (what vLLM's ``CPUOffloadingWorker`` is on
  a GPU): it copies real bytes between a CPU tensor standing for the GPU KV cache
  and one standing for the CPU tier, and the test controls when each job copies
  and reports, and whether it fails (:class:`Fault`).
* The forward pass (:meth:`Rig.step`) writes every computed token's KV into its
  block: bytes derived from the request's tokens up to that position (a hash of
  the prefix), so KV computed again or loaded back must be byte-identical, and a
  block read or written at the wrong time shows up as wrong bytes.  It counts
  every position computed, and those computed again.
"""

from __future__ import annotations

import enum
import hashlib
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_env import PROBLEM

MODEL = pathlib.Path(__file__).parent / "data" / "tiny-llama"
BS = 16  # tokens per GPU block (and per chunk: blocks_per_chunk = 1)
MODULE = "tiered_kv.integrations.vllm"
SLOT = 64  # bytes of one token's K (and of its V) in a block: 2 KV heads x 16 x fp16

if PROBLEM is None:
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker, TransferResult
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from tiered_kv.integrations.vllm import TieredKVConnector, TieredKVOffloadingSpec

    class Fault(enum.Enum):
        """What a job does: copy and report at once (``OK``), or fail."""

        OK = "ok"
        FAIL = "fail"  # copies half its blocks (torn), reports failure
        CANCEL = "cancel"  # copies nothing, reports failure

    @dataclass
    class _Job:
        job_id: int
        store: bool
        src: list[int]
        dst: list[int]
        fault: Fault = Fault.OK
        report_after: int = 0  # get_finished calls to wait after the copy before reporting
        copied: bool = False

    class ByteWorker(OffloadingWorker):
        """GPU<->CPU copies of real bytes between two CPU tensors, each job's fate set by the test.

        A job copies when the worker side waits for it (``wait``: a flush before the
        forward pass) or, otherwise, at the next ``get_finished`` (after the forward
        pass of the step it was submitted in); it reports its result then, or
        ``report_after`` calls later (a delayed report: reports come out of order).
        """

        def __init__(self, gpu: torch.Tensor, num_chunks: int) -> None:
            self.gpu = gpu  # (num_blocks, page_bytes) int8
            self.cpu = torch.zeros((num_chunks, gpu.shape[1]), dtype=torch.int8)
            self.jobs: dict[int, _Job] = {}
            self.faults: dict[int, Fault] = {}
            self.delays: dict[int, int] = {}
            self.reported: list[tuple[int, bool]] = []
            self.flushed: list[int] = []

        def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            self.jobs[job_id] = _Job(
                job_id, True, [int(b) for b in src_spec.block_ids], list(map(int, dst_spec.block_ids))
            )
            return True

        def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
            self.jobs[job_id] = _Job(
                job_id, False, list(map(int, src_spec.block_ids)), [int(b) for b in dst_spec.block_ids]
            )
            return True

        def _copy(self, job: _Job) -> None:
            if job.copied:
                return
            job.copied = True
            job.fault = self.faults.pop(job.job_id, Fault.OK)
            job.report_after = self.delays.pop(job.job_id, 0)
            pairs = list(zip(job.src, job.dst, strict=True))
            if job.fault is Fault.CANCEL:
                pairs = []
            elif job.fault is Fault.FAIL:
                pairs = pairs[: max(1, len(pairs) // 2)]
            for s, d in pairs:
                if job.store:
                    self.cpu[d] = self.gpu[s]
                else:
                    self.gpu[d] = self.cpu[s]

        def wait(self, job_ids: set[int]) -> None:
            self.flushed.extend(sorted(job_ids))
            for job_id in sorted(job_ids):
                if job_id in self.jobs:
                    self._copy(self.jobs[job_id])

        def get_finished(self) -> list[TransferResult]:
            out = []
            for job in list(self.jobs.values()):
                self._copy(job)
                if job.report_after > 0:
                    job.report_after -= 1
                    continue
                ok = job.fault is Fault.OK
                out.append(TransferResult(job.job_id, ok, len(job.src) * self.gpu.shape[1], 0.0))
                self.reported.append((job.job_id, ok))
                del self.jobs[job.job_id]
            return out

        def reading(self) -> set[int]:
            """GPU blocks that submitted stores have not read yet."""
            return {b for j in self.jobs.values() if j.store and not j.copied for b in j.src}

    class ByteSpec(TieredKVOffloadingSpec):
        """tiered_kv's spec whose worker-side copy engine is a :class:`ByteWorker`."""

        def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
            if not self._worker:
                (tensor,) = kv_caches.tensors
                self._worker = ByteWorker(tensor.tensor, self.num_chunks)
            return self._worker


def extra_config(preemption: dict | None = None, cpu_chunks: int = 256, **more: Any) -> dict:
    """``kv_connector_extra_config`` of tiered_kv's spec with the byte-copying worker, sized in chunks."""
    extra = {"spec_name": "ByteSpec", "spec_module_path": "vllm_preempt_env", "cpu_bytes_to_use": cpu_chunks * 4096}
    if preemption is not None:
        extra["preemption"] = preemption
    extra.update(more)
    return extra


def build_config(
    extra: dict | None,
    num_gpu_blocks: int,
    *,
    connector: str | None = "TieredKVConnector",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 128,
    long_prefill: int = 0,
    async_scheduling: bool = False,
    policy: str = "fcfs",
    failure_policy: str = "recompute",
) -> tuple[VllmConfig, KVCacheConfig]:
    """A vLLM config for the tiny Llama of ``tests/data`` and a one-group KV cache of ``num_gpu_blocks`` blocks."""
    model = ModelConfig(model=str(MODEL), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=2048)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=2048,
        is_encoder_decoder=False,
        policy=policy,
        long_prefill_token_threshold=long_prefill,
    )
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    kv = None
    if connector is not None:
        module = MODULE if connector == "TieredKVConnector" else None
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra or {},
            kv_load_failure_policy=failure_policy,
        )
    config = VllmConfig(
        scheduler_config=sched,
        model_config=model,
        cache_config=cache,
        parallel_config=ParallelConfig(),
        kv_transfer_config=kv,
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv_cache = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=spec.page_size_bytes * num_gpu_blocks,
                layers=["layer"],
                layer_stride=spec.page_size_bytes * num_gpu_blocks,
                block_stride=spec.page_size_bytes,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    cache.num_gpu_blocks = num_gpu_blocks
    # vLLM's CPU platform turns async scheduling off while it builds the config; set it after, as vLLM's tests do.
    config.scheduler_config.async_scheduling = async_scheduling
    register_all_kvcache_specs(config)
    return config, kv_cache


def token_kv(prefix_digest: bytes) -> bytes:
    """One token's K (or V) bytes: 64 bytes from the digest of the request's tokens up to and including it."""
    return (prefix_digest * 2)[:SLOT]


@dataclass
class StepRecord:
    """What one step did, for tests that compare steps."""

    scheduled: dict[str, int]
    preempted: list[str]
    new_blocks: dict[str, list[int]]
    store_jobs: dict[int, tuple[list[int], list[int]]]
    load_jobs: dict[int, tuple[list[int], list[int]]]
    flushed: list[int]


@dataclass
class Resume:
    """A preempted request scheduled again: how much KV it had and how much came back."""

    request_id: str
    had: int  # tokens of KV when preempted
    restored: int  # tokens of KV it started from when it ran again (GPU hits and loads)
    bytes_equal: bool


@dataclass
class Rig:
    """vLLM's scheduler and connector (both roles) on the CPU, with the forward pass of a test model."""

    scheduler: Any
    gpu: Any  # the GPU KV cache stand-in: (num_blocks, page_bytes) int8, the storage the worker role registered
    worker: Any = None  # the connector's worker role
    hazards: list[str] = field(default_factory=list)
    computed: dict[str, list[int]] = field(default_factory=dict)  # per request, times each position was computed
    resumes: list[Resume] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    on_schedule: Callable[[Any], None] | None = None
    scheduler_stats: list[Any] = field(default_factory=list)  # what vLLM's frontend receives with each output
    pipelined: bool = False  # schedule step N+1 before step N's output is processed (vLLM's async scheduling)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # per request, its tokens as the model runner knows them
    added: dict[str, Any] = field(default_factory=dict)  # every request added, finished ones included
    _pending: Any = None
    _kv: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # request -> (its table, tokens of KV)
    _at_preemption: dict[str, tuple[int, list[bytes]]] = field(default_factory=dict)
    _digests: dict[str, list[bytes]] = field(default_factory=dict)

    @classmethod
    def build(cls, scheduler_cls: type, extra: dict | None, num_gpu_blocks: int, **kw: Any) -> Rig:
        config, kv_cache = build_config(extra, num_gpu_blocks, **kw)
        if scheduler_cls is Scheduler and kw.get("async_scheduling"):
            scheduler_cls = AsyncScheduler
        sched = scheduler_cls(
            vllm_config=config,
            kv_cache_config=kv_cache,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BS,
            log_stats=True,
        )
        caches = {"layer": torch.zeros((num_gpu_blocks, 2, BS, 2, 16), dtype=torch.float16)}
        assert kv_cache.kv_cache_groups[0].kv_cache_spec.page_size_bytes == 2 * BS * SLOT
        rig = cls(sched, caches["layer"].view(torch.int8).view(num_gpu_blocks, -1))
        rig.pipelined = bool(kw.get("async_scheduling"))
        if kw.get("connector", "TieredKVConnector") == "TieredKVConnector":
            worker = TieredKVConnector(config, KVConnectorRole.WORKER, kv_cache)
            with set_current_vllm_config(config):
                worker.register_kv_caches(caches)
            rig.worker = worker
            assert rig.byte_worker.gpu.data_ptr() == rig.gpu.data_ptr()
        return rig

    # ------------------------------------------------------------ requests
    def add(
        self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: float | None = None
    ) -> None:
        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, 2)
        req = Request(
            rid,
            prompt,
            params,
            None,
            block_hasher=get_request_block_hasher(BS, sha256),
            priority=priority,
            arrival_time=arrival,
        )
        self.scheduler.add_request(req)
        self.added[rid] = req
        self.computed[rid] = []
        self.tokens[rid] = list(prompt)

    @property
    def byte_worker(self) -> ByteWorker:
        return self.worker.connector_worker.worker

    # ------------------------------------------------------------ bytes
    def _digest(self, rid: str, pos: int) -> bytes:
        """Digest of the request's tokens ``[0, pos]`` (kept per request, extended as it grows)."""
        digests = self._digests.setdefault(rid, [])
        tokens = self.tokens[rid]
        while len(digests) <= pos:
            prev = digests[-1] if digests else b""
            digests.append(hashlib.sha256(prev + int(tokens[len(digests)]).to_bytes(8, "little")).digest())
        return digests[pos]

    def _read(self, table: list[int], n: int) -> list[bytes]:
        half = BS * SLOT
        out = []
        for p in range(n):
            row = self.gpu[table[p // BS]]
            s = (p % BS) * SLOT
            out.append(row[s : s + SLOT].numpy().tobytes() + row[half + s : half + s + SLOT].numpy().tobytes())
        return out

    def _write(self, rid: str, table: list[int], start: int, n: int) -> None:
        reading = self.byte_worker.reading() if self.worker is not None else set()
        half = BS * SLOT
        for p in range(start, start + n):
            block = table[p // BS]
            if block in reading:
                self.hazards.append(f"{rid} writes position {p} into block {block} while a store still reads it")
            kv = torch.frombuffer(bytearray(token_kv(self._digest(rid, p))), dtype=torch.int8)
            s = (p % BS) * SLOT
            self.gpu[block, s : s + SLOT] = kv
            self.gpu[block, half + s : half + s + SLOT] = kv

    def expected(self, rid: str, n: int) -> list[bytes]:
        return [token_kv(self._digest(rid, p)) * 2 for p in range(n)]

    def kv_bytes_ok(self, rid: str) -> bool:
        """Whether a running request's blocks hold the right KV for all its computed tokens."""
        req = self.scheduler.requests[rid]
        (table,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
        n = req.num_computed_tokens
        return self._read(table, n) == self.expected(rid, n)

    # ------------------------------------------------------------ one step
    def step(self) -> Any:
        """Schedule, run and update one step (a pipelined rig updates the previous step instead)."""
        out = self.scheduler.schedule()
        result = self._execute(out)
        if self.pipelined:
            if self._pending is not None:
                self._update(*self._pending)
            self._pending = (out, result)
        else:
            self._update(out, result)
        return out

    def _update(self, out: Any, result: Any) -> None:
        for engine_out in self.scheduler.update_from_output(out, result).values():
            if engine_out.scheduler_stats is not None:
                self.scheduler_stats.append(engine_out.scheduler_stats)

    def _execute(self, out: Any) -> Any:
        """The model runner's step: the connector's worker side around a forward pass that writes KV."""
        sched, worker = self.scheduler, self.worker
        meta = out.kv_connector_metadata
        preempted = sorted(out.preempted_req_ids or ())
        for rid in preempted:  # what its blocks held when it was preempted (nobody wrote them since)
            table, n = self._kv.pop(rid, ([], 0))
            self._at_preemption[rid] = (n, self._read(table, n))
        if self.on_schedule is not None:
            self.on_schedule(out)
        record = StepRecord(
            dict(out.num_scheduled_tokens),
            preempted,
            {r.req_id: list(r.block_ids[0]) for r in out.scheduled_new_reqs},
            {},
            {},
            [],
        )
        if meta is not None and hasattr(meta, "store_jobs"):
            record.store_jobs = {j: _spec_ids(t) for j, t in meta.store_jobs.items()}
            record.load_jobs = {j: _spec_ids(t) for j, t in meta.load_jobs.items()}
        self.steps.append(record)
        if worker is not None:
            worker.handle_preemptions(meta)
            worker.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                worker.start_load_kv(None)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            start = req.num_computed_tokens - n  # vLLM advanced it when it scheduled the step
            (table,) = sched.kv_cache_manager.get_block_ids(rid)
            if rid in self._at_preemption:
                had, before = self._at_preemption.pop(rid)
                now = self._read(table, min(start, had))
                self.resumes.append(Resume(rid, had, start, now == before[: len(now)]))
            self._write(rid, table, start, n)
            self._kv[rid] = (list(table), start + n)
            counts = self.computed[rid]
            counts.extend([0] * (start + n - len(counts)))
            for p in range(start, start + n):
                counts[p] += 1
            tokens = self.tokens[rid]
            if start + n >= len(tokens):
                token = 100 + int.from_bytes(self._digest(rid, len(tokens) - 1)[:4], "little") % 800
                tokens.append(token)
                sampled[rid] = [token]
        kv_out = None
        if worker is not None:
            if not out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
            _, recving = worker.get_finished(out.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            kv_out = KVConnectorOutput(
                finished_recving=recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
            record.flushed = list(self.byte_worker.flushed)
            self.byte_worker.flushed.clear()
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled.get(r, []) for r in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            kv_connector_output=kv_out,
        )

    def finish_pending(self) -> None:
        if self._pending is not None:
            self._update(*self._pending)
            self._pending = None

    def run(self, max_steps: int = 3000) -> int:
        """Step until every request finished; the number of steps."""
        for i in range(max_steps):
            if not self.scheduler.has_requests() and not self.scheduler.has_finished_requests():
                if self._pending is None:
                    return i
                self.finish_pending()
                continue
            self.step()
        raise AssertionError(f"requests left after {max_steps} steps: {list(self.scheduler.requests)}")

    # ------------------------------------------------------------ what the forward pass saw
    def tokens_computed(self) -> int:
        return sum(sum(c) for c in self.computed.values())

    def tokens_recomputed(self) -> int:
        return sum(sum(n - 1 for n in c if n > 1) for c in self.computed.values())


def oversubscribed_stream(rig: Rig, n: int = 16, seed: int = 1, priorities: bool = False) -> None:
    """``n`` requests of 40-208 prompt tokens (every third behind a shared 48-token prefix), 10-80 output tokens.

    All arrive at once: far more KV than a 32-block pool holds, so requests are preempted and resumed.
    """
    rnd = random.Random(seed)
    shared = [rnd.randint(3, 999) for _ in range(48)]
    for i in range(n):
        length = rnd.randint(40, 160)
        prefix = shared if i % 3 == 0 else []
        prompt = prefix + [rnd.randint(3, 999) for _ in range(length)]
        rig.add(f"r{i}", prompt, max_tokens=rnd.randint(10, 80), priority=rnd.randint(0, 2) if priorities else 0)


def _spec_ids(job: Any) -> tuple[list[int], list[int]]:
    return [int(b) for b in job.src_spec.block_ids], [int(b) for b in job.dst_spec.block_ids]
