"""The figures a run prints say what they are: KV demand, the sweep's verdict, the usage plot's series."""

import copy
import json

import pytest
import yaml
from simutil import TINY

from tiered_kv.cli.simulate import simulate


def trace_config(tmp_path, prompts, max_num_seqs=4):
    rows = "".join(json.dumps({"arrival": i, "prompt_len": n, "output_len": 2}) + "\n" for i, n in enumerate(prompts))
    (tmp_path / "t.jsonl").write_text(rows)
    raw = copy.deepcopy(TINY)
    raw["workload"] = {"trace": "t.jsonl"}
    raw["scheduler"] = dict(raw["scheduler"], max_num_seqs=max_num_seqs)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "c.yaml"


def header(lines):
    """The run's first line, unwrapped (it is wrapped at spaces to fit 100 columns)."""
    text = next(line for line in lines if "KV demand" in line)
    return " ".join(part.strip() for part in text.split("\n"))


def test_kv_demand_of_a_short_trace_counts_only_the_requests_it_has(tmp_path):
    """Two requests of 5 KV tokens (2 blocks each) on a 7-block pool: 4/7, not max_num_seqs x the mean."""
    lines = []
    doc = simulate(trace_config(tmp_path, [4, 4]), emit=lines.append, progress=False)
    assert doc["kv_demand_ratio"] == pytest.approx(4 / 7) and doc["kv_demand_requests"] == 2
    assert header(lines).endswith(
        "KV demand: the 2 largest requests at full length (every request) = 0.57x the GPU pool"
    )


def test_kv_demand_counts_the_largest_requests_that_can_run_at_once(tmp_path):
    """max_num_seqs 2: the 13- and 9-token requests (4 + 3 blocks) of six, on a 7-block pool."""
    lines = []
    doc = simulate(trace_config(tmp_path, [4, 8, 12, 2, 2, 2], max_num_seqs=2), emit=lines.append, progress=False)
    assert doc["kv_demand_ratio"] == pytest.approx(7 / 7) and doc["kv_demand_requests"] == 2
    assert header(lines).endswith(
        "KV demand: the 2 largest requests at full length (no more than 2 run at once) = 1.00x the GPU pool"
    )


def test_the_usage_series_held_and_fill_are_different_measurements():
    """A run that never swaps fills its CPU tier by write-through; it holds only what is in flight."""
    from simutil import KIB_IN_GIB, config, run

    cfg = config(
        workload__num_requests=30,
        workload__arrival={"process": "poisson", "rate": 2.0},
        workload__prompt_len={"dist": "uniform", "low": 4, "high": 16},
        memory__cpu_kv_gib=16 * KIB_IN_GIB,
        runs=[
            {"name": "recompute+tier", "mode": "recompute", "offload": "write_through"},
            {"name": "swap", "mode": "swap", "offload": "none"},
        ],
    )
    res, _ = run(cfg, 0)
    assert res["preemptions_swap"] == 0
    held, fill = [u[2] for u in res["usage"]], [u[3] for u in res["usage"]]
    assert max(fill) == 1.0 and max(held) < 1.0
    assert all(h <= f for h, f in zip(held, fill, strict=True))  # a held block is a cached block
    assert sum(h < f for h, f in zip(held, fill, strict=True)) > len(held) // 2
    res, _ = run(cfg, 1)  # swapped requests' KV is held on the CPU until it is swapped back in
    assert res["preemptions_swap"] > 0 and max(u[2] for u in res["usage"]) > 0


def test_the_sweep_compares_cost_aware_only_with_fixed_modes_of_the_same_tier(tmp_path):
    from simutil import KIB_IN_GIB

    from tiered_kv.cli.sweep import sweep

    raw = copy.deepcopy(TINY)
    raw["workload"] = {
        "num_requests": 12,
        "arrival": {"process": "poisson", "rate": 2.0},
        "prompt_len": {"dist": "uniform", "low": 4, "high": 16},
        "output_len": {"dist": "fixed", "value": 3},
    }
    raw["memory"]["cpu_kv_gib"] = 16 * KIB_IN_GIB
    raw["runs"] = [
        {"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "swap", "mode": "swap"},
        {"name": "recompute+tier", "mode": "recompute", "offload": "write_through"},
        {"name": "smart", "victim_policy": "cost_aware", "mode": "auto"},
        {"name": "smart+tier", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
    ]
    raw["sweep"] = {"gpu_kv_gib": [8 * KIB_IN_GIB], "rate": [2.0]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    lines = []
    doc = sweep(tmp_path / "s.yaml", emit=lines.append, progress=False)
    tput = {r["run"]: r["throughput_rps"] for r in doc["rows"]}
    assert [r["tier"] for r in doc["rows"]] == [
        "no CPU prefix tier",
        "no CPU prefix tier",
        "CPU prefix tier (write_through)",
        "no CPU prefix tier",
        "CPU prefix tier (write_through)",
    ]
    best_plain = max(("recompute", "swap"), key=tput.get)
    assert [(v["run"], v["best_fixed"], v["ratio_to_best_fixed"]) for v in doc["verdicts"]] == [
        ("smart", best_plain, tput["smart"] / tput[best_plain]),
        ("smart+tier", "recompute+tier", tput["smart+tier"] / tput["recompute+tier"]),
    ]
    assert lines[0].startswith("derived, not given in the profiles: hardware.link.d2h_gbps = 4.096e-06 ")
    assert lines[1:8] == [
        "throughput in requests/s, one column per run; each run's tier below the GPU:",
        "  recompute: no CPU prefix tier",
        "  swap: no CPU prefix tier",
        "  recompute+tier: CPU prefix tier (write_through)",
        "  smart: no CPU prefix tier",
        "  smart+tier: CPU prefix tier (write_through)",
        "verdict: a cost-aware run's throughput over the best fixed-mode run (swap or recompute) with the same "
        "tier; n/a where no such run is in the sweep",
    ]


def test_a_cost_aware_run_with_nothing_like_it_gets_no_verdict(tmp_path):
    from simutil import KIB_IN_GIB

    from tiered_kv.cli.sweep import sweep

    raw = copy.deepcopy(TINY)
    raw["memory"]["cpu_kv_gib"] = 16 * KIB_IN_GIB
    raw["runs"] = [
        {"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "smart+tier", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
    ]
    raw["sweep"] = {"rate": [0.5]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    lines = []
    doc = sweep(tmp_path / "s.yaml", emit=lines.append, progress=False)
    (v,) = doc["verdicts"]
    assert (v["best_fixed"], v["ratio_to_best_fixed"], v["cost_aware_at_least_best_fixed"]) == (None, None, None)
    assert lines[-1].endswith("   smart+tier: n/a")


# ---------------------------------------------------------------- the plots' layout

MAIN_JOB_NAMES = [  # the main job's run names: long enough to collide when written side by side
    "recompute-only",
    "recompute+cpu-tier",
    "always-swap",
    "cost-aware",
    "cost-aware+cpu-tier",
    "cost-aware+cpu+disk",
]


@pytest.fixture(scope="module")
def six_runs(tmp_path_factory):
    """Six runs of a small oversubscribed workload, one without a CPU tier (as the main job's first)."""
    from simutil import KIB_IN_GIB

    raw = copy.deepcopy(TINY)
    raw["memory"]["cpu_kv_gib"] = 16 * KIB_IN_GIB
    raw["workload"] = {
        "num_requests": 16,
        "arrival": {"process": "poisson", "rate": 2.0},
        "prompt_len": {"dist": "uniform", "low": 4, "high": 16},
        "output_len": {"dist": "fixed", "value": 3},
    }
    modes = [
        {"mode": "recompute", "cpu_kv_gib": 0},
        {"mode": "recompute", "offload": "write_through"},
        {"mode": "swap"},
        {"victim_policy": "cost_aware", "mode": "auto"},
        {"victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
        {"victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
    ]
    raw["runs"] = [{"name": n, **m} for n, m in zip(MAIN_JOB_NAMES, modes, strict=True)]
    path = tmp_path_factory.mktemp("six") / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return simulate(path, emit=lambda _: None, progress=False)["runs"]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def series(ax):
    return [line.get_label() for line in ax.get_lines()]


def test_the_cpu_tier_panels_show_only_runs_that_have_a_cpu_tier(six_runs):
    from tiered_kv.sim.report import usage_figure

    assert six_runs[0]["cpu_blocks"] == 0 and all(r["cpu_blocks"] for r in six_runs[1:])
    fig = usage_figure(six_runs)
    gpu, held, fill = fig.axes
    assert series(gpu) == MAIN_JOB_NAMES
    assert series(held) == series(fill) == MAIN_JOB_NAMES[1:]
    # the same colour for a run in every panel
    assert [line.get_color() for line in fill.get_lines()] == [line.get_color() for line in gpu.get_lines()[1:]]


def test_without_any_cpu_tier_the_usage_plot_is_the_gpu_panel_alone(six_runs):
    from tiered_kv.sim.report import usage_figure

    fig = usage_figure(six_runs[:1])
    (gpu,) = fig.axes
    assert series(gpu) == ["recompute-only"]


def overlap(a, b) -> float:
    """Area in pixels that two window extents share."""
    from matplotlib.transforms import Bbox

    box = Bbox.intersection(a, b)
    return 0.0 if box is None else box.width * box.height


def figures(runs):
    from tiered_kv.sim.report import latency_figure, policies_figure, usage_figure
    from tiered_kv.sim.trace_report import ttft_figure

    return {
        "usage_over_time": usage_figure(runs),
        "latency_cdf": latency_figure(runs),
        "policies": policies_figure(runs),
        "ttft_per_run": ttft_figure(runs),
    }


def test_no_legend_covers_a_panel(six_runs):
    for name, fig in figures(six_runs).items():
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert legends, name
        for legend in legends:
            for ax in fig.axes:
                assert overlap(legend.get_window_extent(r), ax.get_window_extent(r)) == 0.0, name


def test_no_two_labels_of_the_runs_overlap(six_runs):
    for name, fig in figures(six_runs).items():
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                boxes = [t.get_window_extent(r) for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
                for i, a in enumerate(boxes):
                    for b in boxes[i + 1 :]:
                        assert overlap(a, b) == 0.0, (name, [t.get_text() for t in axis.get_ticklabels()])


def test_the_policies_plot_names_every_run_and_labels_every_bar(six_runs):
    from tiered_kv.sim.report import policies_figure

    fig = policies_figure(six_runs)
    tput, _, preempt = fig.axes
    assert [t.get_text() for t in tput.get_yticklabels()] == MAIN_JOB_NAMES
    totals = [r["preemptions_swap"] + r["preemptions_recompute"] for r in six_runs]
    assert [t.get_text() for t in preempt.texts] == [str(n) for n in totals]
    assert [t.get_text() for t in tput.texts] == [f"{r['throughput_rps']:.3g}" for r in six_runs]
