"""Helpers for tier-manager tests: tiny managers, exact snapshots."""

from __future__ import annotations

from poolutil import letters, pool_snapshot, queue

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, TierManager
from tiered_kv.transfer import ControlledCopyEngine

BS = 4


def make_tm(gpu: int = 9, cpu: int = 9, bs: int = BS, **kw) -> tuple[TierManager, ControlledCopyEngine]:
    engine = ControlledCopyEngine({"GPU": gpu, "CPU": max(cpu, 2)}, bytes_per_block=bs * 1024)
    cm = kw.pop("cost_model", None) or CostModel(kv_bytes_per_token=1024, block_size=bs)
    return TierManager(gpu, cpu, bs, engine, cost_model=cm, **kw), engine


def run(tm: TierManager, rid: str, text: str) -> Request:
    """Admit a whole prompt, compute it in one step, report it computed."""
    req = Request(rid, letters(text))
    res = tm.admit(req, req.num_tokens)
    assert res is not None and res.runnable
    req.num_computed_tokens += res.num_new_tokens
    assert req.num_computed_tokens == req.num_tokens
    tm.on_tokens_computed(rid)
    return req


def gq(tm: TierManager) -> list[str]:
    return queue(tm.gpu_pool)


def cq(tm: TierManager) -> list[str]:
    return queue(tm.cpu_pool)


def tm_snapshot(tm: TierManager) -> tuple:
    return (
        pool_snapshot(tm.gpu_pool),
        pool_snapshot(tm.cpu_pool) if tm.cpu_pool is not None else None,
        {
            rid: (
                e.state,
                [b.block_id for b in tm.gpu.req_to_blocks.get(rid, [])],
                [c.block_id if c else None for c in e.cpu_table],
                e.request.num_computed_tokens,
                e.num_kv_tokens,
                e.plan_id,
            )
            for rid, e in tm._entries.items()
        },
        sorted(tm._plans),
        tuple(vars(tm.counters).items()) if hasattr(tm.counters, "__dict__") else repr(tm.counters),
        len(tm.decision_log),
    )
