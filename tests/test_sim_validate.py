"""``tiered-kv validate``: points, tolerance, shapes, reasons, bad point specs, and the shipped configs."""

import copy
import json

import pytest
import yaml
from simutil import TINY

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.fit import _from_unit, _to_unit, nelder_mead
from tiered_kv.sim.shipped import shipped_names
from tiered_kv.sim.validate import run_validation, table, validation_files


def tiny_file(tmp_path, points):
    raw = copy.deepcopy(TINY)
    raw["runs"] = [
        {"name": "one", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "two", "mode": "recompute", "cpu_kv_gib": 0},
    ]
    raw["points"] = points
    p = tmp_path / "tiny-check.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


POINTS = [
    # TINY: every step takes 1 s, two requests of 2 output tokens: TPOT 1000 ms.
    {"id": "tpot", "metric": "tpot_p50_ms", "run": "one", "published": 1000.0, "source": "by hand"},
    {"id": "tpot-off", "metric": "tpot_p50_ms", "run": "one", "published": 800.0, "source": "a paper", "reason": "why"},
    {"id": "ratio", "metric": "e2e_p50_ms", "run": "two", "relative_to": "one", "expect": {"min": 0.99, "max": 1.01},
     "source": "shape"},
    {"id": "shape-wrong", "metric": "e2e_p50_ms", "run": "two", "relative_to": "one", "expect": {"min": 1.5},
     "source": "shape"},
    {"id": "faster", "metric": "tpot_p50_ms", "overrides": {"compute.fixed_step_s": 0.5}, "published": 500.0,
     "fit": True, "source": "by hand"},
]  # fmt: skip


def test_points_are_predicted_compared_and_explained(tmp_path):
    points = run_validation(validation_files([str(tiny_file(tmp_path, POINTS))]))
    got = {p.id: (round(p.predicted, 6), p.ok) for p in points}
    assert got == {
        "tpot": (1000.0, True),
        "tpot-off": (1000.0, False),  # 1.25 is outside 15%
        "ratio": (1.0, True),
        "shape-wrong": (1.0, False),
        "faster": (500.0, True),
    }
    text = table(points)
    assert "OUTSIDE ±15%: why" in text and "WRONG SHAPE" in text
    assert "[2] a paper" in text and "3/5 points within tolerance" in text
    assert "2/4 of the points not used in any fit" in text


def test_the_gpu_column_names_the_gpu_each_point_runs_on(tmp_path):
    other = dict(TINY["hardware"], name="other-gpu")
    pts = [
        {"id": "base", "metric": "tpot_p50_ms", "run": "one", "published": 1000.0, "source": "s"},
        {"id": "moved", "metric": "tpot_p50_ms", "run": "one", "published": 1000.0, "source": "s",
         "overrides": {"hardware": other}},
    ]  # fmt: skip
    points = run_validation(validation_files([str(tiny_file(tmp_path, pts))]))
    assert [(p.id, p.hardware) for p in points] == [("base", "toy"), ("moved", "other-gpu")]
    rows = table(points).splitlines()
    assert " toy " in rows[2] and " other-gpu " in rows[3]


@pytest.mark.parametrize(
    ("point", "message"),
    [
        ({"id": "x", "metric": "tpot_p50_ms", "source": "s"}, "give either 'published' or 'expect'"),
        ({"id": "x", "metric": "tpot_p50_ms", "published": 1.0, "expect": {"min": 1}, "source": "s"}, "not both"),
        ({"id": "x", "metric": "speed", "published": 1.0, "source": "s"}, r"points\[0\]\.metric: must be one of"),
        ({"id": "x", "kind": "link", "metric": "one_way_gbps", "published": 1.0, "source": "s"}, "bytes_per_copy"),
        ({"id": "x", "metric": "tpot_p50_ms", "published": 1.0}, r"points\[0\]\.source: required key is missing"),
    ],
)
def test_bad_points_name_the_key(tmp_path, point, message):
    with pytest.raises(ConfigError, match=message):
        validation_files([str(tiny_file(tmp_path, [point]))])


def test_every_shipped_validation_config_loads_and_the_link_points_hold():
    names = shipped_names("validation")
    assert {"vllm-paper-fig19", "a100-llama8b-sharegpt-vllm060", "pcie-link", "h100-llama8b-batch1"} <= set(names)
    files = validation_files(names)
    assert all(vf.points for vf in files)
    points = run_validation([vf for vf in files if vf.name == "pcie-link"])
    fitted = [p for p in points if p.spec["fit"]]
    assert fitted and all(p.ok for p in fitted)  # the link model reproduces the numbers it was built from


def test_validate_command_prints_the_table_and_writes_json(tmp_path, capsys):
    f = tiny_file(tmp_path, POINTS[:1])
    assert main(["validate", str(f), "--no-progress", "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "tpot" in out and "1/1 points" in out
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["points"][0]["id"] == "tpot" and doc["points"][0]["ok"] is True
    assert main(["validate", "no-such-config", "--no-progress"]) == 2


def test_nelder_mead_and_the_bounded_transforms():
    x, v = nelder_mead(lambda p: (p[0] - 1.0) ** 2 + (p[1] + 2.0) ** 2, [0.0, 0.0], iters=200, tol=1e-12)
    assert x == pytest.approx([1.0, -2.0], abs=1e-3) and v < 1e-6
    for lo, hi, value in ((0.2, 0.9, 0.47), (1e-7, 1e-3, 8e-6)):
        assert _from_unit(_to_unit(value, lo, hi), lo, hi) == pytest.approx(value)
        assert _from_unit(50.0, lo, hi) == pytest.approx(hi) and _from_unit(-50.0, lo, hi) == pytest.approx(lo)


def test_fig19_shape_swap_loses_at_tiny_blocks_and_ties_at_medium_ones():
    """The vLLM paper's Fig. 19 setup, shortened to 300 requests: vLLM v0's swapping against recompute."""
    (vf,) = validation_files(["vllm-paper-fig19"])
    from tiered_kv.sim.validate import Predictor

    pred = Predictor()

    def ratio(block_size: int) -> float:
        runs = pred.results(vf, {"memory.block_size": block_size, "workload.num_requests": 300})
        assert runs["swap"]["preemptions_swap"] > 0  # the comparison is about preemption
        return runs["swap"]["norm_latency_s"] / runs["recompute"]["norm_latency_s"]

    assert ratio(1) > 1.2  # 80 copies of 10 KiB per 1-token block of OPT-13B
    assert abs(ratio(32) - 1.0) < 0.15
