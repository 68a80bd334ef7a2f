"""Per-request rows (--requests) and the Chrome timeline (--timeline), checked against a hand-derived event trace.

The scenario is test_sim.py's swap scenario (async copies): A (0) and B (1), 12-token prompts
and 6 output tokens, both at t=0; B swaps itself out at t=1 (3 blocks, 1.0-1.75), comes back
from the GPU prefix cache at t=2, is swapped again without a copy at t=3, back at t=4, swapped
at t=5, and after A finishes at t=6 its last block comes back from the CPU (6.0-6.25); it
decodes from 6.25 to 11.25.
"""

import json

from simutil import config, run

from tiered_kv.cli.simulate import simulate
from tiered_kv.sim.records import jsonl
from tiered_kv.sim.timeline import chrome_trace


def swap_scenario(**changes):
    base = dict(
        workload__arrival={"process": "bursty", "rate": 1.0, "burst_size": 2},
        workload__prompt_len={"dist": "fixed", "value": 12},
        workload__output_len={"dist": "fixed", "value": 6},
        runs=[{"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none"}],
    )
    return config(**{**base, **changes})


def test_request_rows_match_the_event_trace():
    sim = run(swap_scenario())[1]
    rows = [json.loads(line) for line in jsonl(sim.records.values()).splitlines()]
    common = {
        "arrival": 0.0,
        "client_queue": 0.0,
        "admitted": 0.0,
        "first_token": 1.0,
        "prompt_tokens": 12,
        "output_tokens": 6,
    }
    assert rows == [
        {
            **common,
            "id": 0,
            "rid": 0,
            "finish": 6.0,
            "token_times": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "preemptions_swap": 0,
            "preemptions_recompute": 0,
            "swap_out_bytes": 0,
            "swap_in_bytes": 0,
            "onboard_bytes": 0,
            "recomputed_tokens": 0,
        },
        {
            **common,
            "id": 1,
            "rid": 1,
            "finish": 11.25,
            "token_times": [1.0, 7.25, 8.25, 9.25, 10.25, 11.25],  # swapped out after its first token
            "preemptions_swap": 1,  # at 1; it resumes only at 6, with room to run
            "preemptions_recompute": 0,
            "swap_out_bytes": 3 * 1024,
            "swap_in_bytes": 1024,  # the block the GPU evicted for A at t=5
            "onboard_bytes": 0,
            "recomputed_tokens": 0,
        },
    ]


def test_recompute_rows_count_the_tokens_computed_again():
    # The same scenario preempting by recompute.  At t=1 B drops its 12 computed tokens (3 blocks,
    # cached in the free queue deepest first); at t=5 A's fifth block evicts B's third.  At t=6 B
    # is admitted again with 13 known tokens: 8 come back from the GPU prefix cache, so the step
    # computes 5, of which 4 (tokens 8-11) had been computed before.
    cfg = swap_scenario(runs=[{"name": "rec", "victim_policy": "last_admitted", "mode": "recompute", "cpu_kv_gib": 0}])
    res, sim = run(cfg, trace=True)
    assert (1.0, "preempt_recompute", 1) in sim.loop.trace and (6.0, "step", ((1, 5),)) in sim.loop.trace
    b = sim.records[1]
    assert (b.admitted, b.first_token, b.finish) == (0.0, 1.0, 11.0)
    assert (b.preemptions_recompute, b.preemptions_swap, b.recomputed_tokens) == (1, 0, 4)
    assert sim.records[0].recomputed_tokens == 0 and res["output_tokens"] == 12


def test_rows_join_back_to_a_replayed_trace_by_id(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"id": "chat-7", "arrival": 0.5, "prompt_len": 4, "output_len": 2}\n'
        '{"arrival": 0.0, "prompt_len": 4, "output_len": 2}\n'
    )
    sim = run(config(workload__trace=str(trace)))[1]
    rows = [json.loads(line) for line in jsonl(sim.records.values()).splitlines()]
    assert [(r["id"], r["arrival"], r["prompt_tokens"]) for r in rows] == [(2, 0.0, 4), (("chat-7"), 0.5, 4)]


def test_chrome_trace_has_each_step_and_each_copy_on_its_track():
    sim = run(swap_scenario(), keep_timeline=True)[1]
    events = chrome_trace(sim, "swap", pid=3)
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"swap", "compute", "copies H2D", "copies D2H"}
    copies = [(e["name"], e["tid"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] != 1]
    assert copies == [("swap_out 1", 3, 1e6, 0.75e6), ("swap_in 2", 2, 6e6, 0.25e6)]
    steps = [(e["ts"], e["dur"], e["args"]["requests"]) for e in events if e["ph"] == "X" and e["tid"] == 1]
    # the steps of the hand-derived trace: 0-6 one a second; B alone from 6.25 to 11.25
    assert steps == [(t * 1e6, 1e6, 2 if t == 0 else 1) for t in range(6)] + [
        ((6.25 + k) * 1e6, 1e6, 1) for k in range(5)
    ]
    assert all(e["pid"] == 3 for e in events)


def test_blocking_trace_shows_the_wait_before_the_step():
    cfg = swap_scenario(
        runs=[{"name": "v0", "victim_policy": "last_admitted", "mode": "swap", "offload": "none", "copies": "blocking"}]
    )
    events = chrome_trace(run(cfg, keep_timeline=True)[1], "v0")
    waits = [(e["ts"], e["dur"]) for e in events if e["name"] == "waiting for copies"]
    assert waits == [(1e6, 0.75e6)]  # the step issued at 1.0 waits for the swap-out until 1.75


def test_simulate_writes_rows_and_trace_for_every_run(tmp_path):
    import yaml
    from simutil import TINY

    raw = dict(TINY)
    raw["workload"] = dict(TINY["workload"], arrival={"process": "bursty", "rate": 1.0, "burst_size": 2})
    raw["workload"]["prompt_len"] = {"dist": "fixed", "value": 12}
    raw["workload"]["output_len"] = {"dist": "fixed", "value": 6}
    raw["runs"] = [
        {"name": "rec", "mode": "recompute", "cpu_kv_gib": 0},
        {"name": "swap", "mode": "swap", "vs": "rec"},
    ]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    lines = []
    simulate(
        cfg,
        requests_path=tmp_path / "r.jsonl",
        timeline_path=tmp_path / "t.json",
        emit=lines.append,
        progress=False,
        workers=1,
    )
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(r["run"], r["rid"]) for r in rows] == [("rec", 0), ("rec", 1), ("swap", 0), ("swap", 1)]
    assert rows[3]["finish"] == 11.25 and rows[3]["swap_out_bytes"] == 3072
    doc = json.loads((tmp_path / "t.json").read_text())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "rec", 2: "swap"}
