"""One workload shared by every run of a regime, and the collector frozen during a run: nothing changes."""

from __future__ import annotations

import hashlib

from simutil import config

from tiered_kv.sim.config import setup
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import SimRequest, generate

RUNS = [
    {"name": "recompute", "victim_policy": "last_admitted", "mode": "recompute", "offload": "none", "cpu_kv_gib": 0},
    {"name": "swap", "victim_policy": "last_admitted", "mode": "swap", "offload": "none"},
    {"name": "auto", "victim_policy": "cost_aware", "mode": "auto", "offload": "write_through", "copies": "layerwise"},
]


def _cfg() -> dict:
    return config(
        workload__num_requests=24,
        workload__arrival={"process": "poisson", "rate": 4.0},
        workload__prompt_len={"dist": "uniform", "low": 3, "high": 13},
        workload__output_len={"dist": "uniform", "low": 2, "high": 14},
        scheduler__max_num_batched_tokens=16,
        runs=RUNS,
    )


def _snapshot(workload: list[SimRequest]) -> list[tuple]:
    return [
        (r.rid, r.arrival, list(r.prompt), list(r.output), r.conversation, r.turn, r.id, r.hashes, r.hashed_len)
        for r in workload
    ]


def _run(cfg: dict, index: int, workload: list[SimRequest]) -> tuple[str, dict]:
    sim = Simulator(setup(cfg, index), workload, record_trace=True)
    res = sim.run()
    assert len(sim.loop.trace) > len(workload)  # arrivals, steps and finishes at least
    return hashlib.sha256(repr(sim.loop.trace).encode()).hexdigest(), res


def test_runs_sharing_one_workload_decide_as_runs_on_their_own_copies():
    cfg = _cfg()
    shared = generate(cfg["workload"], cfg["seed"])
    before = _snapshot(shared)
    for i in range(len(RUNS)):
        on_shared = _run(cfg, i, shared)
        assert _snapshot(shared) == before  # read only: the next run sees the workload the first one saw
        assert on_shared == _run(cfg, i, generate(cfg["workload"], cfg["seed"]))
    assert before == _snapshot(generate(cfg["workload"], cfg["seed"]))
