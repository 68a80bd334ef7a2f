"""``tiered-kv validate`` for measurements under memory pressure: per-stage means, servers pooled
behind a router, and the direction of a change (a CPU tier, more load) against the published one."""

import copy

import pytest
import yaml
from simutil import TINY

from tiered_kv.errors import ConfigError
from tiered_kv.sim.validate import Point, Predictor, run_validation, table, validation_files

SHARED = {
    "systems": 4,
    "users_per_system": 1,
    "system_len": 3,
    "question_len": 1,
    "output_len": 2,
    "stages": [[0.5, 4], [0.5, 4]],
}


def pressure_file(tmp_path, points, **top):
    raw = copy.deepcopy(TINY)
    raw["workload"] = {"shared_prefix": dict(SHARED)}
    raw["runs"] = [{"name": "one", "mode": "recompute", "cpu_kv_gib": 0}]
    raw.update(top)
    raw["points"] = points
    p = tmp_path / "pressure.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def point(pid, published, **kw):
    return {"id": pid, "metric": "e2e_mean_s", "published": published, "source": "by hand", **kw}


def test_stage_means_and_the_direction_of_each_change(tmp_path):
    # TINY, synchronous: a request sent at an integer second is admitted at the step boundary and
    # runs two 1 s steps (prefill with its first token, then its second token): E2E 2 s, TTFT 1 s.
    # At 2 s a step: TTFT 2 s, E2E 4 s, ITL 2000 ms.  Stage 0 sends at 0 and 2, stage 1 at 4 and 6.
    slow = {"compute.fixed_step_s": 2.0}
    pts = [
        point("one-s0", 2.0, run="one", stage=0),
        point("slow-s0", 5.0, run="one", stage=0, vs="one-s0", overrides=slow),  # published slower too
        point("one-s1", 1.0, run="one", stage=1, vs="one-s0"),  # published faster, predicted equal
        {"id": "ttft", "metric": "ttft_mean_s", "run": "one", "published": 1.0, "source": "s"},
        {"id": "itl", "metric": "itl_mean_ms", "run": "one", "published": 2000.0, "source": "s", "overrides": slow},
    ]
    points = run_validation(validation_files([str(pressure_file(tmp_path, pts))]))
    got = {p.id: (round(p.predicted, 9), p.ok, p.direction) for p in points}
    assert got == {
        "one-s0": (2.0, True, None),
        "slow-s0": (4.0, False, True),  # 0.8 of the published: outside the default ±15%, the right way
        "one-s1": (2.0, False, False),
        "ttft": (1.0, True, None),
        "itl": (2000.0, True, None),
    }
    text = table(points)
    assert "e2e_mean_s@0" in text and "same #1" in text and "REV #1" in text
    assert "the same as published in 1 of 2 pairs" in text


def test_a_published_change_of_none_is_matched_by_a_predicted_change_within_tolerance():
    base = Point("f", {"published": 10.0, "tolerance": 0.15, "metric": "m"}, predicted=10.0)
    flat = Point("f", {"published": 10.0, "tolerance": 0.15, "metric": "m"}, predicted=11.0, base=base)
    moved = Point("f", {"published": 10.0, "tolerance": 0.15, "metric": "m"}, predicted=12.0, base=base)
    assert (flat.direction, moved.direction) == (True, False)


def test_pooled_servers_each_simulate_their_share_and_the_points_read_them_all(tmp_path):
    top = {"pool_replicas": True}
    pts = [point("all", 2.0, run="one")]
    f = pressure_file(tmp_path, pts, **top)
    raw = yaml.safe_load(f.read_text())
    raw["workload"]["shared_prefix"].update(replicas=2, replica=0)
    f.write_text(yaml.safe_dump(raw))
    (vf,) = validation_files([str(f)])
    pred = Predictor()
    run_validation([vf], pred)
    # Four requests in all (two stages of two); systems 0 and 2 on server 0, 1 and 3 on server 1.
    assert sorted(r.arrival for r in pred.requests(vf, None)["one"]) == [0.0, 2.0, 4.0, 6.0]
    assert pred.simulations == 2  # two servers x one run


def test_a_model_profile_runs_at_another_tensor_parallel_degree(tmp_path):
    f = pressure_file(tmp_path, [point("x", 2.0, run="one")], model={"profile": "qwen3-32b", "tensor_parallel": 2})
    (vf,) = validation_files([str(f)])
    assert vf.raw["model"]["tensor_parallel"] == 2 and vf.raw["model"]["num_layers"] == 64


@pytest.mark.parametrize(
    ("points", "top", "message"),
    [
        ([point("a", 1.0, vs="b")], {}, r"points\[0\]\.vs: no other point 'b'"),
        ([point("a", 1.0), {**point("b", 1.0, vs="a"), "metric": "ttft_mean_s"}], {},
         r"points\[1\]\.vs: 'a' must publish the same metric"),
        ([{**point("a", 1.0), "metric": "tpot_p50_ms", "stage": 0}], {}, r"points\[0\]\.stage: only the means"),
        ([{**point("a", 1.0), "metric": "tpot_p50_ms"}], {"pool_replicas": True}, r"points\[0\]\.metric"),
        ([point("a", 1.0)], {"pool_replicas": "yes"}, r"pressure\.pool_replicas: expected true or false"),
        ([point("a", 1.0)], {"model": {"profile": "qwen3-32b", "num_layers": 2}},
         r"pressure\.model\.num_layers: a profile variant takes only"),
    ],
)  # fmt: skip
def test_bad_pressure_points_name_the_key(tmp_path, points, top, message):
    with pytest.raises(ConfigError, match=message):
        validation_files([str(pressure_file(tmp_path, points, **top))])


def test_a_stage_the_workload_does_not_have_is_refused(tmp_path):
    f = pressure_file(tmp_path, [point("a", 1.0, run="one", stage=2)])
    with pytest.raises(ConfigError, match=r"a\.stage: the workload has stages 0 to 1, got 2"):
        run_validation(validation_files([str(f)]))


def test_stages_that_have_not_drained_before_the_next_starts_are_refused(tmp_path):
    # 3 s a step, synchronous: stage 0 sends at 0 and 2; the second waits for the step boundary at
    # 3 s and finishes at 9 s, after stage 1 (gap 0.5 s) started at 4.5 s.  With a gap of 10 s,
    # stage 1 sends at 14 and 16 s onto an idle server: E2E 6 s (two steps) and 7 s (it waits 1 s
    # for the step in flight).
    f = pressure_file(tmp_path, [point("a", 1.0, run="one", stage=1, overrides={"compute.fixed_step_s": 3.0})])
    raw = yaml.safe_load(f.read_text())
    raw["workload"]["shared_prefix"]["stage_gap_s"] = 0.5
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(
        ConfigError, match=r"stage 0's last request finished at 9\.0 s, after stage 1 started at 4\.5 s"
    ):
        run_validation(validation_files([str(f)]))
    raw["workload"]["shared_prefix"]["stage_gap_s"] = 10
    f.write_text(yaml.safe_dump(raw))
    (p,) = run_validation(validation_files([str(f)]))
    assert p.predicted == 6.5
