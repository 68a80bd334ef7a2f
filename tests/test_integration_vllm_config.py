"""The vLLM integration's configuration: a misspelled key is refused, naming it and the known ones (vLLM's too).

vLLM 0.33 ignores every ``kv_connector_extra_config`` key it does not read, so
``"eviction_polcy": "arc"`` used to run plain vLLM without a word, and a
misspelled tier key reached a constructor as a bare ``TypeError``.  Each case
is refused with a ``ConfigError`` before anything is built.
"""

from __future__ import annotations

import pytest
from vllm_env import PROBLEM, offloading_config, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm_preempt_env import Rig, extra_config

    from tiered_kv.errors import ConfigError
    from tiered_kv.integrations.vllm import TieredKVOffloadingSpec, TieredKVScheduler
    from tiered_kv.integrations.vllm.extra_config import VLLM_OFFLOADING_KEYS

SPEC = {"spec_name": "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm"}


def build_spec(**extra) -> TieredKVOffloadingSpec:
    return OffloadingSpecFactory.create_spec(offloading_config({**SPEC, "cpu_bytes_to_use": 8 * 4096, **extra}))


@pytest.mark.parametrize(
    ("key", "near"),
    [("eviction_polcy", "eviction_policy"), ("load_pricng", "load_pricing"), ("preemtion", "preemption")],
)
def test_a_misspelled_top_level_key_is_refused_with_the_known_ones(key: str, near: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_spec(**{key: {"prefill_tokens_per_s": 1} if "pric" in key else "arc"})
    message = str(err.value)
    assert f"unknown key(s) [{key!r}]" in message and f"did you mean {near!r}?" in message
    for known in ("cpu_bytes_to_use", "eviction_policy", "offload_prompt_only", "load_pricing", "preemption"):
        assert repr(known) in message  # vLLM's keys are listed as known, and tiered_kv's


def test_every_key_vllm_reads_is_accepted() -> None:
    spec = build_spec(
        eviction_policy="arc",
        offload_prompt_only=False,
        self_describing_kv_events=False,
        blocks_per_chunk=1,
        canonical_layout=False,
        sync_load_budget_bytes=0,
        store_threshold=0,
        max_tracker_size=1000,
        preemption={"mode": "swap", "victim_policy": "largest"},
    )
    assert type(spec) is TieredKVOffloadingSpec
    assert {"spec_name", "cpu_bytes_to_use", "eviction_policy", "sync_load_budget_bytes"} <= VLLM_OFFLOADING_KEYS


@pytest.mark.parametrize(
    ("preemption", "match"),
    [
        ({"mood": "swap"}, r"preemption: unknown key\(s\) \['mood'\] \('mood': did you mean 'mode'\?\)"),
        ({"mode": "swapp"}, r"preemption.mode: 'swapp' is not one of \['swap', 'recompute', 'auto'\]"),
        (
            {"victim_policy": "largets"},
            r"preemption.victim_policy: unknown victim policy 'largets'; the victim policies"
            r" are \['cost_aware', 'largest', 'last_admitted', 'prefill_aware'\].* \(did you mean 'largest'\?\)",
        ),
        ({"victim_policy": "lru"}, r"unknown victim policy 'lru'; it is now called 'last_admitted'"),
        ({"victim_policy": "no_such_module.Policy"}, r"cannot import module 'no_such_module' for victim policy"),
        ({"victim_policy": "collections.OrderedDict"}, r"collections.OrderedDict is not a subclass of VictimPolicy"),
        ({"cost_model": {"prefill_tokns_per_s": 1}}, r"preemption.cost_model: unknown key\(s\) \['prefill_tokns"),
        ({"cost_model": {"prefill_tokens_per_s": -1}}, r"preemption.cost_model: cost model: prefill_tokens_per_s"),
        ({"mode": "auto"}, r"preemption.cost_model.prefill_tokens_per_s is required: mode 'auto'"),
        ({"victim_policy": "cost_aware"}, r"prefill_tokens_per_s is required: cost_aware ranks by cost"),
        ("swap", r"preemption must be an object"),
    ],
)
def test_a_bad_preemption_object_is_refused_when_vllm_builds_the_spec(preemption: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_spec(preemption=preemption)


def test_swaps_need_tiered_kvs_connector_and_recompute_on_load_failure() -> None:
    rig_config = extra_config({"mode": "swap"})
    with pytest.raises(ConfigError, match=r"through tiered_kv's connector.*the connector is 'OffloadingConnector'"):
        Rig.build(TieredKVScheduler, rig_config, 16, connector="OffloadingConnector")
    with pytest.raises(ConfigError, match=r'needs "kv_load_failure_policy": "recompute".*it is \'fail\''):
        Rig.build(TieredKVScheduler, rig_config, 16, failure_policy="fail")


def test_swaps_without_a_preemption_object_change_nothing() -> None:
    """No ``preemption`` object: vLLM's own preemption (recompute, the last admitted)."""
    rig = Rig.build(TieredKVScheduler, extra_config(None), 16)
    assert rig.scheduler.preemption.mode == "recompute"
    assert rig.scheduler.preemption.victim_policy.name == "last_admitted"
    assert type(Rig.build(Scheduler, extra_config(None), 16).scheduler) is Scheduler


def test_a_misspelled_tier_key_is_refused_with_the_known_ones_and_nothing_is_created(tmp_path) -> None:
    root = tmp_path / "kv"
    tier = {"type": "DiskTier", "module_path": "tiered_kv.integrations.vllm", "root": str(root)}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * 4096}
    cases = [
        (
            {**tier, "capacity_bytes": 1 << 20, "fsynk": "data"},
            r"unknown key\(s\) \['fsynk'\] \('fsynk': did you mean 'fsync'\?\)",
        ),
        ({**tier, "capcity_bytes": 1 << 20}, r"unknown key\(s\) \['capcity_bytes'\]"),
        (tier, r"missing required key\(s\) \['capacity_bytes'\]; the known keys are \['capacity_bytes', 'fault_hook'"),
    ]
    for entry, match in cases:
        spec = OffloadingSpecFactory.create_spec(
            offloading_config({**extra, "secondary_tiers": [entry]}, kv_bytes_per_block=4096)
        )
        with pytest.raises(ConfigError, match=match):
            spec.get_manager()
        assert not root.exists()


def test_a_misspelled_top_level_key_beside_tiered_kvs_tiers_is_refused(tmp_path) -> None:
    tier = {"type": "DiskTier", "module_path": "tiered_kv.integrations.vllm", "root": str(tmp_path / "kv")}
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4 * 4096, "tier_pol_interval_s": 0}
    spec = OffloadingSpecFactory.create_spec(
        offloading_config({**extra, "secondary_tiers": [{**tier, "capacity_bytes": 1 << 20}]}, kv_bytes_per_block=4096)
    )
    with pytest.raises(ConfigError, match=r"did you mean 'tier_poll_interval_s'\?.*'secondary_tiers'"):
        spec.get_manager()
