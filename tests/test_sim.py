"""The simulator: whole event traces, determinism, conservation, known regimes, bad configs."""

import json
import math

import pytest
from reportutil import printed
from simutil import KIB_IN_GIB, TINY, config, run

from tiered_kv.cli.simulate import simulate
from tiered_kv.cli.sweep import sweep
from tiered_kv.errors import ConfigError
from tiered_kv.sim.workload import generate, load_trace


def test_tiny_scenario_whole_event_trace():
    # Two requests (4-token prompt, 2 output tokens), arriving at 0 s and 2 s; every step takes 1 s.
    res, sim = run(config(), trace=True)
    assert sim.loop.trace == [
        (0.0, "arrival", 0),
        (0.0, "admit", 0),
        (0.0, "step", ((0, 4),)),  # prefill, first token at 1 s
        (1.0, "step", ((0, 1),)),  # decode, second token at 2 s
        (2.0, "finish", 0),
        (2.0, "arrival", 1),
        (2.0, "admit", 1),
        (2.0, "step", ((1, 4),)),
        (3.0, "step", ((1, 1),)),
        (4.0, "finish", 1),
    ]
    assert res["ttft_s"]["p50"] == 1.0 and res["e2e_s"]["p99"] == 2.0 and res["makespan_s"] == 4.0


def test_swap_scenario_whole_event_trace():
    # 7 usable GPU blocks of 4 tokens; two 12-token prompts (3 blocks each) with 6 output tokens each,
    # both at t=0; the link moves one 1 KiB block in 0.25 s.  B cannot grow at t=1 and nobody else can
    # make room, so B swaps itself out.  Its blocks stay cached on the GPU, but B does not come back
    # while there is no room for its next token as well (resumed, it could not run, and preempting it
    # again before it computed would be a swap loop); at t=5 A's growth evicts B's last cached block,
    # which comes back from the CPU at t=6, when A has finished.
    cfg = config(
        workload__arrival={"process": "bursty", "rate": 1.0, "burst_size": 2},
        workload__prompt_len={"dist": "fixed", "value": 12},
        workload__output_len={"dist": "fixed", "value": 6},
        runs=[{"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none"}],
    )
    res, sim = run(cfg, trace=True)
    assert sim.loop.trace == [
        (0.0, "arrival", 0),
        (0.0, "arrival", 1),
        (0.0, "admit", 0),
        (0.0, "admit", 1),
        (0.0, "step", ((0, 12), (1, 12))),
        (1.0, "transfer_start", (1, "swap_out", "D2H", 3, 1.75)),
        (1.0, "preempt_swap", 1),
        (1.0, "step", ((0, 1),)),
        (1.75, "transfer_done", 1),
        (2.0, "step", ((0, 1),)),
        (3.0, "step", ((0, 1),)),
        (4.0, "step", ((0, 1),)),
        (5.0, "step", ((0, 1),)),
        (6.0, "finish", 0),
        (6.0, "transfer_start", (2, "swap_in", "H2D", 1, 6.25)),
        (6.0, "resume", 1),
        (6.25, "transfer_done", 2),
        (6.25, "step", ((1, 1),)),
        (7.25, "step", ((1, 1),)),
        (8.25, "step", ((1, 1),)),
        (9.25, "step", ((1, 1),)),
        (10.25, "step", ((1, 1),)),
        (11.25, "finish", 1),
    ]
    assert res["preemptions_swap"] == 1 and res["gb_swapped_out"] == 3 * 1024 / 1e9
    assert res["blocks_held_at_end"] == {"gpu": 0, "cpu": 0}


def busy_config(**changes):
    base = dict(
        workload__num_requests=40,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 4, "high": 24},
        workload__output_len={"dist": "lognormal", "mean": 6, "sigma": 0.5, "min": 1, "max": 16},
        workload__system_prompts={"count": 2, "length": 8, "zipf": 1.0, "share": 0.6},
        workload__multi_turn={"prob": 0.4, "max_turns": 2},
        memory__gpu_kv_gib=24 * KIB_IN_GIB,
        memory__cpu_kv_gib=64 * KIB_IN_GIB,
        compute__fixed_step_s=None,
        compute__step_overhead_s=0.01,
        hardware={
            "name": "toy",
            "memory_gib": 1,
            "peak_bf16_flops": 1.0e9,
            "hbm_bytes_per_s": 1.0e8,
            "link": {"h2d_gbps": 1.0e-4, "per_copy_overhead_s": 1.0e-4},
            "step_model": TINY["hardware"]["step_model"],
            "skip_range_checks": True,
        },
        runs=[
            {
                "name": "recompute",
                "victim_policy": "last_admitted",
                "mode": "recompute",
                "offload": "none",
                "cpu_kv_gib": 0,
            },
            {"name": "swap", "victim_policy": "largest", "mode": "swap", "offload": "none"},
            {"name": "auto-wt", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
            {"name": "auto-evict", "victim_policy": "prefill_aware", "mode": "auto", "offload": "write_back"},
        ],
    )
    base.update(changes)
    return config(**base)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_conservation_under_preemption(index):
    res, sim = run(busy_config(), index)
    assert res["requests_finished"] == res["requests"] == 40
    assert res["output_tokens"] == res["requested_output_tokens"]
    assert res["blocks_held_at_end"] == {"gpu": 0, "cpu": 0}
    assert res["preemptions_swap"] + res["preemptions_recompute"] > 0  # tiny memory: there is preemption
    assert sim.scheduler.tm.requests() == [] and sim.scheduler.tm.plans_in_flight() == []
    sim.scheduler.tm.check_invariants()


def test_same_seed_same_json_different_seed_different():
    a, _ = run(busy_config(), 2)
    b, _ = run(busy_config(), 2)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c, _ = run(busy_config(seed=2), 2)
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_enough_memory_means_no_preemption():
    res, _ = run(busy_config(memory__gpu_kv_gib=4096 * KIB_IN_GIB), 1)
    assert res["preemptions_swap"] == res["preemptions_recompute"] == 0 and res["requests_finished"] == 40


def test_infinite_bandwidth_makes_swap_free():
    res, sim = run(busy_config(link={"h2d_gbps": math.inf, "per_copy_overhead_s": 0.0}), 1)
    assert res["preemptions_swap"] > 0 and res["gb_swapped_out"] > 0
    assert res["transfer_s"] == 0.0 and res["transfer_exposed_s"] == 0.0
    assert all(s == e for s, e, _, _ in sim.engine.intervals)


def test_zero_bandwidth_makes_cost_aware_never_swap():
    cfg = busy_config(
        link={"h2d_gbps": 0.0},
        runs=[{"name": "auto", "victim_policy": "cost_aware", "mode": "auto", "offload": "none"}],
    )
    res, _ = run(cfg)
    assert res["preemptions_swap"] == 0 and res["preemptions_recompute"] > 0
    assert res["requests_finished"] == 40 and res["gb_swapped_out"] == 0


BAD = [
    ({"memory__gpu_kv_gib": -4}, r"memory\.gpu_kv_gib: must be > 0, got -4"),
    ({"memory__block_size": 12}, r"memory\.block_size: must be a power of two, got 12"),
    ({"memory__blocksize": 16}, r"memory\.blocksize: unknown key"),
    ({"workload__arrival": {"rate": "fast"}}, r"workload\.arrival\.rate: expected an integer or a number, got str"),
    ({"workload__arrival": {"process": "gamma"}}, r"workload\.arrival\.process: must be one of"),
    ({"workload__prompt_len": {"dist": "uniform", "low": 9, "high": 3}}, r"workload\.prompt_len\.low: must be <="),
    ({"scheduler__max_num_seqs": 0}, r"scheduler\.max_num_seqs: must be > 0"),
    ({"compute__mfu": 1.5}, r"compute\.mfu: must be in \(0, 1\]"),
    ({"runs": [{"name": "x", "mode": "swap", "cpu_kv_gib": 0}]}, r"runs\[0\]\.mode: mode: swap needs a CPU tier"),
    ({"runs": [{"name": "x", "victim_policy": "random"}]}, r"runs\[0\]\.victim_policy: must be one of"),
    ({"runs": [{"name": "x"}, {"name": "x"}]}, r"runs: run names must be unique"),
    # Renamed keys and values are refused with the new name, never read under the old meaning.
    (
        {"runs": [{"name": "x", "policy": "lru"}]},
        r"runs\[0\]\.policy: 'lru' is not a scheduling order .*the victim policy is now victim_policy: last_admitted",
    ),
    (
        {"runs": [{"name": "x", "policy": "largest"}]},
        r"runs\[0\]\.policy: 'largest' is not a scheduling order .*victim_policy: largest",
    ),
    (
        {"runs": [{"name": "x", "victim_policy": "lru"}]},
        r"runs\[0\]\.victim_policy: 'lru' was renamed: .*'last_admitted'",
    ),
    (
        {"runs": [{"name": "x", "offload": "on_evict"}]},
        r"runs\[0\]\.offload: must be one of \['none', 'write_through', 'write_back'\]: 'on_evict' is now 'write_back'",
    ),
    ({"runs": [{"name": "x", "offload": "always"}]}, r"runs\[0\]\.offload: must be one of .*, got 'always'"),
    ({"scheduler__scheduling": "fcfs"}, r"scheduler\.scheduling: the scheduling order is now called policy"),
    (
        {"runs": [{"name": "x", "scheduling": "fcfs"}]},
        r"runs\[0\]\.scheduling: the scheduling order is now called policy",
    ),
    ({"memory__cpu_kv_gib": 2048}, r"memory\.cpu_kv_gib: 2048 GiB exceeds memory\.host_memory_gib"),
    ({"model": dict(TINY["model"], num_params=1.0e12)}, r"model: toy needs [\d.]+ GiB of weights per GPU"),
    ({"model": "gpt-9"}, r"model: no models profile 'gpt-9' \(known: codellama-34b, llama2-7b"),
    ({"workload__prompt_len": {"dist": "fixed", "value": 40}}, r"workload\.prompt_len: the longest request"),
    ({"sweep__rate": [1, -2]}, r"sweep\.rate\[1\]: must be a number > 0"),
    (
        {"hardware": dict(TINY["hardware"], pcie_efficiency=0)},
        r"hardware\.pcie_efficiency: renamed: give link\.h2d_gbps",
    ),
    (
        {"link__gbps_per_direction": 8.0},
        r"link\.gbps_per_direction: renamed: give link\.h2d_gbps: 8\.0 \(link\.d2h_gbps",
    ),
    ({"compute__per_step_s": 1e-3}, r"compute\.per_step_s: renamed: give compute\.step_overhead_s: 0\.001"),
]


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_configs_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        config(**changes)


def test_yaml_exponent_without_sign_gets_a_hint(tmp_path):
    from tiered_kv.sim.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("hardware: {peak_bf16_flops: 9.0e14}\n")
    with pytest.raises(ConfigError, match=r"hardware\.peak_bf16_flops: .* write 8\.0e\+9"):
        load_config(p)


def test_workload_shares_system_prompts_and_resends_history():
    cfg = busy_config(workload__num_requests=200)
    reqs = generate(cfg["workload"], 3)
    by_conv = {}
    for r in reqs:
        if r.turn == 0:
            assert 4 <= len(r.prompt) <= 24 + 8  # user message, plus the 8-token system prompt when shared
        else:
            prev = by_conv[r.conversation]
            assert r.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output
        by_conv[r.conversation] = r
    firsts = [tuple(r.prompt[:8]) for r in reqs if r.turn == 0]
    shared = [f for f in firsts if firsts.count(f) > 1]
    assert len(shared) > len(firsts) / 3  # system prompts recur
    assert all(1 <= len(r.output) <= 16 for r in reqs)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)


def test_trace_replay(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"arrival": 0.5, "prompt_tokens": [1, 2, 3, 4, 5], "output_len": 2}\n'
        '{"arrival": 0.0, "prompt_len": 6, "output_len": 3}\n'
    )
    reqs = load_trace(p)
    assert [(r.arrival, len(r.prompt), len(r.output)) for r in reqs] == [(0.0, 6, 3), (0.5, 5, 2)]
    assert reqs[1].prompt == [1, 2, 3, 4, 5]
    res, _ = run(config(workload__trace=str(p), workload__prompt_len={"dist": "fixed", "value": 4}))
    assert res["requests_finished"] == 2 and res["output_tokens"] == 5
    p.write_text('{"arrival": 0, "prompt_len": 3}\n')
    with pytest.raises(ConfigError, match="line 1: needs numeric 'arrival' and 'output_len'"):
        load_trace(p)


def test_cli_simulate_and_sweep_write_json_and_plots(tmp_path):
    import yaml

    raw = dict(TINY)
    raw["runs"] = [
        {"name": "recompute", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "swap", "mode": "swap"},
        {"name": "smart", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through"},
    ]
    raw["sweep"] = {"gpu_kv_gib": [8 * KIB_IN_GIB, 16 * KIB_IN_GIB], "rate": [0.5]}
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    lines = []
    doc = simulate(cfg, tmp_path / "out.json", tmp_path / "plots", emit=lines.append, progress=False)
    assert json.loads((tmp_path / "out.json").read_text())["runs"][0]["run"] == "recompute"
    assert len(doc["runs"]) == 3 and " 1 recompute: no CPU tier; the baseline" in printed(lines)
    for name in ("usage_over_time.png", "latency_cdf.png", "policies.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    s = sweep(cfg, tmp_path / "sweep.json", tmp_path / "plots", emit=lines.append, progress=False)
    assert len(s["rows"]) == 6 and len(s["verdicts"]) == 2
    assert [v["best_fixed"] for v in s["verdicts"]] == [None, None]  # no fixed-mode run has smart's CPU tier
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 1000
    from tiered_kv.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("memory: {block_size: 3}\n")
    assert main(["simulate", str(bad), "--no-progress"]) == 2


@pytest.mark.parametrize("index", [1, 2, 3])
def test_conservation_when_copies_fail_at_random(index):
    """Failed swap-outs, swap-ins, onboards and offloads: every request still finishes, nothing leaks."""
    from tiered_kv.sim.config import setup
    from tiered_kv.sim.simulator import Simulator
    from tiered_kv.sim.workload import generate

    cfg = busy_config()
    sim = Simulator(setup(cfg, index), generate(cfg["workload"], cfg["seed"]))
    sim.engine.failure_rate = 0.3
    res = sim.run()
    assert res["plans_failed"] > 0
    assert res["requests_finished"] == 40 and res["output_tokens"] == res["requested_output_tokens"]
    assert res["blocks_held_at_end"] == {"gpu": 0, "cpu": 0}
    sim.scheduler.tm.check_invariants()
