"""Helpers for tier-manager tests: tiny managers, exact snapshots (public API only)."""

from __future__ import annotations

from poolutil import letters, pool_snapshot, queue

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, ManagerConfig, TierManager
from tiered_kv.transfer import ControlledCopyEngine

BS = 4


def make_tm(gpu: int = 9, cpu: int = 9, bs: int = BS, **kw) -> tuple[TierManager, ControlledCopyEngine]:
    engine = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)}, bytes_per_block=bs * 1024)
    cm = kw.pop("cost_model", None) or CostModel(kv_bytes_per_token=1024, block_size=bs)
    return TierManager(ManagerConfig(gpu, cpu, bs, **kw), engine, cost_model=cm), engine


def run(tm: TierManager, rid: str, text: str) -> Request:
    """Admit a whole prompt, compute it in one step (as a scheduler would), report it computed."""
    req = Request(rid, letters(text))
    res = tm.admit(req, req.num_tokens)
    assert res is not None and res.runnable
    req.num_computed_tokens = res.num_computed_tokens + res.num_new_tokens  # the scheduler's job
    assert req.num_computed_tokens == req.num_tokens
    tm.on_tokens_computed(rid)
    return req


def settle(tm: TierManager, eng: ControlledCopyEngine) -> list:
    """Complete every copy in flight (in an order their waits allow) and poll."""
    eng.complete_all()
    return tm.poll()


def gq(tm: TierManager) -> list[str]:
    return queue(tm.gpu.block_pool)


def store_snapshot(tm: TierManager) -> tuple:
    return (
        tuple((repr(e.key), e.block_id, e.ready, e.ref_cnt) for e in tm.store.entries()),
        tuple(tm.store.free_block_ids()),
        tm.store.stats,
    )


def tm_snapshot(tm: TierManager) -> tuple:
    return (
        pool_snapshot(tm.gpu.block_pool),
        store_snapshot(tm),
        {rid: (tm.residency(rid), tm.gpu_block_ids(rid), tm.cpu_block_ids(rid)) for rid in tm.requests()},
        [p.plan_id for p in tm.plans_in_flight()],
        tm.metrics().to_dict(),
        len(tm.decision_log),
    )


def cq(tm: TierManager) -> list[str]:
    """CPU store entries in eviction order: ``"3"`` ready, ``"3@2"`` pinned by 2 loads, ``"3~"`` being written."""
    out = []
    for e in tm.store.entries():
        out.append(f"{e.block_id}" + ("~" if not e.ready else f"@{e.ref_cnt}" if e.ref_cnt else ""))
    return out


def quiesce_disk(tm: TierManager) -> None:
    """Wait for the disk tier's moves in flight, so that a random run sees them land at the same step."""
    for p in tm.plans_in_flight():
        if "DISK" in (p.src_medium, p.dst_medium):
            h = tm.handle(p.plan_id)
            if h is not None:
                assert h.wait(30), "a disk move did not finish"
