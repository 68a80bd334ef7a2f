"""The tier manager driving a real copy engine over real KV tensors."""

import pytest
import torch
from engineutil import SPEC, fill_random, tiers

from tiered_kv.core import Request
from tiered_kv.manager import CostModel, RequestState, TierManager
from tiered_kv.transfer.cpu_engine import CpuCopyEngine


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
def test_swap_out_overwrite_and_resume_into_other_blocks_keeps_the_bytes(layout):
    t = tiers(layout, gpu_blocks=9, cpu_blocks=9)
    cm = CostModel(kv_bytes_per_token=SPEC.bytes_per_token, block_size=SPEC.block_size)
    with CpuCopyEngine(t, max_blocks_per_chunk=2) as eng:
        tm = TierManager(9, 9, SPEC.block_size, eng, cost_model=cm)
        a = Request("A", list(range(100, 114)))  # 14 tokens: 4 blocks
        assert tm.admit(a, 14).runnable
        table = tm.gpu_block_ids("A")
        want = fill_random(t["GPU"], table, seed=21)  # "the model wrote A's KV"
        a.num_computed_tokens = 14
        tm.preempt_request("A", "swap")
        assert tm.state("A") is RequestState.SWAPPING_OUT
        tm.wait_all(10)
        assert tm.state("A") is RequestState.SWAPPED
        # Another request takes every GPU block and overwrites them.
        f = Request("F", list(range(500, 532)))
        assert tm.admit(f, 32) is not None
        fill_random(t["GPU"], tm.gpu_block_ids("F"), seed=22)
        tm.finish("F")
        res = tm.resume("A")
        assert res.plan is not None
        tm.wait_all(10)
        assert tm.is_runnable("A")
        new_table = tm.gpu_block_ids("A")
        assert new_table != table
        for old, new in zip(table, new_table, strict=True):
            assert torch.equal(t["GPU"].block(new), want[old])
        tm.check_invariants()
