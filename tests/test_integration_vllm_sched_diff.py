"""tiered_kv's scheduler step for step against vLLM 0.33.0's own ``Scheduler``: same requests, same pool, same steps.

vLLM's real ``Scheduler`` (built on CPU from the local tiny model's ``config.json``, no model
hub) and ours (``Scheduler`` over a ``TierManager`` with no CPU tier, recompute preemption and
the ``last_admitted`` victim policy: vLLM's own victim) receive the same request stream.  A
stand-in model runner samples the same token for both (a function of the request and the
position), only for requests whose scheduled tokens reach the end of their known tokens, as
vLLM's model runner discards the sample of a partial prefill.  After every step the test
compares, step by step:

- the batch: which requests are scheduled, in order, and how many tokens each;
- the preemptions of the step;
- the requests that finished;
- the free GPU blocks (after scheduling and after the step), every running request's block
  table (block ids, in order) and ``num_computed_tokens``;
- the running queue's order and the waiting queue's order.

Scenarios: FCFS, priority (vLLM's rule: the lowest-priority running request, whether it was
scheduled this step or not, the requester included), chunked prefill (on and off), preemption
under pressure, prefix sharing, ``max_num_seqs``, vLLM 0.33's full-prompt admission gate
(``scheduler_reserve_full_isl``) on and off, the KV-cache watermark, and prefix caching off;
then seeded random streams (shared prefixes, every priority) under nine combinations of those settings.
"""

from __future__ import annotations

import hashlib
import pathlib
import random
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from vllm_env import PROBLEM, vllm_mark

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

pytestmark = vllm_mark()

if PROBLEM is None:
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.config import SchedulerConfig as VllmSchedulerConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.structured_output import StructuredOutputManager

MODEL = pathlib.Path(__file__).parent / "data" / "tiny-llama"
VOCAB = 1000


@dataclass(frozen=True)
class Arrival:
    """One request of a stream: added to both schedulers before step ``step`` is scheduled."""

    step: int
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    arrival_time: float | None = None  # default: its step, then its number (every request's own)

    @property
    def time(self) -> float:
        return self.arrival_time if self.arrival_time is not None else self.step + int(self.rid[1:]) * 1e-3


@dataclass(frozen=True)
class Setup:
    """The settings both schedulers run with (vLLM's names where they have one)."""

    num_blocks: int  # the pool, null block included (vLLM's KVCacheConfig.num_blocks)
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    block_size: int = 4
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    enable_prefix_caching: bool = True
    max_model_len: int = 512


@dataclass
class Trace:
    """What a run did, step by step (for the scenarios' own assertions)."""

    batches: list[list[tuple[str, int]]] = field(default_factory=list)
    preempted: list[set[str]] = field(default_factory=list)
    finished: list[set[str]] = field(default_factory=list)

    @property
    def all_preempted(self) -> list[str]:
        return [rid for step in self.preempted for rid in sorted(step)]


def token(rid: str, position: int) -> int:
    """The token the stand-in model samples for ``rid`` at ``position``: the same on both sides."""
    digest = hashlib.blake2b(f"{rid}/{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB


def build_vllm(setup: Setup) -> Any:
    model = ModelConfig(
        model=str(MODEL), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=setup.max_model_len
    )
    sched = VllmSchedulerConfig(
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=setup.enable_chunked_prefill,
        policy=setup.policy,
        scheduler_reserve_full_isl=setup.scheduler_reserve_full_isl,
        watermark=setup.watermark,
        async_scheduling=False,
    )
    cache = CacheConfig(
        block_size=setup.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=setup.enable_prefix_caching,
    )
    parallel = ParallelConfig()
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache, parallel_config=parallel)
    spec = FullAttentionSpec(block_size=setup.block_size, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv_cache = KVCacheConfig(
        num_blocks=setup.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cache.num_gpu_blocks = setup.num_blocks
    register_all_kvcache_specs(config)
    return VllmScheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        block_size=setup.block_size,
        structured_output_manager=StructuredOutputManager(config),
    )


def build_ours(setup: Setup) -> Scheduler:
    engine = ControlledCopyEngine({"GPU": setup.num_blocks})
    cost = CostModel(kv_bytes_per_token=8, block_size=setup.block_size, d2h_bytes_per_s=1e12, h2d_bytes_per_s=1e12)
    tm = TierManager(
        ManagerConfig(
            setup.num_blocks, 0, setup.block_size, enable_caching=setup.enable_prefix_caching, watermark=setup.watermark
        ),
        engine,
        cost_model=cost,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        chunked_prefill=setup.enable_chunked_prefill,
        policy=setup.policy,
        victim_policy="last_admitted",
        mode="recompute",
        scheduler_reserve_full_isl=setup.scheduler_reserve_full_isl,
    )
    return Scheduler(tm, config)


def vllm_request(a: Arrival, block_size: int) -> Any:
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, None)
    return VllmRequest(
        a.rid,
        list(a.prompt),
        params,
        None,
        arrival_time=a.time,
        priority=a.priority,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def our_request(a: Arrival) -> Request:
    return Request(
        a.rid,
        list(a.prompt),
        max_tokens=a.max_tokens,
        arrival_time=a.time,
        priority=a.priority,
    )


def vllm_waiting_order(v: Any) -> list[str]:
    return [r.request_id for r in v.waiting]  # FCFS: queue order; priority: the heap's pop order


def our_waiting_order(s: Scheduler) -> list[str]:
    waiting = list(s.waiting)
    if s.config.policy == "priority":  # served by (priority, arrival_time, id): the order vLLM's heap pops
        waiting.sort(key=lambda r: (r.priority, r.arrival_time, r.request_id))
    return [str(r.request_id) for r in waiting]


def runner_output(ids: list[str], sampled: list[list[int]]) -> Any:
    """vLLM's ``ModelRunnerOutput`` of a step that computed ``ids`` (in batch order) and sampled ``sampled``."""
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def run_both(setup: Setup, stream: list[Arrival], max_steps: int = 2000) -> Trace:
    """Drive vLLM's scheduler and ours over ``stream`` to the end, asserting they agree at every step."""
    v, s = build_vllm(setup), build_ours(setup)
    pending = sorted(stream, key=lambda a: (a.step, a.rid))
    trace = Trace()
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            v.add_request(vllm_request(a, setup.block_size))
            s.add_request(our_request(a))
        if not pending and not s.num_unfinished and not v.get_num_unfinished_requests():
            return trace
        where = f"step {step}"
        out_v = v.schedule()
        out_s = s.schedule()
        batch_v = list(out_v.num_scheduled_tokens.items())
        batch_s = [(str(r.request_id), n) for r, n in out_s.scheduled]
        assert batch_s == batch_v, f"{where}: batch"
        preempted_v = set(out_v.preempted_req_ids)
        preempted_s = {str(rid) for rid, _ in out_s.preempted}
        assert len(out_s.preempted) == len(preempted_s), f"{where}: a request preempted twice in one step"
        assert preempted_s == preempted_v, f"{where}: preemptions"
        assert s.tm.num_free_gpu_blocks() == v.kv_cache_manager.block_pool.get_num_free_blocks(), (
            f"{where}: free blocks after scheduling"
        )
        # The stand-in model runner: a token for each request whose step reaches the end of its tokens.
        sampled_v: list[list[int]] = []
        sampled_s: dict[str, int] = {}
        for (rid, n), (req, _) in zip(batch_v, out_s.scheduled, strict=True):
            vreq = v.requests[rid]  # vLLM advanced num_computed_tokens when it scheduled the step
            reaches_end = vreq.num_computed_tokens >= vreq.num_tokens
            assert reaches_end == out_s.needs_sample(req, n), f"{where}: {rid} samples on one side only"
            t = token(rid, vreq.num_tokens)
            sampled_v.append([t] if reaches_end else [])
            if reaches_end:
                sampled_s[rid] = t
        v.update_from_output(out_v, runner_output([rid for rid, _ in batch_v], sampled_v))
        finished_s = {str(r.request_id) for r in s.update(out_s, sampled_s)}
        finished_v = set(v.finished_req_ids)
        assert finished_s == finished_v, f"{where}: finished"
        s.check_consistency()
        s.tm.check_invariants()
        assert s.tm.num_free_gpu_blocks() == v.kv_cache_manager.block_pool.get_num_free_blocks(), (
            f"{where}: free blocks after the step"
        )
        assert [str(r.request_id) for r in s.running] == [r.request_id for r in v.running], f"{where}: running"
        assert our_waiting_order(s) == vllm_waiting_order(v), f"{where}: waiting"
        for r in s.running:
            rid = str(r.request_id)
            assert s.tm.gpu_block_ids(rid) == v.kv_cache_manager.get_block_ids(rid)[0], f"{where}: {rid}'s blocks"
            assert r.num_computed_tokens == v.requests[rid].num_computed_tokens, f"{where}: {rid}'s progress"
        trace.batches.append(batch_s)
        trace.preempted.append(preempted_s)
        trace.finished.append(finished_s)
    raise AssertionError(f"not finished after {max_steps} steps")


def prompt(seed: int, length: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    rng = random.Random(seed)
    return prefix + tuple(rng.randrange(VOCAB) for _ in range(length - len(prefix)))


# ------------------------------------------------------------------------------------ scenarios
def test_fcfs_with_room_for_everything():
    stream = [Arrival(i // 2, f"r{i}", prompt(i, 9 + 3 * i), max_tokens=5 + i) for i in range(6)]
    trace = run_both(Setup(num_blocks=64), stream)
    assert not trace.all_preempted
    assert trace.batches[0] == [("r0", 9), ("r1", 12)]


def test_fcfs_preemption_under_pressure():
    # 24 usable blocks of 4 tokens; eight requests that together need far more.
    stream = [Arrival(i % 3, f"r{i}", prompt(100 + i, 10 + i), max_tokens=16) for i in range(8)]
    trace = run_both(Setup(num_blocks=25, max_num_batched_tokens=32), stream)
    assert len(trace.all_preempted) >= 3


def test_priority_preempts_the_lowest_priority_even_when_it_was_scheduled_this_step():
    # 6 usable blocks.  r0 (priority 3, the least important) is first in the running queue and is
    # scheduled in step 2 (its token lands in a block it holds); then r1 (priority 0) needs a 4th
    # block: vLLM takes r0 out of the batch, gives its token back to the budget and preempts it.
    stream = [
        Arrival(0, "r0", prompt(1, 9), max_tokens=12, priority=3),
        Arrival(1, "r1", prompt(2, 12), max_tokens=8, priority=0),
    ]
    trace = run_both(Setup(num_blocks=7, policy="priority"), stream)
    assert trace.batches[1] == [("r0", 1), ("r1", 12)]
    assert (trace.batches[2], trace.preempted[2]) == ([("r1", 1)], {"r0"})
    assert trace.all_preempted == ["r0"]  # never r1, the most important


def test_priority_the_requester_preempts_itself_and_the_more_important_requests_after_it_run():
    # 9 usable blocks.  Step 5: r2 (priority 0) needs a block; r1 (priority 5), scheduled already,
    # goes.  Step 12: r0 (priority 1) needs a block and is itself the least important running
    # request: it preempts itself, and r2, after it in the queue, still runs.
    stream = [
        Arrival(0, "r0", prompt(3, 9), max_tokens=14, priority=1),
        Arrival(1, "r1", prompt(4, 8), max_tokens=14, priority=5),
        Arrival(2, "r2", prompt(5, 6), max_tokens=14, priority=0),
    ]
    trace = run_both(Setup(num_blocks=10, policy="priority"), stream)
    assert (trace.batches[5], trace.preempted[5]) == ([("r0", 1), ("r2", 1)], {"r1"})
    assert (trace.batches[12], trace.preempted[12]) == ([("r2", 1)], {"r0"})
    assert "r2" not in trace.all_preempted


def test_priority_under_pressure_with_arrivals_of_every_priority():
    stream = [
        Arrival(i % 4, f"r{i}", prompt(200 + i, 6 + (i * 5) % 11), max_tokens=10 + i % 7, priority=(i * 7) % 4)
        for i in range(10)
    ]
    trace = run_both(Setup(num_blocks=21, policy="priority", max_num_batched_tokens=24), stream)
    assert trace.all_preempted


def test_priority_ties_the_first_of_the_running_queue_goes_and_the_smallest_id_is_served():
    # Equal priorities and arrival times: vLLM's max() over the running queue takes the first of
    # the equals, and its waiting heap serves the smallest request id first.
    stream = [Arrival(0, f"r{i}", prompt(900 + i, 6 + i), max_tokens=12, arrival_time=0.0) for i in (3, 1, 2, 4)]
    trace = run_both(Setup(num_blocks=13, policy="priority", max_num_batched_tokens=16), stream)
    assert [rid for rid, _ in trace.batches[0]] == ["r1", "r2", "r3"]  # by id, not in the order added (r3 first)
    assert trace.all_preempted[:2] == ["r1", "r2"]  # the first of the running queue, each time


def test_chunked_prefill_splits_long_prompts_at_the_budget():
    stream = [Arrival(0, f"r{i}", prompt(300 + i, 40 + 7 * i), max_tokens=6) for i in range(4)]
    trace = run_both(Setup(num_blocks=64, max_num_batched_tokens=16), stream)
    assert trace.batches[0] == [("r0", 16)]


def test_chunked_prefill_under_pressure_without_the_full_prompt_gate():
    stream = [Arrival(i, f"r{i}", prompt(400 + i, 30 + 5 * i), max_tokens=8) for i in range(5)]
    trace = run_both(Setup(num_blocks=20, max_num_batched_tokens=12, scheduler_reserve_full_isl=False), stream)
    assert trace.all_preempted


def test_the_full_prompt_gate_admits_only_what_fits_whole():
    stream = [Arrival(i, f"r{i}", prompt(400 + i, 30 + 5 * i), max_tokens=8) for i in range(5)]
    gated = run_both(Setup(num_blocks=20, max_num_batched_tokens=12), stream)
    ungated = run_both(Setup(num_blocks=20, max_num_batched_tokens=12, scheduler_reserve_full_isl=False), stream)
    assert len(gated.all_preempted) < len(ungated.all_preempted)


def test_the_full_prompt_gate_waits_for_a_finish_instead_of_preempting_mid_prefill():
    stream = [Arrival(0, "r0", prompt(450, 8), max_tokens=9), Arrival(0, "r1", prompt(451, 20), max_tokens=1)]
    trace = run_both(Setup(num_blocks=7, max_num_batched_tokens=8), stream)
    assert trace.finished[8] == {"r0"} and trace.batches[9] == [("r1", 8)]
    assert not trace.all_preempted


def test_no_chunked_prefill_admits_when_the_tokens_left_after_the_hits_fit_the_step():
    shared = prompt(460, 12)
    stream = [
        Arrival(0, "r0", shared, max_tokens=1),
        Arrival(1, "r1", prompt(461, 14), max_tokens=1),
        Arrival(1, "r2", prompt(462, 14, shared), max_tokens=1),
    ]
    setup = Setup(num_blocks=20, max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    trace = run_both(setup, stream)
    assert trace.batches[1] == [("r1", 14), ("r2", 2)]


def test_no_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it():
    stream = [Arrival(i // 2, f"r{i}", prompt(500 + i, 10 + 4 * i), max_tokens=4) for i in range(6)]
    setup = Setup(num_blocks=30, max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False)
    trace = run_both(setup, stream)
    assert all(n <= 40 for batch in trace.batches for _, n in batch)


def test_prefix_sharing_hits_and_preempted_requests_find_their_blocks_again():
    system = prompt(600, 12)
    stream = [Arrival(i // 3, f"r{i}", prompt(610 + i, 12 + 3 + i % 4, system), max_tokens=10) for i in range(9)]
    trace = run_both(Setup(num_blocks=22, max_num_batched_tokens=40), stream)
    assert trace.all_preempted


def test_prefix_caching_off_a_preempted_request_computes_everything_again():
    system = prompt(600, 12)
    stream = [Arrival(i // 3, f"r{i}", prompt(610 + i, 12 + 3 + i % 4, system), max_tokens=10) for i in range(9)]
    trace = run_both(Setup(num_blocks=22, max_num_batched_tokens=40, enable_prefix_caching=False), stream)
    assert trace.all_preempted


def test_max_num_seqs_caps_the_running_set():
    stream = [Arrival(0, f"r{i}", prompt(700 + i, 5 + i), max_tokens=6) for i in range(7)]
    trace = run_both(Setup(num_blocks=64, max_num_seqs=3), stream)
    assert all(len(batch) <= 3 for batch in trace.batches)
    assert [rid for rid, _ in trace.batches[0]] == ["r0", "r1", "r2"]


def test_the_watermark_keeps_blocks_free_when_admitting():
    stream = [Arrival(i % 2, f"r{i}", prompt(800 + i, 8 + 2 * i), max_tokens=14) for i in range(8)]
    plain = run_both(Setup(num_blocks=30, max_num_batched_tokens=32), stream)
    kept = run_both(Setup(num_blocks=30, max_num_batched_tokens=32, watermark=0.2), stream)  # int(0.2 * 30) = 6
    assert len(kept.all_preempted) < len(plain.all_preempted)


# --------------------------------------------------------------------------------- random streams
def random_stream(seed: int, setup: Setup, n: int = 22) -> list[Arrival]:
    """Requests with shared prefixes, of every priority, arriving over the first steps."""
    rng = random.Random(seed)
    prefixes = [prompt(seed * 100 + k, rng.randint(4, 14)) for k in range(3)]
    cap = setup.max_num_batched_tokens if not setup.enable_chunked_prefill else 60
    out = []
    for i in range(n):
        max_tokens = rng.randint(1, 20)
        length = rng.randint(1, max(cap - max_tokens, 1))
        base = rng.choice([(), *prefixes])[:length]
        out.append(
            Arrival(rng.randrange(8), f"r{i}", prompt(seed * 1000 + i, length, base), max_tokens, rng.randrange(4))
        )
    return out


SETTINGS = [
    {},
    {"policy": "priority"},
    {"scheduler_reserve_full_isl": False},
    {"policy": "priority", "scheduler_reserve_full_isl": False},
    {"watermark": 0.1},
    {"enable_prefix_caching": False},
    {"policy": "priority", "watermark": 0.05, "enable_prefix_caching": False},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 48, "max_model_len": 48},
    {"max_num_seqs": 3, "policy": "priority"},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "default")
@pytest.mark.parametrize("seed", range(3))
def test_random_streams(settings, seed):
    setup = replace(Setup(num_blocks=22, max_num_batched_tokens=24), **settings)
    trace = run_both(setup, random_stream(seed, setup))
    assert trace.all_preempted  # the pool is small enough that every stream preempts
