"""A request computes between two preemptions: no swap loop, whatever the victim policy finds cheapest.

The workload has long prompts and no prefix sharing, chunked under a token
budget that is a multiple of the block size, with a write-through CPU tier and
the cost-aware policy: a request whose computed blocks are all stored already
costs nothing to swap, and its blocks stay cached on the GPU, so it resumes
without a copy.  Without the rule it was swapped out again before its next
step, and again, never computing.
"""

from __future__ import annotations

import collections

import pytest
from simutil import KIB_IN_GIB, config, run

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine


def _long_prompts(policy: str, offload: str, n: int) -> dict:
    return config(
        workload__num_requests=n,
        workload__arrival={"process": "poisson", "rate": 2.0},
        workload__prompt_len={"dist": "uniform", "low": 40, "high": 120},
        workload__output_len={"dist": "uniform", "low": 4, "high": 40},
        memory__gpu_kv_gib=64 * KIB_IN_GIB,
        memory__cpu_kv_gib=256 * KIB_IN_GIB,
        scheduler__max_num_batched_tokens=64,
        scheduler__max_num_seqs=8,
        runs=[{"name": "run", "victim_policy": policy, "mode": "auto", "offload": offload}],
    )


def progress_between_preemptions(trace: list) -> tuple[dict, dict, list]:
    """Per request: preemptions and steps computed; and the preemptions with no step since the request re-entered."""
    steps: collections.Counter = collections.Counter()
    preemptions: collections.Counter = collections.Counter()
    computed_since: dict = {}
    unearned = []
    for t, kind, *rest in trace:
        if kind == "step":
            for rid, _ in rest[0]:
                steps[rid] += 1
                computed_since[rid] = True
        elif kind.startswith("preempt"):
            rid = rest[0]
            preemptions[rid] += 1
            if not computed_since.get(rid, False):
                unearned.append((t, kind, rid))
            computed_since[rid] = False
    return dict(preemptions), dict(steps), unearned


@pytest.mark.parametrize(("policy", "offload"), [("cost_aware", "write_through"), ("last_admitted", "write_through")])
def test_long_prompts_without_sharing_never_preempt_a_request_before_it_computes_again(policy, offload):
    res, sim = run(_long_prompts(policy, offload, 200), trace=True)
    assert res["requests_finished"] == 200
    preemptions, steps, unearned = progress_between_preemptions(sim.loop.trace)
    assert unearned == []
    assert sum(preemptions.values()) > 0  # the workload does preempt: the rule is exercised
    assert all(n <= steps[rid] for rid, n in preemptions.items())


def test_a_free_swap_victim_resumed_from_the_gpu_cache_is_not_swapped_again_before_its_step():
    # B's computed prompt (8 tokens, 2 blocks) is all stored by write-through, so swapping it out copies
    # nothing and its blocks stay cached on the GPU: it resumes at once, with no copy, after the batch.
    eng = ControlledCopyEngine({"GPU": 7, "CPU": 16})
    tm = TierManager(
        ManagerConfig(7, 16, 4, offload="write_through"), eng, cost_model=CostModel(kv_bytes_per_token=64, block_size=4)
    )
    s = Scheduler(
        tm, SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, victim_policy="cost_aware", mode="swap")
    )
    s.add_request(Request("A", list(range(8)), max_tokens=9, arrival_time=0.0))
    s.add_request(Request("B", list(range(100, 116)), max_tokens=4, arrival_time=1.0))
    history = []
    for _ in range(60):
        if not s.num_unfinished:
            break
        eng.complete_all()
        out = s.schedule()
        history.append(([(r.request_id, n) for r, n in out.scheduled], list(out.preempted), list(out.resumed)))
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
        s.check_consistency()
        tm.check_invariants()
    assert s.num_unfinished == 0, history
    computed_since = {}
    for scheduled, preempted, _ in history:
        for rid, _ in preempted:
            assert computed_since.get(rid, True), (rid, history)
            computed_since[rid] = False
        for rid, _ in scheduled:
            computed_since[rid] = True


# ------------------------------------- without chunked prefill: no silent starvation
def _no_chunking(gpu: int = 9, budget: int = 16) -> Scheduler:
    eng = ControlledCopyEngine({"GPU": gpu, "CPU": 2})
    cm = CostModel(kv_bytes_per_token=64, block_size=4)
    tm = TierManager(
        ManagerConfig(gpu, 0, 4, enable_caching=False), eng, cost_model=cm
    )  # a recompute computes it all again
    return Scheduler(tm, SchedulerConfig(max_num_batched_tokens=budget, chunked_prefill=False, mode="recompute"))


def test_without_chunked_prefill_a_request_that_could_outgrow_the_budget_is_refused_when_added():
    s = _no_chunking()
    s.add_request(Request("ok", list(range(8)), max_tokens=9))  # 8 + 8 generated = 16: fits a step when recomputed
    with pytest.raises(InvalidArgumentError, match=r"request 'long'.*need 17 tokens at once .* is 16") as info:
        s.add_request(Request("long", list(range(100, 108)), max_tokens=10))
    assert isinstance(info.value, TieredKVError)
    assert list(s.requests) == ["ok"] and [r.request_id for r in s.waiting] == ["ok"] and "long" not in s.status


def test_without_chunked_prefill_a_recompute_victim_as_long_as_the_budget_is_scheduled_again():
    # 7 usable blocks: A and B (8-token prompts, 9 tokens each to generate) outgrow them together,
    # so B is recomputed late; back, it prefills its prompt and what it generated in one step.
    s = _no_chunking(gpu=8)
    for i, rid in enumerate("AB"):
        s.add_request(Request(rid, list(range(10 * i, 10 * i + 8)), max_tokens=9, arrival_time=float(i)))
    longest = 0
    for _ in range(100):
        if not s.num_unfinished:
            break
        out = s.schedule()
        longest = max([longest] + [n for _, n in out.scheduled])
        s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
    assert s.num_unfinished == 0 and s.tm.counters.preemptions_recompute >= 1 and 8 < longest <= 16
