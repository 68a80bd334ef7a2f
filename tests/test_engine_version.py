"""The engine a run simulates is a stated setting: its era's step model, async scheduling, multi-step, defaults."""

import copy
import json

import pytest
from simutil import TINY, TOY_STEP, config, run

from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.engine_version import DEFAULT_ENGINE, parse_engine
from tiered_kv.sim.profiles import load_hardware, uncalibrated_step


@pytest.mark.parametrize(
    ("name", "era", "asynch", "graphs"),
    [
        ("vllm-0.6.0", "vllm-v0", False, False),
        ("vllm-0.7.3", "vllm-v0", False, False),
        ("vllm-0.8.0", "vllm-v1", False, False),
        ("vllm-0.13.0", "vllm-v1", False, False),
        ("vllm-0.14.0", "vllm-v1", True, False),
        ("vllm-0.15.1", "vllm-v1", True, False),
        ("vllm-0.21.0", "vllm-v1", True, True),
        ("vllm-0.33", "vllm-v1", True, True),
    ],
)
def test_what_a_version_implies(name, era, asynch, graphs):
    e = parse_engine(name)
    assert (e.era, e.async_scheduling, e.cudagraph_memory_in_budget) == (era, asynch, graphs)
    assert e.multi_step == (era == "vllm-v0")


@pytest.mark.parametrize("bad", ["0.15.1", "vllm-v1", "sglang-0.5.1", "vllm-0.15.1rc1"])
def test_a_bad_engine_names_the_key_and_the_form(bad):
    with pytest.raises(ConfigError, match=r"engine: .*expected the engine and its version as vllm-X\.Y\.Z"):
        config(engine=bad)
    with pytest.raises(ConfigError, match=r"engine: expected a string, got int 15"):
        config(engine=15)


def test_the_era_picks_the_step_model_and_multi_step_is_v0s():
    hw = dict(TINY["hardware"], step_model={"vllm-v1": dict(TOY_STEP, frontend_s=0.5), "vllm-v0": dict(TOY_STEP)})
    assert setup(config(hardware=hw), 0).compute.frontend_s == 0.5  # default engine: v1
    assert setup(config(hardware=hw, engine="vllm-0.6.0"), 0).compute.frontend_s == 0.0
    with pytest.raises(ConfigError, match=r"compute\.scheduler_steps: vllm-0\.15\.1 .* has no multi-step"):
        config(hardware=hw, compute__scheduler_steps=10)
    assert setup(config(hardware=hw, engine="vllm-0.6.0", compute__scheduler_steps=10), 0).compute.scheduler_steps == 10
    assert DEFAULT_ENGINE == "vllm-0.15.1"


def test_a_profile_without_the_eras_step_model_runs_uncalibrated_and_says_so():
    hw = dict(TINY["hardware"], step_model={"vllm-v0": dict(TOY_STEP)})
    st = setup(config(hardware=hw), 0)
    assert st.uncalibrated.startswith("toy has no step model for vllm-v1 (vllm-0.15.1): running UNCALIBRATED")
    assert st.compute.frontend_s == uncalibrated_step("vllm-v1").frontend_s
    assert uncalibrated_step("vllm-v1") == load_hardware("h100-sxm").step_for("vllm-v1")
    assert setup(config(), 0).uncalibrated == ""


def test_the_first_line_of_a_run_on_an_uncalibrated_profile_says_so(tmp_path, monkeypatch, capsys):
    import yaml

    from tiered_kv.cli import main

    raw = copy.deepcopy(TINY)
    raw["hardware"] = dict(TINY["hardware"])
    del raw["hardware"]["step_model"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "c.yaml", "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("note: toy has no step model for vllm-v1 (vllm-0.15.1): running UNCALIBRATED")


def _trace_config(tmp_path, rows, **changes):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return config(workload__trace=str(p), workload__num_requests=len(rows), **changes)


def test_async_scheduling_decides_an_arrival_during_step_k_for_step_k_plus_2(tmp_path):
    # Every step takes 1 s.  A (4-token prompt, 2 tokens out) runs its prefill [0, 1] and decode [1, 2].
    # B is sent at 0.5 s, during A's prefill.  Synchronous: B is decided on at 1 s and prefills [1, 2]
    # beside A's decode (TTFT 1.5 s).  Async (vLLM 0.14+): the step [1, 2] was decided at 0 s, so B's
    # first decision is at 2 s, for the step [2, 3] (TTFT 2.5 s).
    rows = [{"arrival": 0.0, "prompt_len": 4, "output_len": 2}, {"arrival": 0.5, "prompt_len": 4, "output_len": 2}]
    _, sync = run(_trace_config(tmp_path, rows), trace=True)
    _, asy = run(_trace_config(tmp_path, rows, scheduler__async_scheduling=True), trace=True)
    assert [e for e in sync.loop.trace if e[1] in ("arrival", "step")] == [
        (0.0, "arrival", 0),
        (0.0, "step", ((0, 4),)),
        (0.5, "arrival", 1),
        (1.0, "step", ((0, 1), (1, 4))),
        (2.0, "step", ((1, 1),)),
    ]
    assert [e for e in asy.loop.trace if e[1] in ("arrival", "step")] == [
        (0.0, "arrival", 0),
        (0.0, "step", ((0, 4),)),
        (1.0, "step", ((0, 1),)),
        (2.0, "arrival", 1),
        (2.0, "step", ((1, 4),)),
        (3.0, "step", ((1, 1),)),
    ]
    assert {r.rid: r.first_token - r.arrival for r in asy.records.values()} == {0: 1.0, 1: 2.5}


def test_async_scheduling_runs_an_arrival_next_when_nothing_else_would(tmp_path):
    # A has one output token: it finishes with its prefill [0, 1], so the step after it had nothing to
    # run when it was decided, and B (sent at 0.5 s) is decided on at 1 s, as without async scheduling.
    rows = [{"arrival": 0.0, "prompt_len": 4, "output_len": 1}, {"arrival": 0.5, "prompt_len": 4, "output_len": 2}]
    _, asy = run(_trace_config(tmp_path, rows, scheduler__async_scheduling=True), trace=True)
    assert [e for e in asy.loop.trace if e[1] in ("arrival", "step")] == [
        (0.0, "arrival", 0),
        (0.0, "step", ((0, 4),)),
        (1.0, "arrival", 1),  # entered at the decision after the step it arrived in: nothing else was left
        (1.0, "step", ((1, 4),)),
        (2.0, "step", ((1, 1),)),
    ]


def test_the_engine_version_sets_async_scheduling_unless_the_config_does():
    base = {"hardware": "h100-sxm", "model": "llama3-8b", "workload": {"num_requests": 1}}
    assert setup(config_from_raw(base), 0).async_scheduling is True  # 0.15.1
    assert setup(config_from_raw({**base, "engine": "vllm-0.13.0"}), 0).async_scheduling is False
    off = {**base, "scheduler": {"async_scheduling": False}}
    assert setup(config_from_raw(off), 0).async_scheduling is False
