"""The benchmark client: a concurrency cap, sessions with a think time, and inter-token latency.

Every schedule here is worked out by hand on the tiny config of ``simutil`` (every step takes
1 s, no front end): the exact time each request is sent, each token reaches the client, and
each request finishes.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import yaml
from simutil import TINY, config, run

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim.config import config_from_raw, read_config, setup
from tiered_kv.sim.records import jsonl
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

ROOT = Path(__file__).resolve().parent.parent


def _trace(tmp_path: Path, rows: list[dict]) -> str:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def _times(sim: Simulator) -> list[tuple]:
    """(id, sent, client queue, token times, finish) of every request, in rid order."""
    recs = sorted(sim.records.values(), key=lambda r: r.rid)
    return [(r.id, r.arrival, r.client_queue, r.token_times, r.finish) for r in recs]


# r1 finishes first (one output token); r2, ready at 0.5 while two are in flight, takes its slot.
FOUR = [
    {"id": "r0", "arrival": 0, "prompt_len": 4, "output_len": 3},
    {"id": "r1", "arrival": 0, "prompt_len": 4, "output_len": 1},
    {"id": "r2", "arrival": 0.5, "prompt_len": 4, "output_len": 2},
    {"id": "r3", "arrival": 5, "prompt_len": 4, "output_len": 1},
]


def test_a_concurrency_cap_sends_a_ready_request_when_a_slot_frees(tmp_path):
    res, sim = run(config(workload__trace=_trace(tmp_path, FOUR), workload__concurrency=2), trace=True)
    assert sim.loop.trace == [
        (0.0, "arrival", 0),
        (0.0, "arrival", 1),
        (0.0, "admit", 0),
        (0.0, "admit", 1),
        (0.0, "step", ((0, 4), (1, 4))),  # both prefills: r0's first token and r1's only one at 1 s
        (1.0, "finish", 1),
        (1.0, "arrival", 2),  # r1's slot: r2, ready since 0.5, is sent at once
        (1.0, "admit", 2),
        (1.0, "step", ((0, 1), (2, 4))),
        (2.0, "step", ((0, 1), (2, 1))),
        (3.0, "finish", 0),
        (3.0, "finish", 2),
        (5.0, "arrival", 3),  # a slot is free when r3 is ready: sent at its own time
        (5.0, "admit", 3),
        (5.0, "step", ((3, 4),)),
        (6.0, "finish", 3),
    ]
    assert _times(sim) == [
        ("r0", 0.0, 0.0, [1.0, 2.0, 3.0], 3.0),
        ("r1", 0.0, 0.0, [1.0], 1.0),
        ("r2", 1.0, 0.5, [2.0, 3.0], 3.0),
        ("r3", 5.0, 0.0, [6.0], 6.0),
    ]
    # TTFT counts from the send, as vLLM's client measures it; the wait before is the client queue.
    assert res["ttft_s"] == {"p50": 1.0, "p90": 1.0, "p99": 1.0}
    assert res["client_queue_s"]["p50"] == 0.0 and res["client_queue_s"]["p99"] == pytest.approx(0.485)
    assert res["itl_s"] == {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}


def test_without_a_cap_the_same_trace_is_sent_at_its_own_times(tmp_path):
    _, sim = run(config(workload__trace=_trace(tmp_path, FOUR)))
    assert [(i, sent, q) for i, sent, q, _, _ in _times(sim)] == [
        ("r0", 0.0, 0.0),
        ("r1", 0.0, 0.0),
        ("r2", 0.5, 0.0),
        ("r3", 5.0, 0.0),
    ]


def test_an_infinite_rate_under_a_cap_is_a_closed_loop_of_n_in_flight():
    # vllm bench serve's default --request-rate inf with --max-concurrency 2: all four ready at 0,
    # two sent at 0, the other two when those finish (prefill 0-1, decode 1-2).
    res, sim = run(config(workload__num_requests=4, workload__arrival={"rate": float("inf")}, workload__concurrency=2))
    assert _times(sim) == [
        (0, 0.0, 0.0, [1.0, 2.0], 2.0),
        (1, 0.0, 0.0, [1.0, 2.0], 2.0),
        (2, 2.0, 2.0, [3.0, 4.0], 4.0),
        (3, 2.0, 2.0, [3.0, 4.0], 4.0),
    ]
    assert res["makespan_s"] == 4.0 and res["ttft_s"]["p99"] == 1.0


SESSIONS = [
    {"id": "a1", "session": "a", "arrival": 0, "prompt_len": 4, "output_len": 2},
    {"id": "b1", "session": "b", "arrival": 0, "prompt_len": 4, "output_len": 1},
    {"id": "a2", "session": "a", "arrival": 0.1, "prompt_len": 4, "output_len": 1},  # its time is ignored
]


def test_a_sessions_next_turn_is_sent_a_think_time_after_the_answer(tmp_path):
    _, sim = run(config(workload__trace=_trace(tmp_path, SESSIONS), workload__think_s=0.5))
    # a1's answer is complete at 2 s (prefill 0-1, decode 1-2): a2 is sent at 2.5 and runs 2.5-3.5.
    assert _times(sim) == [
        ("a1", 0.0, 0.0, [1.0, 2.0], 2.0),
        ("b1", 0.0, 0.0, [1.0], 1.0),
        ("a2", 2.5, 0.0, [3.5], 3.5),
    ]


def test_sessions_under_a_cap_of_one(tmp_path):
    cfg = config(workload__trace=_trace(tmp_path, SESSIONS), workload__think_s=0.5, workload__concurrency=1)
    _, sim = run(cfg)
    # a1 0-2; b1, ready at 0, gets the slot at 2 and runs 2-3; a2, ready at 2.5, gets it at 3.
    assert _times(sim) == [
        ("a1", 0.0, 0.0, [1.0, 2.0], 2.0),
        ("b1", 2.0, 2.0, [3.0], 3.0),
        ("a2", 3.0, 0.5, [4.0], 4.0),
    ]


def test_a_synthetic_conversation_waits_for_its_previous_answer():
    cfg = config(
        workload__num_requests=6,
        workload__multi_turn={"prob": 1.0, "max_turns": 3},
        workload__think_s=0.25,
        memory__gpu_kv_gib=64 * 1024 / 2**30,
    )
    wl = generate(cfg["workload"], cfg["seed"])
    _, sim = run(cfg)
    done = {r.rid: r for r in sim.records.values()}
    follows = 0
    by_conv: dict[int, list] = {}
    for r in sorted(wl, key=lambda r: (r.conversation, r.turn)):
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        for prev, nxt in pairwise(turns):
            assert done[nxt.rid].arrival == done[prev.rid].finish + 0.25
            follows += 1
    assert follows >= 2


def test_inter_token_latency_is_pooled_over_requests_as_vllms_client_pools_it():
    # The swap scenario of test_sim: A's tokens at 1, 2, ..., 6 s; B's first at 1 s, then B is swapped
    # out and its other five come at 7.25, 8.25, ..., 11.25 s.  Gaps: nine of 1 s and one of 6.25 s.
    cfg = config(
        workload__arrival={"process": "bursty", "rate": 1.0, "burst_size": 2},
        workload__prompt_len={"dist": "fixed", "value": 12},
        workload__output_len={"dist": "fixed", "value": 6},
        runs=[{"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none"}],
    )
    res, sim = run(cfg)
    assert [r.token_times for r in sorted(sim.records.values(), key=lambda r: r.rid)] == [
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        [1.0, 7.25, 8.25, 9.25, 10.25, 11.25],
    ]
    # numpy's default (linear) percentile of [1]*9 + [6.25]: p90 = 1 + 5.25 * 0.1, p99 = 1 + 5.25 * 0.91.
    assert res["itl_s"] == pytest.approx({"p50": 1.0, "p90": 1.525, "p99": 5.7775, "mean": 15.25 / 10})
    np = pytest.importorskip("numpy")
    gaps = [1.0] * 9 + [6.25]
    assert res["itl_s"]["p99"] == pytest.approx(float(np.percentile(gaps, 99)))
    # TPOT averages each request's gaps first: B's is (11.25 - 1) / 5 = 2.05; no ITL percentile is.
    assert res["tpot_s"]["p99"] == pytest.approx(1.0 + 1.05 * 0.99)
    rows = [json.loads(x) for x in jsonl(sim.records.values()).splitlines()]
    assert rows[1]["token_times"] == [1.0, 7.25, 8.25, 9.25, 10.25, 11.25] and rows[1]["client_queue"] == 0.0


def test_the_requests_file_and_the_json_carry_token_times_and_itl(tmp_path, capsys):
    trace = _trace(tmp_path, FOUR)
    cfg = tmp_path / "c.yaml"
    raw = dict(TINY, workload={"trace": trace, "concurrency": 2})
    cfg.write_text(yaml.safe_dump(raw))
    out, reqs = tmp_path / "o.json", tmp_path / "r.jsonl"
    assert main(["simulate", str(cfg), "--json", str(out), "--requests", str(reqs), "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("tiny, load: at most 2 requests in flight; toy on toy, "), first
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["itl_s"] == {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}
    rows = {r["id"]: r for r in map(json.loads, reqs.read_text().splitlines())}
    assert rows["r2"]["token_times"] == [2.0, 3.0] and rows["r2"]["client_queue"] == 0.5
    assert rows["r2"]["arrival"] == 1.0 and rows["r0"]["token_times"] == [1.0, 2.0, 3.0]


def test_the_mooncake_conversations_as_sessions_under_a_cap():
    """The shipped trace's first two minutes, every 2nd conversation, as sessions with at most 4 in flight.

    Checked on every request: no more than 4 in flight at any time; a request waited for a slot
    only while 4 were in flight; each later turn of a conversation was ready exactly the think
    time after its previous turn's last token.
    """
    raw, stem = read_config("mooncake-llama3-8b-h200")
    changes = {
        "workload.trace_sample.window_s": [0, 120],
        "workload.concurrency": 4,
        "workload.think_s": 3.0,
        "runs": [raw["runs"][0]],
    }
    cfg = config_from_raw(raw, stem, changes)
    wl = generate(cfg["workload"], cfg["seed"])
    sim = Simulator(setup(cfg, 0), wl)
    res = sim.run()
    recs = {r.rid: r for r in sim.records.values()}
    assert res["requests_finished"] == len(wl) > 20
    sent = sorted((r.arrival, 1) for r in recs.values()) + sorted((r.finish, -1) for r in recs.values())
    level = 0
    for _, d in sorted(sent, key=lambda e: (e[0], e[1])):  # a finish at t frees its slot before a send at t
        level += d
        assert level <= 4
    assert sum(1 for r in recs.values() if r.client_queue > 0) > len(recs) // 2  # the cap binds
    for r in recs.values():
        if r.client_queue > 0:
            ready = r.arrival - r.client_queue
            busy = sum(1 for o in recs.values() if o.arrival <= ready < o.finish)
            assert busy == 4, (r.rid, ready, busy)
    turns: dict[int, list] = {}
    for w in sorted(wl, key=lambda w: (w.conversation, w.turn)):
        turns.setdefault(w.conversation, []).append(w)
    follow_ups = 0
    for conv in turns.values():
        for prev, nxt in pairwise(conv):
            r = recs[nxt.rid]
            assert r.arrival - r.client_queue == pytest.approx(recs[prev.rid].finish + 3.0, abs=1e-9)
            follow_ups += 1
    assert follow_ups > 5
    assert res["itl_s"]["p50"] > 0 and res["itl_s"]["p99"] >= res["itl_s"]["p50"]


BAD = [
    ({"workload__concurrency": 0}, r"workload\.concurrency: must be > 0, got 0"),
    ({"workload__concurrency": -3}, r"workload\.concurrency: must be > 0, got -3"),
    ({"workload__concurrency": 2.5}, r"workload\.concurrency: expected an integer, got float 2\.5"),
    ({"workload__concurrency": True}, r"workload\.concurrency: expected an integer, got bool True"),
    ({"workload__think_s": "soon"}, r"workload\.think_s: expected an integer or a number, got str 'soon'"),
    ({"workload__think_s": -1}, r"workload\.think_s: must be >= 0, got -1"),
    (
        {"workload__think_s": 1.0},
        r"workload\.think_s: times a conversation's next turn, but this synthetic workload has no next turns",
    ),
    (
        {"workload__arrival": {"rate": float("inf")}},
        r"workload\.arrival\.rate: must be a finite number, got inf \(\.inf, every request ready at 0, is a load "
        r"only with workload\.concurrency",
    ),
    (
        {"workload__trace_scale": {"speedup": 2.0}},
        r"workload\.trace_scale\.speedup: scales a replayed trace's times, but workload\.trace is not set",
    ),
]


@pytest.mark.parametrize(("changes", "message"), BAD)
def test_bad_load_settings_name_the_key(changes, message):
    with pytest.raises(ConfigError, match=message):
        config(**changes)


def test_a_think_time_on_a_trace_without_conversations_is_refused(tmp_path):
    trace = _trace(tmp_path, FOUR)
    with pytest.raises(ConfigError, match=r"workload\.think_s: the replayed requests of .* hold no conversation of"):
        run(config(workload__trace=trace, workload__think_s=1.0))
