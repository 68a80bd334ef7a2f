"""What ``simulate`` prints: narrow tables with legends, speed-ups where they are read, each quantity named.

The prefix hit rates count a request's first admission only, as vLLM's
``PrefixCacheStats`` do: a recompute victim re-admitted finds its own KV again,
which is not reuse between requests, and is printed apart ("found").
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from mgrutil import cq, make_tm, run, settle
from poolutil import letters
from reportutil import printed, table
from simutil import KIB_IN_GIB, TINY

from tiered_kv.cli.simulate import simulate
from tiered_kv.core import Request
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.sim import run_tables, trace_report
from tiered_kv.sim.config import load_config, setup
from tiered_kv.sim.workload import generate
from tiered_kv.transfer import ControlledCopyEngine


def step_all(s: Scheduler, eng: ControlledCopyEngine) -> None:
    """Schedule, land every copy, and apply the step (each request that reaches its end samples token 9)."""
    out = s.schedule()
    sampled = {r.request_id: 9 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    eng.complete_all()
    s.update(out, sampled)


def test_a_recompute_victims_own_blocks_found_again_are_not_prefix_hits():
    """Two prompts that share nothing; b is recomputed and finds its own first block again at re-admission."""
    eng = ControlledCopyEngine({"GPU": 5, "CPU": 2}, bytes_per_block=16)
    tm = TierManager(ManagerConfig(5, 0, 2), eng, cost_model=CostModel(kv_bytes_per_token=8, block_size=2))
    s = Scheduler(tm, SchedulerConfig(64, 4, mode="recompute"))
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=3))
    s.add_request(Request("b", [5, 6, 7, 8], max_tokens=3))
    step_all(s, eng)  # both prompts computed: 2 blocks each, of the pool's 4
    out = s.schedule()  # a grows into a third block: b, admitted last, is recomputed
    assert out.preempted == [("b", out.preempted[0][1])] and out.preempted[0][1].value == "recompute"
    eng.complete_all()
    s.update(out, {"a": 9})
    while s.num_unfinished:
        step_all(s, eng)
    c = tm.counters
    # First admissions: 4 + 4 prompt tokens, nothing shared.  b's re-admission: its 5 tokens
    # (prompt and one output), of which its first block [5, 6] was still cached on the GPU.
    assert (c.gpu_query_tokens, c.gpu_hit_tokens) == (8, 0)
    assert (c.preempted_gpu_query_tokens, c.preempted_gpu_hit_tokens) == (5, 2)
    assert tm.metrics().gpu_hit_rate == 0.0 and s.tokens_recomputed == 2


def test_a_cpu_tier_without_write_through_serves_prefixes_that_swap_outs_stored():
    """offload none: B's swap-out stores its full blocks, they stay after the swap-in, and C loads them."""
    tm, eng = make_tm(gpu=5, cpu=9)
    assert tm.offload == "none"
    run(tm, "B", "AAAABBBBC")  # GPU blocks 1 2 3
    tm.preempt("B", "swap")
    settle(tm, eng)
    tm.resume("B")
    settle(tm, eng)
    tm.free("B")
    assert cq(tm) == ["1", "2"]  # the two full blocks, cached and unpinned; the tail is gone
    tm.free(run(tm, "X", "XXXXYYYYZZZZW").request_id)  # takes every GPU block: B's are evicted there
    c = Request("C", letters("AAAABBBBQ"))
    res = tm.admit(c, c.num_tokens)
    assert (res.num_computed_tokens, res.num_loading_tokens) == (0, 8)  # found in the CPU tier only
    counters = tm.counters
    assert (counters.cpu_hit_tokens, counters.offload_blocks, counters.swap_out_blocks) == (8, 0, 3)


def lengths_trace(tmp_path: Path, n: int = 6) -> Path:
    """``n`` prompts of 8 tokens, all at t=0, given by length only: they share nothing."""
    rows = "".join(json.dumps({"arrival": 0, "prompt_len": 8, "output_len": 6}) + "\n" for _ in range(n))
    (tmp_path / "t.jsonl").write_text(rows)
    raw = copy.deepcopy(TINY)
    raw["workload"] = {"trace": "t.jsonl"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "c.yaml"


def test_a_workload_that_shares_nothing_has_no_prefix_hits_in_the_table_the_plot_and_the_results(tmp_path):
    lines: list[str] = []
    doc = simulate(lengths_trace(tmp_path), emit=lines.append, progress=False)
    (r,) = doc["runs"]
    assert r["gpu_prefix_hit_rate"] == 0.0 and r["preemptions_recompute"] == 3
    # The victims found 12 of their own tokens again when re-admitted; none is a prefix hit.
    assert r["lookup_tokens"] == {
        "first": {"tokens": 48, "gpu": 0, "cpu": 0},
        "readmitted": {"tokens": 31, "gpu": 12, "cpu": 0},
    }
    heads, rows = table(lines, "where the prompts' KV came from")
    assert heads[:2] == ["GPU", "CPU"] and rows["only"][:2] == ["0.0%", "0.0%"]
    heads, rows = table(lines, "preemptions and copies")
    assert heads[:6] == ["swap", "recomp", "out", "in", "recomputed", "found"]
    assert rows["only"][:6] == ["0", "3", "0.0", "0.0", str(r["tokens_recomputed"]), "12"]
    # The capacity plot's curve and the run's point: the same quantity, 0 everywhere.
    cfg = load_config(tmp_path / "c.yaml")
    workload = generate(cfg["workload"], cfg["seed"])
    assert set(trace_report.capacity_curve(workload).values()) == {0.0}
    fig = trace_report.capacity_figure(workload, doc["runs"], [setup(cfg, 0)])
    (point,) = [line for line in fig.axes[0].get_lines() if "(measured)" in line.get_label()]
    assert list(point.get_ydata()) == [0.0]
    close(fig)


def test_the_plot_marks_each_runs_measured_hit_rate_as_the_table_prints_it(tmp_path):
    """Shared prompts: the run's point is its first admissions' GPU and CPU hits, the table's two columns added."""
    a = list(range(1, 13))
    rows = [{"arrival": 10 * i, "prompt_tokens": [*a, 100 + i], "output_len": 1} for i in range(3)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    raw = copy.deepcopy(TINY)
    raw["workload"] = {"trace": "t.jsonl"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    doc = simulate(tmp_path / "c.yaml", emit=lines.append, progress=False)
    (r,) = doc["runs"]
    # 13-token prompts in 4-token blocks: the second and third find the first's 3 full blocks.
    assert r["lookup_tokens"]["first"] == {"tokens": 39, "gpu": 24, "cpu": 0}
    _, cells = table(lines, "where the prompts' KV came from")
    assert cells["only"][:2] == ["61.5%", "0.0%"]  # 24 / 39
    cfg = load_config(tmp_path / "c.yaml")
    fig = trace_report.capacity_figure(generate(cfg["workload"], cfg["seed"]), doc["runs"], [setup(cfg, 0)])
    (point,) = [line for line in fig.axes[0].get_lines() if "(measured)" in line.get_label()]
    assert list(point.get_ydata()) == [pytest.approx(100 * 24 / 39)]
    assert point.get_label() == "only (measured): 61.5%"
    close(fig)


def close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---------------------------------------------------------------- the tables' shape


def wide_config(tmp_path: Path) -> Path:
    """Two regimes, four runs with long names: no CPU tier, swap-only CPU tier, write-through, and a disk below."""
    raw = copy.deepcopy(TINY)
    raw["hardware"]["tiers"] = {"disk": {"bandwidth_gbps": 1e-6, "block_latency_us": 1000}}
    raw["memory"]["cpu_kv_gib"] = 16 * KIB_IN_GIB
    raw["workload"] = {
        "num_requests": 12,
        "arrival": {"process": "poisson", "rate": 2.0},
        "prompt_len": {"dist": "uniform", "low": 4, "high": 16},
        "output_len": {"dist": "fixed", "value": 3},
    }
    raw["regimes"] = [{"name": "slow", "rate": 0.5}, {"name": "fast", "rate": 4.0}]
    raw["runs"] = [
        {"name": "recompute-only-baseline", "mode": "recompute", "cpu_kv_gib": 0, "note": "vLLM v1"},
        {"name": "swap-with-its-cpu-tier", "mode": "swap", "vs": "recompute-only-baseline"},
        {"name": "recompute+cpu-prefix", "mode": "recompute", "offload": "write_through"},
        {
            "name": "cost-aware+cpu+disk-tier",
            "victim_policy": "cost_aware",
            "mode": "auto",
            "offload": "write_through",
            "vs": "recompute+cpu-prefix",
            "tiers": [{"type": "disk", "capacity_blocks": 64}],
        },
    ]
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "w.yaml"


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[str]]:
    lines: list[str] = []
    doc = simulate(wide_config(tmp_path_factory.mktemp("wide")), emit=lines.append, progress=False)
    return doc, lines


def test_every_line_fits_100_columns(wide):
    _, lines = wide
    out = printed(lines)
    assert len(out) > 100 and max(len(line) for line in out) <= 99, max(out, key=len)


def test_every_column_is_in_the_legend_under_its_table_in_the_first_regime_only(wide):
    _, lines = wide
    out = printed(lines)
    for t in (*run_tables.TABLES, run_tables.TIERS):
        first = out.index(t.title)
        assert out.index(t.title, first + 1) > first  # printed in both regimes
        legend = set(t.legend())
        for line in legend:
            assert line in out[first:], line
        keys = [line.split(":")[0].strip() for line in t.legend() if not line.startswith("      ")]
        for g in t.groups:
            assert not g.label or g.label in keys
            assert len(g.label) < g.width  # a heading fits over its columns
            for c in g.columns:
                # a column is explained by an entry naming it (p90 by "p50 p90 p99")
                assert any(c.head in k.split() or c.head == k for k in keys), (t.title, c.head)
        # the second regime's table has no legend
        second = out.index(t.title, first + 1)
        assert not legend & set(out[second : second + 12])


def test_each_run_is_numbered_and_its_speed_ups_are_over_the_run_it_adds_to(wide):
    doc, lines = wide
    runs = [r for r in doc["runs"] if r["regime"] == "slow"]
    out = printed(lines)
    start = out.index("runs (x in the tables: the speed-up over the run it adds to, its vs):")
    listed = " ".join(" ".join(out[start + 1 : start + 12]).split())  # unwrapped
    assert " 1 recompute-only-baseline: vLLM v1; no CPU tier; the baseline" in out
    assert (
        "2 swap-with-its-cpu-tier: CPU tier 1.526e-05 GiB, filled by swap-outs only (no write-through); vs 1" in listed
    )
    assert "3 recompute+cpu-prefix: CPU tier 1.526e-05 GiB, filled by write-through and swap-outs; vs 1" in listed
    assert "4 cost-aware+cpu+disk-tier: CPU tier 1.526e-05 GiB, filled by write-through and swap-outs; below" in listed
    heads, cells = table(lines, "latency")
    assert heads == ["vs", "p50", "p90", "p99", "x", "p50", "p99", "x", "p50", "p99"]
    by_name = {r["run"]: r for r in runs}
    for name, vs in (("swap-with-its-cpu-tier", 1), ("recompute+cpu-prefix", 1), ("cost-aware+cpu+disk-tier", 3)):
        row = cells[name[: run_tables.NAME_WIDTH]]
        base = runs[vs - 1]
        ttft = base["ttft_s"]["p50"] / by_name[name]["ttft_s"]["p50"]
        e2e = base["e2e_s"]["p50"] / by_name[name]["e2e_s"]["p50"]
        itl = by_name[name]["itl_s"]
        assert (row[0], row[4], row[7]) == (str(vs), f"{ttft:.2f}x", f"{e2e:.2f}x")
        assert row[8:] == [f"{itl['p50'] * 1e3:.1f}", f"{itl['p99'] * 1e3:.1f}"]
    assert cells["recompute-only-baselin"][0] == "-" and cells["recompute-only-baselin"][4] == "-"
    _, tiers = table(lines, "tiers below the CPU")
    (row,) = tiers.values()
    disk = runs[3]["lower_tiers"]["disk"]
    assert row[:5] == [
        "disk",
        *(str(disk[k]) for k in ("hit_blocks", "loaded_blocks", "stored_blocks", "declined_blocks")),
    ]
