"""The shared-prefix workload as inference-perf sends it: shuffled prompts, stages that start over,
Poisson seconds, gaps between stages, and a prefix-aware router's share of the load."""

import pytest
from simutil import KIB_IN_GIB, config, run

from tiered_kv.errors import ConfigError
from tiered_kv.sim import shared_prefix
from tiered_kv.sim.workload import generate, size

SPEC = {
    "systems": 4,
    "users_per_system": 1,
    "system_len": 8,
    "question_len": 1,
    "output_len": 1,
    "stages": [[1, 2], [1, 2]],
}


def sent(spec):
    """(send time, prompt) of every request of a section."""
    return [(r.arrival, r.conversation) for r in generate(config(workload__shared_prefix=spec)["workload"], 0)]


def test_a_stage_that_starts_over_sends_the_prompts_of_the_stages_before_it_again():
    # Four prompts, two stages of two requests: by default the second stage goes on with prompts 2
    # and 3; inference-perf's client asks its generator anew in every stage, so it sends 0 and 1 again.
    assert sent(SPEC) == [(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 3)]
    assert sent(dict(SPEC, restart_each_stage=True)) == [(0.0, 0), (1.0, 1), (2.0, 0), (3.0, 1)]


def test_shuffled_prompts_follow_one_seeded_permutation_that_every_stage_starts_from():
    spec = dict(SPEC, users_per_system=2, order="shuffled", stages=[[1, 8], [1, 3]], restart_each_stage=True)
    # random.Random(0).shuffle(list(range(8))): one permutation, each prompt once per cycle of eight.
    assert [p for _, p in sent(spec)] == [4, 1, 5, 2, 0, 3, 7, 6, 4, 1, 5]
    assert [p for _, p in sent(dict(spec, seed=1))] == [3, 6, 1, 5, 7, 0, 4, 2, 3, 6, 1]


def test_stages_stand_apart_by_their_gap_and_requests_belong_to_the_stage_they_were_sent_in():
    spec = dict(SPEC, stage_gap_s=10)
    assert [t for t, _ in sent(spec)] == [0.0, 1.0, 12.0, 13.0]
    stages = shared_prefix.parse(spec)["stages"]
    assert shared_prefix.stage_starts(stages, 10) == [0.0, 12.0]
    assert [shared_prefix.stage_of(t, stages, 10) for t in (0.0, 1.9, 11.0, 12.0, 40.0)] == [0, 0, 0, 1, 1]


def test_poisson_seconds_are_inference_perfs_and_the_stage_sends_rate_times_duration():
    spec = dict(SPEC, stages=[[3, 4]], arrival="poisson")
    times = [t for t, _ in sent(spec)]
    assert len(times) == 12 and times == sorted(times)
    # Each non-empty second's gaps are scaled to sum to that second: its last request falls on its end.
    ends = [t for t in times if abs(t - round(t)) < 1e-9]
    assert ends and all(t > 0 for t in ends)
    assert times == [t for t, _ in sent(spec)]  # seeded: the same every time
    assert times != [t for t, _ in sent(dict(spec, seed=1))]


def test_inference_perfs_constant_timer_draws_the_gaps_and_ends_the_stage_on_its_last_request():
    spec = dict(SPEC, stages=[[2, 5], [1, 2]], arrival="constant")
    times = [t for t, _ in sent(spec)]
    # Ten requests in stage 0, scaled to end exactly at 5 s; two in stage 1, the last at 7 s.
    assert len(times) == 12 and times == sorted(times)
    assert times[9] == pytest.approx(5.0) and times[11] == pytest.approx(7.0)
    assert times[:10] != [k / 2 for k in range(1, 11)]  # drawn, not even
    assert [t for t, _ in sent(dict(spec, arrival="even"))] == [0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6]


def test_a_router_gives_each_server_the_prompts_of_its_system_prompts():
    spec = dict(SPEC, users_per_system=2, stages=[[1, 8]], replicas=2, replica=1)
    # Systems 1 and 3 (prompts 2, 3, 6, 7) go to server 1, at the client's own send times.
    assert sent(spec) == [(2.0, 2), (3.0, 3), (6.0, 6), (7.0, 7)]
    assert size(config(workload__shared_prefix=spec)["workload"]).requests == 4


def test_a_prompt_sent_again_in_the_next_stage_is_found_in_the_cpu_tier():
    # TINY: 4-token blocks, 1 KiB each; a GPU pool of 4 blocks, a CPU tier of 64.  A prompt is 9
    # tokens (its system prompt's two full blocks, then a partial one): the GPU keeps the last
    # prompt it computed, the CPU tier every full block.  Started over, the second stage sends prompts
    # 0 and 1 again, and their system prompts (2 x 8 of the 4 x 9 prompt tokens of the run) come from
    # the CPU tier.  Going on (the default), it sends prompts 2 and 3 for the first time: nothing to find.
    spec = dict(SPEC, stages=[[1, 2], [1, 2]])
    tier = {"victim_policy": "last_admitted", "mode": "recompute", "offload": "write_through", "name": "cpu"}
    kw = {"runs": [tier], "memory__cpu_kv_gib": 64 * KIB_IN_GIB, "memory__gpu_kv_gib": 4 * KIB_IN_GIB}
    again, _ = run(config(workload__shared_prefix=dict(spec, restart_each_stage=True), **kw))
    on, _ = run(config(workload__shared_prefix=spec, **kw))
    assert (again["gpu_prefix_hit_rate"], again["cpu_prefix_hit_rate"]) == (0.0, 16 / 36)
    assert (on["gpu_prefix_hit_rate"], on["cpu_prefix_hit_rate"]) == (0.0, 0.0)


def test_shuffled_prompts_come_back_after_the_gpu_dropped_their_system_prompt_and_the_cpu_tier_finds_it():
    # Why a CPU tier gains under light load: two system prompts of two users each, a GPU pool of 4
    # blocks (one prompt's two system-prompt blocks and its partial block), a CPU tier of 64.
    # Grouped (request j sends prompt j), the second user of a system prompt follows the first, and
    # the GPU prefix cache finds its 8 system-prompt tokens: the CPU tier finds nothing more.
    # inference-perf shuffles the prompt list (seed 1: prompts 3, 0, 2, 1, of systems 1, 0, 1, 0), so
    # every request's system prompt was dropped from the GPU by the one before it: the GPU finds
    # nothing, the CPU tier both second users' system prompts (2 x 8 of the 4 x 9 prompt tokens).
    spec = dict(SPEC, systems=2, users_per_system=2, stages=[[0.25, 16]], seed=1)
    hbm = {"victim_policy": "last_admitted", "mode": "recompute", "offload": "none", "name": "hbm", "cpu_kv_gib": 0}
    tier = {"victim_policy": "last_admitted", "mode": "recompute", "offload": "write_through", "name": "cpu"}
    kw = {"runs": [hbm, tier], "memory__cpu_kv_gib": 64 * KIB_IN_GIB, "memory__gpu_kv_gib": 4 * KIB_IN_GIB}
    hit = {}
    for order in ("grouped", "shuffled"):
        cfg = config(workload__shared_prefix=dict(spec, order=order), **kw)
        assert [p for _, p in sent(dict(spec, order=order))] == ([0, 1, 2, 3] if order == "grouped" else [3, 0, 2, 1])
        for i in (0, 1):
            res, _ = run(cfg, i)
            hit[order, res["run"]] = (res["gpu_prefix_hit_rate"], res["cpu_prefix_hit_rate"])
    assert hit == {
        ("grouped", "hbm"): (16 / 36, 0.0),
        ("grouped", "cpu"): (16 / 36, 0.0),
        ("shuffled", "hbm"): (0.0, 0.0),
        ("shuffled", "cpu"): (0.0, 16 / 36),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"replicas": 2, "replica": 2}, r"workload\.shared_prefix\.replica: must be below replicas \(2\)"),
        ({"order": "random"}, r"workload\.shared_prefix\.order"),
        ({"arrival": "bursty"}, r"workload\.shared_prefix\.arrival"),
        ({"stage_gap_s": -1}, r"workload\.shared_prefix\.stage_gap_s"),
        ({"restart_each_stage": 1}, r"workload\.shared_prefix\.restart_each_stage"),
    ],
)
def test_bad_client_settings_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        config(workload__shared_prefix=dict(SPEC, **change))
