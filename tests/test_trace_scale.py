"""Replaying a trace faster or slower (``workload.trace_scale``), and refusing load settings that cannot be meant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from simutil import TINY, config

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.workload import generate


def _trace(tmp_path: Path, arrivals: list[float]) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"arrival": a, "prompt_len": 4, "output_len": 1}) + "\n" for a in arrivals))
    return str(p)


# Four requests over 4 s: a mean rate of (4 - 1) / 4 = 0.75 requests/s.
ARRIVALS = [0.0, 1.0, 2.0, 4.0]


@pytest.mark.parametrize(
    ("scale", "times"),
    [
        ({}, [0.0, 1.0, 2.0, 4.0]),
        ({"speedup": 2.0}, [0.0, 0.5, 1.0, 2.0]),
        ({"speedup": 0.5}, [0.0, 2.0, 4.0, 8.0]),
        ({"rate": 1.5}, [0.0, 0.5, 1.0, 2.0]),  # twice the trace's 0.75
        ({"rate": 3.0}, [0.0, 0.25, 0.5, 1.0]),
    ],
)
def test_a_time_scale_divides_every_arrival(tmp_path, scale, times):
    cfg = config(workload__trace=_trace(tmp_path, ARRIVALS), workload__trace_scale=scale)
    assert [r.arrival for r in generate(cfg["workload"], cfg["seed"])] == times


def test_the_scale_applies_after_the_sample_window(tmp_path):
    # The window is in the trace's own seconds: [1, 5) keeps 1, 2, 4, shifted to 0, 1, 3; then twice as fast.
    cfg = config(
        workload__trace=_trace(tmp_path, ARRIVALS),
        workload__trace_sample={"window_s": [1, 5]},
        workload__trace_scale={"speedup": 2},
    )
    assert [r.arrival for r in generate(cfg["workload"], cfg["seed"])] == [0.0, 0.5, 1.5]


def _simulate(tmp_path: Path, workload: dict, capsys) -> tuple[int, list[str], str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(dict(TINY, workload=workload)))
    out = tmp_path / "o.json"
    status = main(["simulate", str(cfg), "--json", str(out), "--no-progress"])
    got = capsys.readouterr()
    assert status != 0 or out.exists()
    return status, got.out.splitlines(), got.err


@pytest.mark.parametrize(
    ("scale", "said"),
    [
        ({"speedup": 2}, "load: trace replayed 2x faster (mean 0.75 -> 1.5 requests/s)"),
        ({"speedup": 0.5}, "load: trace replayed 2x slower (mean 0.75 -> 0.375 requests/s)"),
        ({"rate": 3}, "load: trace replayed 4x faster (mean 0.75 -> 3 requests/s)"),
    ],
)
def test_the_runs_first_line_says_the_time_scale(tmp_path, capsys, scale, said):
    status, lines, _ = _simulate(tmp_path, {"trace": _trace(tmp_path, ARRIVALS), "trace_scale": scale}, capsys)
    assert status == 0
    assert lines[0].startswith(f"tiny, {said}; toy on toy"), lines[0]


def test_the_first_line_says_nothing_of_load_by_default(tmp_path, capsys):
    status, lines, _ = _simulate(tmp_path, {"trace": _trace(tmp_path, ARRIVALS)}, capsys)
    assert status == 0 and lines[0].startswith("tiny: toy on toy, GPU KV") and "load" not in lines[0]


BAD = [
    ({"trace_scale": {"speedup": 0}}, r"workload\.trace_scale\.speedup: must be > 0, got 0$"),
    ({"trace_scale": {"rate": 0}}, r"workload\.trace_scale\.rate: must be > 0, got 0$"),
    ({"trace_scale": {"rate": -2}}, r"workload\.trace_scale\.rate: must be > 0, got -2$"),
    ({"trace_scale": {"speedup": "fast"}}, r"workload\.trace_scale\.speedup: expected an integer or a number, got str"),
    (
        {"trace_scale": {"speedup": 2, "rate": 3}},
        r"workload\.trace_scale: give speedup \(x times faster\) or rate \(a mean rate\), not both",
    ),
    (
        {"trace_scale": {"speedup": float("inf")}},
        r"workload\.trace_scale\.speedup: must be a finite number, got inf \(\.inf, every request ready at 0, is a "
        r"load only with workload\.concurrency",
    ),
    ({"concurrency": 0}, r"workload\.concurrency: must be > 0, got 0$"),
    ({"concurrency": -1}, r"workload\.concurrency: must be > 0, got -1$"),
    ({"think_s": "soon"}, r"workload\.think_s: expected an integer or a number, got str 'soon'$"),
    ({"think_s": 2}, r"workload\.think_s: the replayed requests of '.*t\.jsonl' hold no conversation of more than"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_load_settings_are_one_line_exit_2_and_nothing_run(tmp_path, capsys, extra, message):
    import re

    status, lines, err = _simulate(tmp_path, {"trace": _trace(tmp_path, ARRIVALS), **extra}, capsys)
    assert status == 2
    assert lines == []  # nothing ran: not even the first line
    assert err.count("\n") == 1 and err.startswith("tiered-kv simulate: "), err
    assert re.search(message, err.rstrip("\n")), err
    assert not (tmp_path / "o.json").exists()


def test_a_rate_for_requests_that_all_arrive_at_once_is_refused(tmp_path):
    cfg = config(workload__trace=_trace(tmp_path, [3.0, 3.0]), workload__trace_scale={"rate": 2})
    with pytest.raises(ConfigError, match=r"workload\.trace_scale\.rate: the 2 replayed request\(s\) of .* arrive at"):
        generate(cfg["workload"], cfg["seed"])
