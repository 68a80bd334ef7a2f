"""A victim policy of one's own: an instance, a registered name or a qualified class name, taken alike everywhere.

``SchedulerConfig``, ``EngineConfig`` and a simulator run's ``victim_policy:``
all resolve a policy the same way (``tiered_kv.manager.victim_policy``); the
policy here (``victim_policy_first.FirstAdmittedPolicy``) preempts the first
admitted first, so its victims differ from vLLM's order on the same run.
"""

from __future__ import annotations

import pytest
import simutil
from engine_configs import engine_config
from poolutil import letters
from victim_policy_first import FirstAdmittedPolicy, NotAPolicy

from tiered_kv.core import Request
from tiered_kv.engine.engine_config import EngineConfig
from tiered_kv.errors import ConfigError, InvalidArgumentError
from tiered_kv.manager import (
    VICTIM_POLICIES,
    CostAwarePolicy,
    CostModel,
    ManagerConfig,
    PreemptMode,
    TierManager,
    VictimPolicy,
    get_victim_policy,
    register_victim_policy,
)
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.transfer import ControlledCopyEngine

R = PreemptMode.RECOMPUTE
QUALIFIED = "victim_policy_first.FirstAdmittedPolicy"


@pytest.fixture
def registry():
    """The registry as it was, restored after the test (registration is process-wide)."""
    saved = dict(VICTIM_POLICIES)
    yield VICTIM_POLICIES
    VICTIM_POLICIES.clear()
    VICTIM_POLICIES.update(saved)


def victims(victim_policy) -> list:
    """The victims of four 8-token requests on a 12-block pool, by recompute (see test_scheduler's FCFS case)."""
    eng = ControlledCopyEngine({"GPU": 13, "CPU": 2})
    tm = TierManager(ManagerConfig(13, 0, 4), eng, cost_model=CostModel(kv_bytes_per_token=8, block_size=4))
    s = Scheduler(tm, SchedulerConfig(mode="recompute", victim_policy=victim_policy))
    for i, rid in enumerate("ABCD"):
        s.add_request(Request(rid, letters("abcdefgh"[i:] + "abcdefgh"[:i]), max_tokens=12, arrival_time=float(i)))
    out = []
    while s.num_unfinished:
        step = s.schedule()
        out += step.preempted
        s.update(step, {r.request_id: 1 for r, n in step.scheduled if step.needs_sample(r, n)})
    return out


def test_vllms_order_for_reference():
    assert victims("last_admitted") == [("D", R), ("C", R)]


def test_an_instance_of_ones_own_policy_is_taken_by_the_scheduler_config():
    policy = FirstAdmittedPolicy()
    cfg = SchedulerConfig(victim_policy=policy)
    assert cfg.victim_policy is policy
    # A needs room; as in vLLM's loop the requester is a candidate too, and it is the first admitted.
    assert victims(policy) == [("A", R), ("B", R)]


def test_a_registered_name_is_taken_by_every_config_and_by_the_simulator(registry):
    register_victim_policy("first_admitted", FirstAdmittedPolicy)
    assert victims("first_admitted") == [("A", R), ("B", R)]
    assert (
        EngineConfig(scheduler=SchedulerConfig(victim_policy="first_admitted")).scheduler.victim_policy
        == "first_admitted"
    )
    cfg = simutil.config(  # a small, slow GPU under a queue of 40 requests: there is preemption
        workload__num_requests=40,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 4, "high": 24},
        workload__output_len={"dist": "lognormal", "mean": 6, "sigma": 0.5, "min": 1, "max": 16},
        workload__system_prompts={"count": 2, "length": 8, "zipf": 1.0, "share": 0.6},
        workload__multi_turn={"prob": 0.4, "max_turns": 2},
        memory__gpu_kv_gib=24 * simutil.KIB_IN_GIB,
        compute__fixed_step_s=None,
        compute__step_overhead_s=0.01,
        hardware=dict(simutil.TINY["hardware"], peak_bf16_flops=1.0e9, hbm_bytes_per_s=1.0e8),
        runs=[{"name": "mine", "victim_policy": "first_admitted", "mode": "recompute", "cpu_kv_gib": 0}],
    )
    FirstAdmittedPolicy.keyed = 0
    res, _ = simutil.run(cfg)
    assert res["preemptions_recompute"] > 0 and res["victim_policy"] == "first_admitted"
    assert FirstAdmittedPolicy.keyed > 0, "the simulated run never asked the registered policy"


def test_a_qualified_class_name_is_taken_without_registration(registry):
    assert "first_admitted" not in registry
    assert victims(QUALIFIED) == [("A", R), ("B", R)]
    assert EngineConfig(scheduler=SchedulerConfig(victim_policy=QUALIFIED)).scheduler.victim_policy == QUALIFIED
    simutil.config(runs=[{"name": "mine", "victim_policy": QUALIFIED}])  # a run validates it, importing the module


def test_a_registered_policy_built_from_a_name_gets_the_cost_model(registry):
    class Cheapest(CostAwarePolicy):
        name = "cheapest"

    register_victim_policy("cheapest", Cheapest)
    cm = CostModel(kv_bytes_per_token=8, block_size=4)
    built = get_victim_policy("cheapest", cm)
    assert type(built) is Cheapest and built.cost_model is cm
    assert type(get_victim_policy(QUALIFIED, cm)) is FirstAdmittedPolicy  # built with cls(): it needs no model


@pytest.mark.parametrize(
    ("name", "cls", "message"),
    [
        ("last_admitted", FirstAdmittedPolicy, "victim policy 'last_admitted' is already registered"),
        ("lru", FirstAdmittedPolicy, "victim policy 'lru' is a retired name"),
        ("my.policy", FirstAdmittedPolicy, "name must be a non-empty str without dots"),
        ("", FirstAdmittedPolicy, "name must be a non-empty str without dots"),
        (None, FirstAdmittedPolicy, "name must be a non-empty str without dots"),
        ("mine", NotAPolicy, "cls must be a subclass of VictimPolicy"),
        ("mine", FirstAdmittedPolicy(), "cls must be a subclass of VictimPolicy"),
        ("mine", VictimPolicy, "cls must be a subclass of VictimPolicy"),
    ],
)
def test_a_bad_registration_is_refused_and_registers_nothing(registry, name, cls, message):
    before = dict(registry)
    with pytest.raises(InvalidArgumentError, match=message):
        register_victim_policy(name, cls)
    assert registry == before


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("first_admitted", r"victim_policy: unknown victim policy 'first_admitted'; the victim policies are \["),
        ("victim_policy_first.NotAPolicy", "victim_policy: victim_policy_first.NotAPolicy is not a subclass of"),
        ("no_such_module.Policy", "victim_policy: cannot import module 'no_such_module'"),
        (FirstAdmittedPolicy, "victim_policy: must be a victim policy name or a VictimPolicy instance"),
        (3, "victim_policy: must be a victim policy name or a VictimPolicy instance"),
    ],
)
def test_what_names_no_policy_is_refused_by_the_configs(value, message):
    with pytest.raises(InvalidArgumentError, match=message):
        SchedulerConfig(victim_policy=value)
    with pytest.raises(InvalidArgumentError, match=message):
        engine_config(victim_policy=value)


def test_the_simulator_refuses_an_unknown_name_and_a_bad_qualified_one():
    with pytest.raises(ConfigError, match=r"runs\[0\]\.victim_policy: must be one of .* register_victim_policy"):
        simutil.config(runs=[{"name": "x", "victim_policy": "first_admitted"}])
    with pytest.raises(ConfigError, match=r"runs\[0\]\.victim_policy: cannot import module 'no_such_module'"):
        simutil.config(runs=[{"name": "x", "victim_policy": "no_such_module.Policy"}])


def test_a_registered_name_is_still_no_scheduling_order(registry):
    register_victim_policy("first_admitted", FirstAdmittedPolicy)
    with pytest.raises(InvalidArgumentError, match="policy: 'first_admitted' is not a scheduling order"):
        SchedulerConfig(policy="first_admitted")
    register_victim_policy("priority", FirstAdmittedPolicy)  # a victim policy may share a scheduling order's name
    assert SchedulerConfig(policy="priority", victim_policy="priority").policy == "priority"
