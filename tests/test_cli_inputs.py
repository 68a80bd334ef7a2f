"""The input checks behind the command line: non-finite numbers, traces, budgets, shipped configs, paths."""

import math

import pytest
import yaml
from simutil import TINY, config

from tiered_kv.errors import ConfigError, InvalidArgumentError, ResourceLimitError
from tiered_kv.sim.budget import MAX_SECONDS, Machine, check, estimate
from tiered_kv.sim.config import load_config, setup
from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.profiles import load_hardware, load_model
from tiered_kv.sim.shipped import shipped_names
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import SimRequest, WorkloadSize, load_trace, size

GIB = 1 << 30


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf])
def test_event_loop_refuses_non_finite_times_and_changes_nothing(t):
    loop = EventLoop()
    loop.schedule(1.0, "a")
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        loop.schedule(t, "b")
    assert len(loop) == 1 and loop.peek_time() == 1.0


def test_a_nan_arrival_given_to_the_simulator_fails_instead_of_hanging():
    cfg = config()
    sim = Simulator(setup(cfg, 0), [SimRequest(0, math.nan, [1, 2, 3, 4], [5, 6])])
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        sim.run()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"workload__arrival": {"rate": math.nan}}, r"workload\.arrival\.rate: must be a finite number, got nan"),
        ({"workload__arrival": {"rate": math.inf}}, r"workload\.arrival\.rate: must be a finite number, got inf"),
        ({"compute__step_overhead_s": math.inf}, r"compute\.step_overhead_s: must be a finite number"),
        (
            {"hardware": dict(TINY["hardware"], peak_bf16_flops=math.inf)},
            r"hardware\.peak_bf16_flops: must be a finite",
        ),
        ({"sweep__gpu_kv_gib": [math.inf]}, r"sweep\.gpu_kv_gib\[0\]: must be a finite number"),
    ],
)
def test_config_numbers_must_be_finite(changes, message):
    with pytest.raises(ConfigError, match=message):
        config(**changes)


def test_an_infinite_link_is_still_allowed_it_means_free_copies():
    cfg = config(link={"h2d_gbps": math.inf})
    assert setup(cfg, 0).link.d2h_bytes_per_s == math.inf


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("7", r"line 1: expected a JSON object, got number 7"),
        ("null", r"line 1: expected a JSON object, got null"),
        ('"text"', r"line 1: expected a JSON object, got string"),
        (
            '{"arrival": NaN, "prompt_len": 4, "output_len": 2}',
            r"'arrival' must be a finite number of seconds >= 0, got nan",
        ),
        ('{"arrival": Infinity, "prompt_len": 4, "output_len": 2}', r"'arrival' must be a finite number"),
        (
            '{"arrival": "nan", "prompt_len": 4, "output_len": 2}',
            r"'arrival' must be a number of seconds >= 0, got string",
        ),
        (
            '{"arrival": true, "prompt_len": 4, "output_len": 2}',
            r"'arrival' must be a number of seconds >= 0, got boolean",
        ),
        (
            '{"arrival": 0, "prompt_len": "4", "output_len": 2}',
            r"'prompt_len' must be an integer >= 1, got string \"4\"",
        ),
        ('{"arrival": 0, "prompt_len": 4.5, "output_len": 2}', r"'prompt_len' must be an integer >= 1, got number 4.5"),
        ('{"arrival": 0, "prompt_len": 4, "output_len": 0}', r"'output_len' must be an integer >= 1, got 0"),
        ('{"arrival": 0, "prompt_tokens": [1, "a"], "output_len": 2}', r"'prompt_tokens' must hold integers >= 0"),
        ('{"arrival": 0, "prompt_tokens": 5, "output_len": 2}', r"'prompt_tokens' must be a non-empty list"),
        (
            '{"arrival": 0, "prompt_tokens": [1, 2], "prompt_len": 3, "output_len": 2}',
            r"differs from len\(prompt_tokens\)",
        ),
    ],
)
def test_trace_lines_are_checked_field_by_field(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_trace(p)


def test_a_trace_is_sized_without_building_it(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"arrival": 0, "prompt_len": 1000000000, "output_len": 3}\n{"arrival": 1, "prompt_len": 5, "output_len": 2}\n'
    )
    s = size(config(workload__trace=str(p))["workload"])
    assert s == WorkloadSize(2, 1000000010, 1000000003, "workload.trace line 1")


def tiny_setups():
    cfg = config()
    return [setup(cfg, 0)]


def test_budget_refuses_more_memory_than_the_machine_has():
    setups = tiny_setups()
    work = WorkloadSize(10**9, 10**12, 8, "workload.prompt_len")
    with pytest.raises(
        ResourceLimitError, match=r"workload\.num_requests: 1000000000 requests .* but this machine has 16\.0 GiB"
    ):
        check(work, setups, 1, machine=Machine(16 * GIB))
    small = WorkloadSize(100, 10_000, 8, "workload.prompt_len")
    est = check(small, setups, 1, machine=Machine(16 * GIB))
    assert est.memory_bytes < 16 * GIB


def test_budget_counts_every_process_running_at_once():
    setups = tiny_setups()
    work = WorkloadSize(10**6, 10**8, 8, "workload.prompt_len")
    one = estimate(work, setups, cells=8, parallel=1)
    four = estimate(work, setups, cells=8, parallel=4)
    assert four.memory_bytes - one.memory_bytes == 3 * (one.workload_bytes + one.block_bytes)
    assert four.seconds == one.seconds / 4
    # Ray: parallel on the cluster, one copy of the workload on this machine.
    assert estimate(work, setups, cells=8, parallel=8, local_parallel=1).memory_bytes == one.memory_bytes
    with pytest.raises(ResourceLimitError, match=r", 4 at a time"):
        check(work, setups, 8, parallel=4, machine=Machine(one.memory_bytes + 1))


def test_budget_refuses_what_would_take_longer_than_the_limit():
    setups = tiny_setups()
    work = WorkloadSize(10**9, 10**12, 8, "workload.prompt_len")
    assert estimate(work, setups, 1).seconds > MAX_SECONDS
    with pytest.raises(ResourceLimitError, match=r"would take about [\d.]+ (days|years) here, over the 7 days limit"):
        check(work, setups, 1, machine=Machine(None))  # memory unknown: only time is held against the limit


def test_budget_refuses_a_request_that_never_fits_the_gpu_pool():
    setups = tiny_setups()  # 8 blocks of 4 tokens
    work = WorkloadSize(1, 40, 40, "workload.trace line 3")
    with pytest.raises(ConfigError, match=r"workload\.trace line 3: a request of 40 tokens needs 10 GPU blocks"):
        check(work, setups, 1, machine=Machine(None))


def test_shipped_profiles_and_configs_are_found_by_name():
    assert {"h200", "h100-sxm", "a100-80gb-pcie", "l40s"} <= set(shipped_names("hardware"))
    assert {"llama3-8b", "llama2-7b"} <= set(shipped_names("models"))
    assert {"oversubscribed-llama3-8b-h200", "quickstart-l40s", "fidelity-tiny"} <= set(shipped_names("experiments"))
    assert load_hardware("l40s").name == "L40S" and load_model("llama3-8b").name == "Llama-3-8B"
    assert load_config(None)["name"] == "oversubscribed-llama3-8b-h200"  # no config: the synthetic experiment
    assert load_config("quickstart-l40s")["hardware"] == "l40s"


def test_paths_inside_a_config_are_relative_to_the_config_file(tmp_path, monkeypatch):
    d = tmp_path / "experiment"
    (d / "profiles").mkdir(parents=True)
    (d / "traces").mkdir()
    (d / "profiles" / "my-gpu.yaml").write_text(yaml.safe_dump(dict(TINY["hardware"], name="my-gpu")))
    (d / "traces" / "t.jsonl").write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2}\n')
    raw = {k: v for k, v in TINY.items() if k != "hardware"}
    raw["hardware"] = "profiles/my-gpu.yaml"
    raw["workload"] = dict(TINY["workload"], trace="traces/t.jsonl")
    (d / "c.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(d / "c.yaml")
    assert setup(cfg, 0).hardware.name == "my-gpu"
    assert cfg["workload"]["trace"] == str(d / "traces" / "t.jsonl")
    assert size(cfg["workload"]).requests == 1


def test_overrides_fill_a_section_the_yaml_left_empty():
    from tiered_kv.sim.config import config_from_raw

    raw = {k: v for k, v in TINY.items() if k != "workload"}
    raw["workload"] = None  # `workload:` with nothing under it
    fixed = {f"workload.{k}_len.{f}": v for k in ("prompt", "output") for f, v in (("dist", "fixed"), ("value", 2))}
    cfg = config_from_raw(raw, overrides={"workload.arrival.rate": 2.0, **fixed})
    assert cfg["workload"]["arrival"]["rate"] == 2.0


def test_an_inline_profile_mapping_still_works():
    cfg = config(hardware=dict(TINY["hardware"], name="inline"))
    assert setup(cfg, 0).hardware.name == "inline"


def test_bench_transfer_never_labels_an_engine_that_did_not_run():
    pytest.importorskip("torch")
    import torch

    from tiered_kv.bench.transfer import check_engines, run_cases

    with pytest.raises(InvalidArgumentError, match="unknown engine 'gpu'"):
        run_cases(engines=["gpu"], block_tokens=[16], layouts=["block_contiguous"], bytes_per_case=1 << 20)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
            check_engines(["cuda"])
    check_engines(["cpu"])
