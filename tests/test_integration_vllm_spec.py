"""tiered_kv's CPU store as a whole vLLM 0.33 offloading spec, under vLLM's real Scheduler and OffloadingConnector.

The scheduler is built from a local tiny model ``config.json`` (no model hub);
a test worker plays vLLM's GPU<->CPU worker: it completes every transfer job
the connector hands out, reporting it as vLLM's worker does.
"""

from __future__ import annotations

import pathlib

import pytest
from vllm_env import PROBLEM, offloading_config, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    from tiered_kv.errors import ConfigError
    from tiered_kv.integrations.vllm import TieredKVOffloadingManager, TieredKVOffloadingSpec

MODEL = pathlib.Path(__file__).parent / "data" / "tiny-llama"
BS = 16
SPEC = {"spec_name": "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


def make_scheduler(extra: dict) -> Scheduler:
    model = ModelConfig(model=str(MODEL), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=1024)
    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False, watermark=0.0
    )
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    config = VllmConfig(
        scheduler_config=sched,
        model_config=model,
        cache_config=cache,
        parallel_config=ParallelConfig(),
        kv_transfer_config=kv,
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache.num_gpu_blocks = 64
    register_all_kvcache_specs(config)
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        block_size=BS,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )


def request(rid: str, tokens: list[int]) -> Request:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    params.update_from_generation_config({}, 2)
    return Request(rid, tokens, params, None, block_hasher=get_request_block_hasher(BS, sha256))


class CompletingWorker:
    """Completes every transfer job of a step, as vLLM's worker reports a finished copy."""

    def __init__(self) -> None:
        self.stores = 0
        self.loads = 0

    def run(self, sched: Scheduler, steps: int) -> None:
        for _ in range(steps):
            out = sched.schedule()
            meta = out.kv_connector_metadata
            done = OffloadingWorkerMetadata()
            for job_id in [*meta.store_jobs, *meta.load_jobs]:
                done.mark_completed(job_id)
            self.stores += len(meta.store_jobs)
            self.loads += len(meta.load_jobs)
            ids = list(out.num_scheduled_tokens)
            sched.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[[7] for _ in ids],
                    logprobs=None,
                    prompt_logprobs_dict={},
                    pooler_output=[],
                    kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=done),
                ),
            )


def our_manager(sched: Scheduler) -> TieredKVOffloadingManager:
    manager = sched.connector.connector_scheduler.manager
    assert isinstance(manager, TieredKVOffloadingManager)
    return manager


def test_vllm_factory_builds_our_spec_from_spec_module_path():
    spec = OffloadingSpecFactory.create_spec(offloading_config({**SPEC, "cpu_bytes_to_use": 8 * 4096}))
    assert type(spec) is TieredKVOffloadingSpec
    manager = spec.get_manager()
    assert isinstance(manager, TieredKVOffloadingManager)
    assert manager.store.capacity == 8
    assert manager.pricing is None


def test_bad_load_pricing_is_refused_before_anything_is_built():
    with pytest.raises(ConfigError, match="unknown keys"):
        TieredKVOffloadingSpec(offloading_config({**SPEC, "cpu_bytes_to_use": 4096, "load_pricing": {"speed": 1}}))
    with pytest.raises(ConfigError, match="prefill_tokens_per_s"):
        TieredKVOffloadingSpec(offloading_config({**SPEC, "cpu_bytes_to_use": 4096, "load_pricing": {}}))


def test_a_real_scheduler_stores_into_our_store_and_a_second_request_hits():
    sched = make_scheduler({**SPEC, "cpu_bytes_to_use": 1 << 20})
    manager = our_manager(sched)
    worker = CompletingWorker()
    shared = list(range(100, 100 + 4 * BS))  # four full blocks of shared prefix
    first = request("a", [*shared, 1, 2, 3])
    sched.add_request(first)
    worker.run(sched, 4)
    assert worker.stores >= 1
    stored = [make_offload_key(h, 0) for h in first.block_hashes[:4]]
    assert [manager.store.is_ready(k) for k in stored] == [True] * 4  # the completed stores landed in our store
    sched.reset_prefix_cache()  # the GPU forgets: a hit must come from the CPU tier
    second = request("b", [*shared, 9, 9, 9, 9])
    sched.add_request(second)
    worker.run(sched, 3)
    assert worker.loads >= 1
    assert second.num_computed_tokens >= 4 * BS
    assert manager.store.stats.hits >= 4


def test_load_pricing_declines_a_run_that_recomputes_faster():
    fast_prefill = {"prefill_tokens_per_s": 1e12, "h2d_bytes_per_s": 1e3, "per_copy_overhead_s": 1.0}
    sched = make_scheduler({**SPEC, "cpu_bytes_to_use": 1 << 20, "load_pricing": fast_prefill})
    manager = our_manager(sched)
    worker = CompletingWorker()
    shared = list(range(300, 300 + 4 * BS))
    sched.add_request(request("a", [*shared, 1]))
    worker.run(sched, 4)
    sched.reset_prefix_cache()
    worker.loads = 0
    sched.add_request(request("b", [*shared, 2]))
    worker.run(sched, 3)
    assert manager.pricing.declined >= 1
    assert worker.loads == 0  # every chunk was found, and recomputed instead
    assert manager.pricing.last_quote.num_blocks == 0


def test_pricing_answers_miss_only_where_the_store_said_hit():
    spec = TieredKVOffloadingSpec(
        offloading_config(
            {**SPEC, "cpu_bytes_to_use": 8 * 4096, "load_pricing": {"prefill_tokens_per_s": 1e12, "h2d_bytes_per_s": 1}}
        )
    )
    manager = spec.get_manager()
    ctx = ReqContext("r")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * BS)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys[:2], ctx)
    assert list(out.keys_to_store) == keys[:2]
    manager.complete_store(keys[:2], ctx)
    assert manager.store.lookup(keys[0]).name == "HIT"
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3
    assert manager.pricing.declined == 2  # the third was a plain miss, not priced
