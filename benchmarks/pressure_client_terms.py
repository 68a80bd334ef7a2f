"""The llm-d CPU-tier replay, inference-perf's client settings added one at a time (docs/validation.md).

Simulates server 0 of ``configs/validation/llmd-qwen3-32b-tp2-h100-cpu-tier.yaml`` (its share of
the 8 servers' load) with each row's overrides, HBM only and with the CPU tier, and prints the
mean TTFT (s) / ITL (ms, ``(E2E - TTFT) / (output tokens - 1)``) of the stages at 5, 10, 20 and
40 requests/s.  With ``--reuse`` it instead counts, over all 8 servers and seeds 0 to 5, the
requests of the first stage whose system prompt an earlier request of the run sent: the most any
cache can serve in that stage.

Usage: python benchmarks/pressure_client_terms.py [--reuse]   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import sys
from typing import Any

from tiered_kv.sim import shared_prefix
from tiered_kv.sim.config import config_from_raw, setup
from tiered_kv.sim.shipped import shipped
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.validate import load_file
from tiered_kv.sim.workload import generate

NAME = "llmd-qwen3-32b-tp2-h100-cpu-tier"
S = "workload.shared_prefix."
# The simplest reading of the client (the shared_prefix defaults), then each of inference-perf's
# settings in turn; the file's own settings are row D.
A = {S + "order": "grouped", S + "restart_each_stage": False, S + "arrival": "even", S + "stage_gap_s": 0.0}
B = {**A, S + "order": "shuffled"}
C = {**B, S + "restart_each_stage": True}
# The H100 profile's vllm-v0 (vLLM 0.6.0 era) coefficients, configs/hardware/h100-sxm.yaml.
V0 = {
    "compute.hbm_efficiency": 0.6025,
    "compute.step_overhead_s": 4.136e-4,
    "compute.per_layer_s": 0.0,
    "compute.per_seq_s": 6.227e-5,
    "compute.frontend_s": 0.03265,
}
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("A grouped, even, back to back", A),
    ("B + shuffled", B),
    ("C + each stage starts over", C),
    ("D + Poisson, 600 s gaps (the file)", {}),
    ("E = D, vllm-v0 step coefficients", V0),
]
STAGES = (0, 1, 3, 7)


def terms(vf: Any) -> None:
    print(f"{'':36} {'run':9} | " + " | ".join(f"stage {k} TTFT/ITL" for k in STAGES))
    for label, overrides in ROWS:
        for i in range(2):
            cfg = config_from_raw(vf.raw, vf.name, {S + "replica": 0, **overrides})
            spec = shared_prefix.parse(cfg["workload"]["shared_prefix"])
            sim = Simulator(setup(cfg, i), generate(cfg["workload"], cfg["seed"]))
            res = sim.run()
            cells = []
            for k in STAGES:
                done = [
                    r
                    for r in sim.records.values()
                    if r.finish >= 0 and shared_prefix.stage_of(r.arrival, spec["stages"], spec["stage_gap_s"]) == k
                ]
                ttft = sum(r.first_token - r.arrival for r in done) / len(done)
                e2e = sum(r.finish - r.arrival for r in done) / len(done)
                cells.append(f"{ttft:7.2f} / {(e2e - ttft) / (spec['output_len'] - 1) * 1e3:5.1f}")
            print(f"{label:36} {res['run']:9} | " + " | ".join(cells), flush=True)


def reuse(vf: Any) -> None:
    raw = vf.raw["workload"]["shared_prefix"]
    for seed in range(6):
        total = again = 0
        for server in range(raw["replicas"]):
            spec = shared_prefix.parse({**raw, "seed": seed, "replica": server})
            seen: set[int] = set()
            for t, p in shared_prefix.schedule(spec):
                if shared_prefix.stage_of(t, spec["stages"], spec["stage_gap_s"]) != 0:
                    break
                system = p // spec["users_per_system"]
                total += 1
                again += system in seen
                seen.add(system)
        share = f"{again} of them ({again / total:.1%})"
        print(f"seed {seed}: first stage {total} requests, {share} to a system prompt sent before")


def main() -> None:
    vf = load_file(shipped("validation", NAME), NAME)
    if "--reuse" in sys.argv[1:]:
        reuse(vf)
    else:
        terms(vf)


if __name__ == "__main__":
    main()
