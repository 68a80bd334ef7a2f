"""The simulator with tiers below the CPU: link arithmetic by hand, hits the tiers add, bad tier configs refused.

The tiny model here has a fast host link and a slow roof, so the manager's
quote always prefers loading a prefix to recomputing it, and a disk whose
every block costs a second and a quarter, so the arithmetic is easy to follow.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from simutil import TINY

import tiered_kv
from tiered_kv.errors import ConfigError, PlanError
from tiered_kv.sim.config import load_config, setup, validate_config
from tiered_kv.sim.profiles import load_hardware
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate
from tiered_kv.transfer.plan import PlanKind, TransferPlan

BLOCK = 1024  # bytes of one 4-token block of the tiny model
PCIE = 1.024e6  # bytes/s each way (link.h2d_gbps 1.024e-3)
DISK_BW = 1024.0  # bytes/s: a block's bytes take one second
DISK_LAT = 0.25  # seconds a block
STEP = 1.0  # compute.fixed_step_s
A = list(range(1, 13))  # three full blocks shared by the first and the third request


def tiny(tmp_path: Path, runs: list[dict[str, Any]], disk: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three requests: A's prompt at t=0, an unrelated one at t=10 (it evicts A from GPU and CPU), A's again at t=20."""
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"arrival": 0, "prompt_tokens": [*A, 500], "output_len": 1},
        {"arrival": 10, "prompt_tokens": [*range(100, 112), 501], "output_len": 1},
        {"arrival": 20, "prompt_tokens": [*A, 502], "output_len": 1},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = copy.deepcopy(TINY)
    raw["hardware"].update(
        peak_bf16_flops=1e6,  # recomputing 12 tokens is priced at about 48 s: loading always wins
        link={"h2d_gbps": PCIE / 1e9, "per_copy_overhead_s": 0.0},
        tiers={"disk": disk or {"bandwidth_gbps": DISK_BW / 1e9, "block_latency_us": DISK_LAT * 1e6}},
    )
    # GPU: 4 usable blocks (a request of 13 tokens fills them); CPU tier: 3 blocks (one prompt).
    raw["memory"] = {"block_size": 4, "gpu_blocks": 5, "cpu_blocks": 4, "activation_reserve_gib": 0}
    raw["workload"] = {"trace": str(trace)}
    raw["runs"] = runs
    return raw


CPU_ONLY = {"name": "cpu", "mode": "recompute", "offload": "write_through"}
WITH_DISK = {**CPU_ONLY, "name": "cpu+disk", "tiers": [{"type": "disk", "capacity_blocks": 16}]}


def simulate(cfg: dict[str, Any], index: int) -> tuple[dict[str, Any], Simulator]:
    sim = Simulator(setup(cfg, index), generate(cfg["workload"], cfg["seed"]), record_trace=True, keep_timeline=True)
    return sim.run(), sim


def test_a_prefix_evicted_to_disk_is_staged_through_the_cpu_then_copied_to_the_gpu_at_the_links_times(tmp_path):
    cfg = validate_config(tiny(tmp_path, [WITH_DISK]))
    res, sim = simulate(cfg, 0)
    disk = sim.tier_engines["DISK"]
    # A's and B's three blocks were written through to the disk: 3 blocks x (0.25 s + 1 s) each.
    stores = [(j.op, len(j.handle.keys), j.end - j.start) for j in disk.jobs if j.op == "store"]
    assert stores == [("store", 3, pytest.approx(3.75)), ("store", 3, pytest.approx(3.75))]
    (load,) = [j for j in disk.jobs if j.op == "load"]
    # The third request finds A's blocks on disk only, at its arrival: staged at once.
    assert (load.start, len(load.handle.keys)) == (20.0, 3)
    assert load.end == pytest.approx(20.0 + 3 * (DISK_LAT + BLOCK / DISK_BW))
    # Then the usual ONBOARD copy, CPU -> GPU, over the host link, starting when the staging lands.
    h2d = [(s, e, n) for s, e, d, n in sim.engine.intervals if d == "H2D"]
    assert h2d == [(pytest.approx(23.75), pytest.approx(23.75 + 3 * BLOCK / PCIE), 3 * BLOCK)]
    # The request runs in the step after its KV landed, and samples its first token at that step's end.
    q = sim.records[2]
    assert q.first_token == pytest.approx(23.75 + 3 * BLOCK / PCIE + STEP)
    # The manager priced the load with the profile's disk link and the host link: the same arithmetic.
    (decision,) = sim.scheduler.tm.load_log
    assert decision.num_blocks == 3 and decision.quote.media == ("DISK", "DISK", "DISK")
    assert decision.quote.load_s == pytest.approx(3 * (DISK_LAT + BLOCK / DISK_BW) + 3 * BLOCK / PCIE)
    tiers = res["lower_tiers"]["disk"]
    assert (tiers["hit_blocks"], tiers["loaded_blocks"], tiers["stored_blocks"]) == (3, 3, 6)
    assert tiers["load_busy_s"] == pytest.approx(3.75) and tiers["store_busy_s"] == pytest.approx(7.5)
    assert res["chain_lost_blocks"] == 0 and res["tiers"] == f"DISK {16 * BLOCK / 2**30:.4g} GiB"
    # The whole event trace from the third request's arrival: staged, copied to the GPU, one step.
    plan = load.handle.plan.plan_id
    assert [e for e in sim.loop.trace if e[0] >= 20.0] == [
        (20.0, "arrival", 2),
        (20.0, "tier_io_start", (plan, "DISK", "load", 3, 23.75)),
        (20.0, "admit", 2),
        (23.75, "tier_io_done", plan),
        (23.75, "transfer_start", (plan + 1, "onboard", "H2D", 3, 23.753)),
        (23.753, "transfer_done", plan + 1),
        (23.753, "step", ((2, 1),)),
        (24.753, "finish", 2),
    ]


def test_without_the_disk_the_same_prefix_is_recomputed(tmp_path):
    cfg = validate_config(tiny(tmp_path, [CPU_ONLY, WITH_DISK]))
    (without, sim0), (with_disk, _) = simulate(cfg, 0), simulate(cfg, 1)
    assert without["lower_tiers"] == {} and sim0.tier_engines == {}
    assert sim0.scheduler.tm.load_log == []
    assert sim0.records[2].first_token == 20.0 + STEP  # no hit anywhere: one (fixed-time) prefill step
    assert with_disk["lower_tiers"]["disk"]["hit_blocks"] == 3
    assert with_disk["cpu_prefix_hit_rate"] > without["cpu_prefix_hit_rate"] == 0.0


def test_a_remote_tier_alone_is_a_suffix_of_the_chain_and_uses_the_default_link(tmp_path):
    run = {**CPU_ONLY, "name": "cpu+remote", "tiers": [{"type": "redis", "capacity_blocks": 16}]}
    raw = tiny(tmp_path, [run])
    cfg = validate_config(raw)
    st = setup(cfg, 0)
    (tier,) = st.tiers.tiers
    assert (tier.medium, tier.link.source) == ("REMOTE", "default")  # the profile describes only its disk
    res, sim = simulate(cfg, 0)
    assert set(sim.tier_engines) == {"REMOTE"}
    assert res["tiers"] == f"REMOTE {16 * BLOCK / 2**30:.4g} GiB (default link)"
    assert res["lower_tiers"]["remote"]["hit_blocks"] == 3
    (load,) = [j for j in sim.tier_engines["REMOTE"].jobs if j.op == "load"]
    link = tier.link.read
    assert load.end - load.start == pytest.approx(3 * (link.block_latency_s + BLOCK / link.bytes_per_s))


def test_the_disk_write_bandwidth_is_its_own(tmp_path):
    disk = {"bandwidth_gbps": DISK_BW / 1e9, "write_gbps": 2 * DISK_BW / 1e9, "block_latency_us": DISK_LAT * 1e6}
    cfg = validate_config(tiny(tmp_path, [WITH_DISK], disk=disk))
    _, sim = simulate(cfg, 0)
    times = {(j.op, round(j.end - j.start, 9)) for j in sim.tier_engines["DISK"].jobs}
    assert times == {("store", 3 * (DISK_LAT + 0.5)), ("load", 3 * (DISK_LAT + 1.0))}


def test_the_tier_io_engine_refuses_a_plan_that_does_not_go_between_the_cpu_and_its_medium(tmp_path):
    cfg = validate_config(tiny(tmp_path, [WITH_DISK]))
    _, sim = simulate(cfg, 0)
    disk = sim.tier_engines["DISK"]
    before = list(disk.jobs)
    with pytest.raises(PlanError, match="moves CPU <-> DISK"):
        disk.submit(TransferPlan(999, "CPU", "GPU", (1,), (1,), PlanKind.ONBOARD))
    with pytest.raises(PlanError, match="slot 15 of the DISK store holds no entry"):
        disk.submit(TransferPlan(998, "DISK", "CPU", (15,), (1,), PlanKind.ONBOARD))
    assert disk.jobs == before


def test_the_h200_profile_names_its_disk_and_remote_links():
    hw = load_hardware("h200")
    disk, remote = hw.tiers["disk"], hw.tiers["remote"]
    assert (disk.read.bytes_per_s, disk.write.bytes_per_s, disk.read.block_latency_s) == (
        6.4e9,
        3.8e9,
        pytest.approx(40e-6),
    )
    assert (remote.read.bytes_per_s, remote.source) == (25e9, "profile")


def test_the_shipped_tiers_experiment_prices_each_tier_it_finds_prefix_in():
    # The CPU tier evicts a prompt's tail before its head (vLLM 0.33's request-scoped LRU), so what the
    # shipped h200 disk holds of a prompt is a tail (or a whole prompt), and at 6.4 GB/s one disk block
    # loads in 0.41 ms where its 16 tokens prefill in 0.34 ms: every disk hit is found, priced and declined,
    # and the cpu+disk run computes exactly what the cpu-tier run does.  The remote store's 25 GB/s link is
    # cheaper than prefill, so its hits are loaded.  (A faster disk pays off: the test below.)
    cfg = load_config("tiers-llama3-8b-h200", overrides={"workload.num_requests": 200})
    names = [r["name"] for r in cfg["runs"]]
    assert names == ["recompute-only", "cpu-tier", "cpu+disk", "cpu+disk+remote"]
    wl = generate(cfg["workload"], cfg["seed"])
    res = [Simulator(setup(cfg, i), wl).run() for i in range(len(names))]
    loaded = [r["cpu_prefix_hit_rate"] for r in res]
    computed = [r["tokens_computed"] for r in res]
    assert loaded[0] == 0.0 < loaded[1] == loaded[2] < loaded[3]
    assert computed[0] > computed[1] == computed[2] > computed[3]
    assert res[1]["lower_tiers"] == {}
    disk = res[2]["lower_tiers"]["disk"]
    assert disk["hit_blocks"] == disk["declined_blocks"] > 0 == disk["loaded_blocks"]
    assert "remote" not in res[2]["lower_tiers"]
    assert res[3]["lower_tiers"]["remote"]["hit_blocks"] > 0
    assert res[2]["chain_lost_blocks"] > 0 == res[3]["chain_lost_blocks"]  # the remote store holds every prompt


def test_a_disk_faster_than_prefill_per_block_finds_more_prefix_below_the_gpu_in_the_tiers_experiment():
    # The CPU tier evicts a prompt's tail before its head (vLLM 0.33's request-scoped LRU), so a prompt
    # below the GPU is a head on the CPU tier and a tail on the disk: the disk's blocks pay off only where
    # one block loads faster than its 16 tokens prefill (0.34 ms here).  At 10 GB/s a disk block loads in
    # 0.29 ms (link, 40 us latency, then the copy to the GPU), so the cpu+disk run must load from the disk.
    hw = yaml.safe_load((Path(tiered_kv.__file__).parent / "configs" / "hardware" / "h200.yaml").read_text())
    hw["tiers"]["disk"]["bandwidth_gbps"] = 10.0
    cfg = load_config("tiers-llama3-8b-h200", overrides={"workload.num_requests": 200, "hardware": hw})
    wl = generate(cfg["workload"], cfg["seed"])
    res = [Simulator(setup(cfg, i), wl).run() for i in (1, 2)]
    assert res[1]["lower_tiers"]["disk"]["loaded_blocks"] > 0
    assert res[0]["cpu_prefix_hit_rate"] < res[1]["cpu_prefix_hit_rate"]
    assert res[0]["tokens_computed"] > res[1]["tokens_computed"]


HW_TIERS_BAD = [
    ({"disk": {"bandwidth_gbps": -1, "block_latency_us": 1}}, r"hardware\.tiers\.disk\.bandwidth_gbps: must be > 0"),
    ({"disk": {"bandwidth_gbps": 0, "block_latency_us": 1}}, r"hardware\.tiers\.disk\.bandwidth_gbps: must be > 0"),
    ({"disk": {"bandwidth_gbps": math.nan, "block_latency_us": 1}}, r"hardware\.tiers\.disk\.bandwidth_gbps: must be"),
    ({"disk": {"bandwidth_gbps": 1, "block_latency_us": -5}}, r"hardware\.tiers\.disk\.block_latency_us: must be >= 0"),
    ({"disk": {"bandwidth_gbps": 1, "write_gbps": 0, "block_latency_us": 1}}, r"tiers\.disk\.write_gbps: must be > 0"),
    ({"disk": {"bandwidth_gbps": 1}}, r"hardware\.tiers\.disk\.block_latency_us: required"),
    ({"disk": {"bandwidth": 1, "block_latency_us": 1}}, r"hardware\.tiers\.disk\.bandwidth: unknown key"),
    ({"tape": {"bandwidth_gbps": 1, "block_latency_us": 1}}, r"hardware\.tiers\.tape: unknown key"),
    ({"disk": {"bandwidth_gbps": "fast", "block_latency_us": 1}}, r"hardware\.tiers\.disk\.bandwidth_gbps: expected"),
]


@pytest.mark.parametrize(("tiers", "message"), HW_TIERS_BAD)
def test_a_bad_tier_in_a_hardware_profile_is_refused_naming_its_key(tmp_path, tiers, message):
    raw = tiny(tmp_path, [WITH_DISK])
    raw["hardware"]["tiers"] = tiers
    before = json.dumps(raw, sort_keys=True)  # NaN != NaN, but its JSON text equals itself
    with pytest.raises(ConfigError, match=message):
        validate_config(raw)
    assert json.dumps(raw, sort_keys=True) == before


RUN_TIERS_BAD = [
    ([{"type": "disk", "capacity_gib": -1}], {}, r"runs\[0\]\.tiers\[0\]\.capacity_gib: must be > 0"),
    ([{"type": "disk", "capacity_gib": math.nan}], {}, r"runs\[0\]\.tiers\[0\]\.capacity_gib: must be a finite number"),
    ([{"type": "disk", "capacity_blocks": 0}], {}, r"runs\[0\]\.tiers\[0\]\.capacity_blocks: must be > 0"),
    ([{"type": "disk", "capacity_blocks": 1}], {}, r"runs\[0\]\.tiers\[0\]\.capacity_blocks: must be >= 2"),
    ([{"type": "disk", "capacity_gib": 1e-9}], {}, r"runs\[0\]\.tiers\[0\]\.capacity_gib: .* fewer than 2 blocks"),
    ([{"type": "disk", "capacity_gib": 1, "capacity_blocks": 4}], {}, r"runs\[0\]\.tiers\[0\]: give capacity_gib or"),
    ([{"type": "disk"}], {}, r"runs\[0\]\.tiers\[0\]: give capacity_gib or capacity_blocks"),
    (
        [{"type": "tape", "capacity_gib": 1}],
        {},
        r"runs\[0\]\.tiers\[0\]\.type: unknown tier type 'tape'; known types: \['disk', .*'redis'\]",
    ),
    ([{"capacity_gib": 1}], {}, r"runs\[0\]\.tiers\[0\]\.type: required key is missing"),
    ([{"type": "disk", "size": 1}], {}, r"runs\[0\]\.tiers\[0\]\.size: unknown key"),
    (
        [{"type": "disk", "capacity_blocks": 8}, {"type": "disk", "capacity_blocks": 8}],
        {},
        r"runs\[0\]\.tiers\[1\]\.type: a run has one tier per medium",
    ),
    (
        [{"type": "disk", "capacity_blocks": 8, "write_policy": "sometimes"}],
        {},
        r"runs\[0\]\.tiers\[0\]\.write_policy: must be one of",
    ),
    (
        [{"type": "disk", "capacity_blocks": 8, "write_policy": "on_evict"}],
        {},
        r"runs\[0\]\.tiers\[0\]\.write_policy: 'on_evict' is now 'write_back'",
    ),
    (
        [{"type": "disk", "capacity_blocks": 8, "demote": "write_back"}],
        {},
        r"runs\[0\]\.tiers\[0\]\.demote: is now write_policy:",
    ),
    (
        {"disk": {"capacity_blocks": 8}},
        {},
        r"runs\[0\]\.tiers: tiers are now a list of entries .*\[\{type: disk, \.\.\.\}\]",
    ),
    ("disk", {}, r"runs\[0\]\.tiers: expected a list"),
    ([{"type": "disk", "capacity_blocks": 8}], {"offload": "none"}, r"runs\[0\]\.tiers: .* offload: write_through"),
    (
        [{"type": "disk", "capacity_blocks": 8}],
        {"cpu_kv_gib": 0, "offload": "none"},
        r"runs\[0\]\.tiers: .* no CPU blocks",
    ),
    (
        [{"type": "disk", "capacity_blocks": 8, "write_policy": "write_back", "writeback_reserve": 9}],
        {},
        r"runs\[0\]\.tiers\[0\]\.writeback_reserve: 9 blocks is more than the disk tier holds \(8 blocks\)",
    ),
]


@pytest.mark.parametrize(("tiers", "run", "message"), RUN_TIERS_BAD)
def test_a_bad_tier_in_a_run_is_refused_naming_its_key(tmp_path, tiers, run, message):
    raw = tiny(tmp_path, [{**CPU_ONLY, "name": "bad", **run, "tiers": tiers}])
    before = json.dumps(raw, sort_keys=True)
    with pytest.raises(ConfigError, match=message):
        validate_config(raw)
    assert json.dumps(raw, sort_keys=True) == before


def test_the_timeline_has_a_track_per_tier_and_direction(tmp_path):
    from tiered_kv.sim.timeline import chrome_trace

    cfg = validate_config(tiny(tmp_path, [WITH_DISK]))
    _, sim = simulate(cfg, 0)
    events = chrome_trace(sim, "cpu+disk")
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tracks = {v: k for k, v in names.items()}
    assert {"DISK load", "DISK store"} <= set(tracks)
    loads = [e for e in events if e["ph"] == "X" and e["tid"] == tracks["DISK load"]]
    assert [(e["ts"], e["dur"], e["args"]["blocks"]) for e in loads] == [(20e6, 3.75e6, 3)]
    assert len([e for e in events if e["ph"] == "X" and e["tid"] == tracks["DISK store"]]) == 2
