"""Victim policies inside vLLM 0.33's real scheduler, and the checks that catch a change in vLLM's internals.

The plug-in reaches vLLM's inline victim pick through private internals of
0.33.0 (tests/vllm_preempt_env.py drives the real scheduler).  So these run in CI:

* with ``last_admitted`` (vLLM's own order) every step is identical to vLLM's own
  scheduler's: scheduled tokens, preemptions, blocks, transfer jobs;
* every victim a policy chose is the request vLLM preempted, under FCFS and
  priority scheduling, with and without async scheduling;
* each policy picks, on a hand-built case, the request its docstring names;
* priority semantics and async scheduling's deferred block frees are respected.
"""

from __future__ import annotations

import random

import pytest
from vllm_env import PROBLEM, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm_preempt_env import Rig, extra_config, oversubscribed_stream

    from tiered_kv.integrations.vllm import TieredKVAsyncScheduler, TieredKVScheduler
    from tiered_kv.manager.states import PreemptMode
    from tiered_kv.manager.victim_policy import VICTIM_POLICIES, VictimPolicy, register_victim_policy

POLICIES = ("last_admitted", "largest", "prefill_aware", "cost_aware")
COSTS = {"prefill_tokens_per_s": 2000, "d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 1e9}


def stream_rig(scheduler_cls: type, preemption: dict | None, blocks: int = 32, **kw) -> Rig:
    rig = Rig.build(scheduler_cls, extra_config(preemption), blocks, **kw)
    oversubscribed_stream(rig, priorities=kw.get("policy") == "priority")
    rig.run()
    return rig


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("connector", ["TieredKVConnector", None], ids=["connector", "no-connector"])
def test_last_admitted_gives_the_same_steps_as_vllms_own_scheduler(
    connector: str | None, policy: str, async_scheduling: bool
) -> None:
    kw = dict(connector=connector, policy=policy, async_scheduling=async_scheduling)
    ours = stream_rig(TieredKVScheduler, {"mode": "recompute", "victim_policy": "last_admitted"}, **kw)
    theirs = stream_rig(Scheduler, None, **kw)
    assert type(ours.scheduler) is (TieredKVAsyncScheduler if async_scheduling else TieredKVScheduler)
    assert any(s.preempted for s in theirs.steps)  # the stream does preempt
    assert ours.steps == theirs.steps
    assert [d.victim for d in ours.scheduler.decisions] == [v for s in theirs.steps for v in s.preempted]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("victim_policy", POLICIES)
def test_every_victim_the_policy_chose_is_the_one_vllm_preempted(
    victim_policy: str, policy: str, async_scheduling: bool
) -> None:
    rig = stream_rig(
        TieredKVScheduler,
        {"mode": "auto", "victim_policy": victim_policy, "cost_model": COSTS},
        policy=policy,
        async_scheduling=async_scheduling,
    )
    sched = rig.scheduler
    decisions = list(sched.decisions)
    assert decisions, "the stream preempts"
    assert sched.victim_mismatches == 0
    assert [d.victim for d in decisions] == [d.chosen for d in decisions]
    assert rig.hazards == [] and all(r.bytes_equal for r in rig.resumes)
    preempted_at = [(k, v) for k, s in enumerate(rig.steps) for v in s.preempted]
    assert [v for _, v in preempted_at] == [d.victim for d in decisions]
    for (k, _), d in zip(preempted_at, decisions, strict=True):
        if policy == "priority":  # never a request of a higher priority than the one that needed room
            needer, victim = rig.added[d.needed_by], rig.added[d.victim]
            assert (victim.priority, victim.arrival_time) >= (needer.priority, needer.arrival_time), d
        if async_scheduling:  # vLLM may not free the blocks of a request whose last step is still in flight
            assert k == 0 or d.victim not in rig.steps[k - 1].scheduled, d


# ---------------------------------------------------------------- a hand-built case
# Five requests, admitted A, B, C, D, E into a 34-block pool, prefill chunks of 4 tokens.
# B shares A's first 5 blocks; D is still in its prefill.  A's next token needs a new block
# when the pool is full, so vLLM preempts one of B..E (those after A in the running queue).
HAND_COSTS = {"prefill_tokens_per_s": 1000, "prefill_overhead_s": 1.0}


def hand_built(victim_policy: object) -> tuple[Rig, dict[str, tuple[int, int, int, int]]]:
    rnd = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rnd.randint(3, 999) for _ in range(n)]

    a = tokens(95)
    prompts = {"A": a, "B": a[:80] + tokens(60), "C": tokens(17), "D": tokens(200), "E": tokens(33)}
    preemption = {"mode": "recompute", "victim_policy": victim_policy, "cost_model": HAND_COSTS}
    rig = Rig.build(TieredKVScheduler, extra_config(preemption), 34, max_num_batched_tokens=64, long_prefill=4)
    rig.add("A", prompts["A"], 200)
    rig.step()
    rig.add("B", prompts["B"], 200)
    rig.step()
    rig.step()
    for rid in "CDE":
        rig.add(rid, prompts[rid], 200)
    sched = rig.scheduler
    for _ in range(100):
        facts = {}  # request -> (GPU blocks, blocks it alone holds, computed tokens, prompt tokens)
        for r in sched.running:
            blocks = sched.kv_cache_manager.get_blocks(r.request_id).blocks[0]
            alone = sum(1 for b in blocks if b.ref_cnt == 1)
            facts[r.request_id] = (len(blocks), alone, r.num_computed_tokens, r.num_prompt_tokens)
        rig.step()
        if sched.decisions:
            return rig, facts
    raise AssertionError("no preemption")


@pytest.mark.parametrize(
    ("victim_policy", "victim"),
    [
        ("last_admitted", "E"),  # the last admitted, vLLM's own choice
        ("largest", "B"),  # most GPU blocks: 11
        ("prefill_aware", "C"),  # D is mid-prefill; of B, C, E the least computed work: 51 tokens
        ("cost_aware", "D"),  # least recompute time per block freed: (1 s + 156 / 1000) / 10
    ],
)
def test_each_policy_picks_the_request_its_docstring_names(victim_policy: str, victim: str) -> None:
    rig, facts = hand_built(victim_policy)
    assert facts == {
        "A": (8, 4, 128, 95),
        "B": (11, 7, 162, 140),
        "C": (4, 4, 51, 17),
        "D": (10, 10, 156, 200),
        "E": (4, 4, 63, 33),
    }
    (d,) = rig.scheduler.decisions
    assert (d.needed_by, d.vllm_choice, d.chosen, d.victim, d.mode) == ("A", "E", victim, victim, PreemptMode.RECOMPUTE)
    quote = d.quote
    assert quote is not None and quote.blocks_freed == facts[victim][1] and quote.num_tokens == facts[victim][2]


class SmallestFirst(VictimPolicy if PROBLEM is None else object):  # type: ignore[misc]
    """A user's own policy: fewest GPU blocks first, the earliest admitted among equals."""

    name = "smallest_first"

    def key(self, c, mode):
        return (c.num_gpu_blocks, c.rank)


def test_a_users_own_policy_as_an_instance_a_registered_name_or_a_qualified_class_name() -> None:
    if "smallest_first" not in VICTIM_POLICIES:
        register_victim_policy("smallest_first", SmallestFirst)
    instance = SmallestFirst()
    for given in (instance, "smallest_first", f"{__name__}.SmallestFirst"):
        rig, _ = hand_built(given)
        policy = rig.scheduler.preemption.victim_policy
        assert type(policy) is SmallestFirst and (policy is instance) == (given is instance)
        (d,) = rig.scheduler.decisions
        assert (d.chosen, d.victim) == ("C", "C")  # C and E hold 4 blocks each, C was admitted first
