"""The two hot-path shortcuts against their plain paths, on random workloads under copy faults.

* Skipping quiet allocations (the default; ``PlainPathTierManager`` reports nothing quiet)
  must decide exactly as calling ``TierManager.allocate`` for every scheduled
  request: same batches, preemptions, resumptions, admissions, loads and
  saves, the same GPU pool (tables, cached hashes, free order) after every
  schedule and update, same residencies, same decision log and counters at
  the end.
* Cost-aware pruning with the manager's ``preemption_bounds`` must pick the
  same victims as pricing every candidate (``CostAwarePolicy(None)``), and
  every bound must stay at or below the exact key ``quote.cost(mode) /
  quote.blocks_freed`` after every step.

Each run draws a set-up (offload none / write-through / on-evict, prefix
caching on or off, a CPU tier or none, ARC or LRU in the CPU store, a disk tier
below it, layer-wise resumption, token budgets down to one token, priority
scheduling, seat limits) and a workload with shared prefixes, aborts, and
copies that land late, out of order, fail or are cancelled.  Both runs draw
the same random choices, so any difference in what the scheduler did shows up
as a difference in the logs.  ``check_invariants`` and ``check_consistency``
run after every step.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from mgrutil import quiesce_disk
from plain_path import PlainPathTierManager
from poolutil import manager_snapshot
from tierutil import NS, host

from tiered_kv.core import Request
from tiered_kv.errors import PlanError
from tiered_kv.manager import CostModel, ManagerConfig, Residency, TierManager
from tiered_kv.manager.victim_policy import CostAwarePolicy
from tiered_kv.sched import Scheduler, SchedulerConfig
from tiered_kv.storage.spec import KVSpec
from tiered_kv.tiers.disk_io import DiskIO
from tiered_kv.tiers.disk_store import DiskStore
from tiered_kv.tiers.kinds.disk import DiskTierConfig
from tiered_kv.tiers.lower_tier import LowerTier
from tiered_kv.transfer import ControlledCopyEngine

NUM_REQUESTS = 16


def draw_setup(seed: int) -> dict:
    """A random set-up; the same seed always gives the same one."""
    r = random.Random(seed * 7919 + 1)
    caching = r.random() < 0.75
    offload = r.choice(["none", "write_through", "write_back"]) if caching else "none"
    cpu = r.choice([0, 6, 12, 30]) if offload == "none" else r.choice([6, 12, 30])
    disk = caching and cpu > 0 and offload != "none" and r.random() < 0.3
    bs = 4 if disk else r.choice([2, 4])
    return {
        "caching": caching,
        "offload": offload,
        "cpu": cpu,
        "disk": disk,
        "demote": r.choice(["write_through", "write_back"]),
        "bs": bs,
        # Every request fits alone (3 prefix blocks, 10 prompt tokens, 14 outputs), some barely.
        "gpu": -(-(3 * bs + 24) // bs) + 1 + r.choice([0, 1, 2, 4]),
        "mode": r.choice(["swap", "recompute", "auto"]) if cpu else "recompute",
        "layerwise": cpu > 0 and r.random() < 0.5,
        "budget": r.choice([1, 2, 3, 5, 8, 64]),
        "victim_policy": r.choice(["last_admitted", "cost_aware", "largest", "prefill_aware"]),
        "policy": r.choice(["fcfs", "priority"]),
        "seats": r.choice([2, 4, 256]),
        "evict_window": r.choice([1, 2, 64]),
        "store_policy": r.choice(["lru", "arc"]),
        "overhead": r.choice([0.0, 1e-6, 1e-4]),
        "bandwidth": r.choice([1e6, 1e9, 1e12]),
        "p_fail": r.choice([0.0, 0.05, 0.2]),
        "p_cancel": r.choice([0.0, 0.05]),
        "p_abort": r.choice([0.0, 0.02, 0.08]),
        "shared": r.random() < 0.6,
    }


def on_gpu_bounds_hold(tm: TierManager) -> int:
    """Every bound of every request on the GPU, both levels, all modes, is at most its exact key."""
    on_gpu = [rid for rid in tm.requests() if tm.residency(rid) is Residency.GPU]
    checked = 0
    for mode in ("auto", "swap", "recompute"):
        for lookups in (False, True):
            for rid, bound in zip(on_gpu, tm.preemption_bounds(on_gpu, mode, lookups), strict=True):
                q = tm.quote(rid)
                key = q.cost(mode) / q.blocks_freed if q.blocks_freed else math.inf
                assert bound <= key * (1 + 1e-9), (rid, mode, lookups, bound, key, q)
                checked += 1
    return checked


def drive(
    seed: int,
    tmp: Path,
    *,
    skip: bool = True,
    victim_policy: str | None = None,
    exact: bool = False,
    bounds: bool = False,
) -> tuple[list, int]:
    """One random run, step by step; returns its whole log and how many bounds were checked."""
    p = draw_setup(seed)
    if victim_policy is not None:
        p["victim_policy"] = victim_policy
    rng = random.Random(seed)
    bs = p["bs"]
    eng = ControlledCopyEngine({"GPU": p["gpu"], "CPU": max(p["cpu"], 2)})
    spec = KVSpec(2, 2, 8, "float16", bs)  # with bs=4: the disk tier's geometry
    cm = CostModel(
        kv_bytes_per_token=spec.bytes_per_token,
        block_size=bs,
        d2h_bytes_per_s=p["bandwidth"],
        h2d_bytes_per_s=p["bandwidth"],
        per_copy_overhead_s=p["overhead"],
        prefill_tokens_per_s=1e4,
    )
    config = ManagerConfig(
        p["gpu"],
        p["cpu"],
        bs,
        offload=p["offload"],
        enable_caching=p["caching"],
        evict_window=p["evict_window"],
        store_policy=p["store_policy"],
    )
    tm = (TierManager if skip else PlainPathTierManager)(
        config, eng, cost_model=cm, kv_spec=spec if p["layerwise"] else None
    )
    closers: list = []
    if p["disk"]:
        disk = DiskStore(tmp, NS, 10 * 4096)
        io = DiskIO(host(num_blocks=p["cpu"]), disk)
        closers = [io, disk]
        tm.attach_tiers([LowerTier(disk, io, DiskTierConfig.default_link, p["demote"], 4)])
    config = SchedulerConfig(
        max_num_batched_tokens=p["budget"],
        max_num_seqs=p["seats"],
        mode=p["mode"],
        layerwise=p["layerwise"],
        victim_policy=p["victim_policy"],
        policy=p["policy"],
    )
    s = Scheduler(tm, config)
    if exact:
        s.victim_policy = CostAwarePolicy(None)  # prices every candidate: a full sort
    prefix = [rng.randrange(3) for _ in range(3 * bs)]  # a small vocabulary: prefixes are shared often
    log: list = []
    n = checked = 0
    try:
        for step in range(600):
            if n < NUM_REQUESTS and rng.random() < 0.6:
                head = prefix[: rng.randrange(len(prefix) + 1)] if p["shared"] and rng.random() < 0.6 else []
                prompt = head + [rng.randrange(4) for _ in range(rng.randint(1, 10))]
                req = Request(n, prompt, max_tokens=rng.randint(1, 14), priority=rng.randrange(3))
                req.arrival_time = float(step)
                s.add_request(req)
                n += 1
            if s.requests and rng.random() < p["p_abort"]:
                victim = rng.choice(sorted(s.requests))
                s.abort(victim)
                log.append(("abort", victim))
            pending = list(eng.pending.items())
            x = rng.random()
            if pending and x < p["p_fail"]:
                pid, _ = rng.choice(pending)
                eng.fail(pid)
                log.append(("fail", pid))
            elif pending and x < p["p_fail"] + p["p_cancel"]:
                pid, h = rng.choice(pending)
                eng.cancel(h)
                log.append(("cancel", pid))
            elif x < 0.6:  # some of the copies land, in a random order
                ready = [pid for pid, h in eng.pending.items() if h.num_opened == h.plan.num_layers]
                rng.shuffle(ready)
                for pid in ready[: rng.randint(0, len(ready))]:
                    try:
                        eng.complete(pid)
                    except PlanError:
                        pass  # ordered after a copy still pending: it lands later
            quiesce_disk(tm)
            out = s.schedule()
            if bounds:
                checked += on_gpu_bounds_hold(tm)
            log.append(
                (
                    step,
                    [(r.request_id, k) for r, k in out.scheduled],
                    out.preempted,
                    out.resumed,
                    out.admitted,
                    sorted(out.loads),
                    sorted(out.saves),
                    out.num_tokens,
                    out.recomputed_tokens,
                )
            )
            log.append(manager_snapshot(tm.gpu))  # the GPU pool and tables exactly: what is cached, the free order
            for rid, h in out.loads.items():  # a layer-wise load may fail under the step that reads it
                if rng.random() < p["p_fail"] and h.plan.plan_id in eng.pending:
                    eng.fail(h.plan.plan_id)
                    log.append(("failed load", rid))
            for _ in range(4):  # the step waits for every layer it reads: land what can land
                for pid, h in list(eng.pending.items()):
                    ready = h.num_opened == h.plan.num_layers
                    if out.loads and ready and not any(w in eng.pending for w in h.plan.wait_for):
                        eng.complete(pid)
            sampled = {r.request_id: rng.randrange(4) for r, k in out.scheduled if out.needs_sample(r, k)}
            if out.scheduled and rng.random() < p["p_abort"]:  # dropped while its step computes (its token is ignored)
                victim = rng.choice(out.scheduled)[0].request_id
                s.abort(victim)
                log.append(("abort in step", victim))
            log.append(("finished", [r.request_id for r in s.update(out, sampled)]))
            s.check_consistency()
            tm.check_invariants()
            tables = []
            for rid in tm.requests():
                res = tm.residency(rid)
                gpu = tm.gpu_block_ids(rid) if res is Residency.GPU else None
                tables.append((rid, res.name, gpu, tm.cpu_block_ids(rid)))
            log.append(tables)
            log.append(manager_snapshot(tm.gpu))
            if n == NUM_REQUESTS and not s.num_unfinished:
                break
            if not out.scheduled and rng.random() < 0.5:
                eng.complete_all()
        for _ in range(20):
            quiesce_disk(tm)
            eng.complete_all()
            s.settle()
        log.append((s.num_unfinished, s.copies_in_flight(), s.tm.metrics().counters, s.tm.metrics().lower_tiers))
        log.append([(d.tick, d.request_id, d.mode, d.reason, d.quote) for d in tm.decision_log])
    finally:
        for c in closers:
            c.close()
    return log, checked


def preemptions(log: list) -> int:
    return sum(len(e[2]) for e in log if isinstance(e, tuple) and len(e) == 9)


SEEDS_PER_CHUNK = 20


@pytest.mark.parametrize("chunk", range(6))
def test_skipping_quiet_allocations_decides_the_same_under_faults(chunk, tmp_path):
    preempted = 0
    for seed in range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK):
        fast, _ = drive(seed, tmp_path / f"fast{seed}", skip=True)
        plain, _ = drive(seed, tmp_path / f"plain{seed}", skip=False)
        assert fast == plain, (seed, draw_setup(seed))
        assert fast[-2][0] == 0, seed  # every request finished or was aborted
        preempted += preemptions(fast)
    assert preempted > 0  # the set-ups are tight enough to preempt


def test_the_random_set_ups_cover_what_they_claim():
    """The draws above reach every set-up they are meant to, and the runs really preempt and resume."""
    setups = [draw_setup(seed) for seed in range(6 * SEEDS_PER_CHUNK)]
    for field, values in (
        ("offload", {"none", "write_through", "write_back"}),
        ("caching", {True, False}),
        ("layerwise", {True, False}),
        ("disk", {True, False}),
        ("mode", {"swap", "recompute", "auto"}),
        ("store_policy", {"lru", "arc"}),
    ):
        assert {p[field] for p in setups} == values, field
    assert any(p["budget"] == 1 for p in setups) and any(p["cpu"] == 0 for p in setups)


@pytest.mark.parametrize("chunk", range(4))
def test_pruned_cost_aware_decides_as_full_pricing_and_bounds_hold_under_faults(chunk, tmp_path):
    preempted = checked = 0
    for seed in range(chunk * SEEDS_PER_CHUNK, (chunk + 1) * SEEDS_PER_CHUNK):
        pruned, n = drive(seed, tmp_path / f"pruned{seed}", victim_policy="cost_aware", bounds=True)
        full, _ = drive(seed, tmp_path / f"full{seed}", victim_policy="cost_aware", exact=True)
        assert pruned == full, (seed, draw_setup(seed))
        assert pruned[-2][0] == 0, seed
        preempted += preemptions(pruned)
        checked += n
    assert preempted > 0 and checked > 0
