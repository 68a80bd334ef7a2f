"""The tier manager driving a real copy engine over real KV tensors."""

import pytest
import torch
from engineutil import SPEC, fill_random, tiers

from tiered_kv.core import Request
from tiered_kv.manager import ManagerConfig, Residency, TierManager
from tiered_kv.transfer.cpu_engine import CpuCopyEngine


def settle(tm):
    while tm.plans_in_flight():
        tm.wait(10)
        tm.poll()


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
def test_swap_out_overwrite_and_resume_into_other_blocks_keeps_the_bytes(layout):
    t = tiers(layout, gpu_blocks=9, cpu_blocks=9)
    with CpuCopyEngine(t, max_blocks_per_chunk=2) as eng:
        tm = TierManager(ManagerConfig(9, 9, SPEC.block_size), eng)  # KV sizes from the engine's spec
        a = Request("A", list(range(100, 114)))  # 14 tokens: 4 blocks
        assert tm.admit(a, 14).runnable
        table = tm.gpu_block_ids("A")
        want = fill_random(t["GPU"], table, seed=21)  # "the model wrote A's KV"
        a.num_computed_tokens = 14
        tm.preempt("A", "swap")
        assert tm.residency("A") is Residency.SWAPPING_OUT
        settle(tm)
        assert tm.residency("A") is Residency.CPU
        # Another request takes every GPU block and overwrites them.
        f = Request("F", list(range(500, 532)))
        assert tm.admit(f, 32) is not None
        fill_random(t["GPU"], tm.gpu_block_ids("F"), seed=22)
        tm.free("F")
        res = tm.resume("A")
        assert res.plan is not None
        settle(tm)
        assert tm.residency("A") is Residency.GPU
        new_table = tm.gpu_block_ids("A")
        assert new_table != table
        for old, new in zip(table, new_table, strict=True):
            assert torch.equal(t["GPU"].block(new).cpu(), want[old])
        tm.check_invariants()
