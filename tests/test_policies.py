"""One contract test for every victim policy, then each policy's own order."""

import itertools
import math

import pytest

from tiered_kv.core import KVCacheBlock
from tiered_kv.manager import POLICIES, CostModel, PreemptMode, VictimInfo, get_policy

CM = CostModel(
    kv_bytes_per_token=1024,
    block_size=16,
    d2h_bytes_per_s=1e9,
    h2d_bytes_per_s=1e9,
    per_copy_overhead_s=1e-5,
    prefill_tokens_per_s=5e4,
)


def info(rid, seq, last, nblocks, computed, prompt, shared=0, cpu_free=100, cm=CM, start=1):
    table = [KVCacheBlock(start + i, ref_cnt=2 if i < shared else 1) for i in range(nblocks)]
    return VictimInfo(rid, seq, last, table, computed, prompt, cm, cpu_free)


def candidates(cpu_free=100):
    return [
        info("a", 1, 5, 4, 64, 64, cpu_free=cpu_free),
        info("b", 2, 3, 8, 128, 100, shared=2, cpu_free=cpu_free, start=20),
        info("c", 3, 9, 2, 20, 40, cpu_free=cpu_free, start=40),  # mid-prefill
        info("d", 4, 3, 6, 90, 90, cpu_free=cpu_free, start=60),
    ]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_policy_contract(name, mode):
    policy = get_policy(name)
    cands = candidates()
    ranked = policy.rank(cands, mode)
    assert sorted(c.info.request_id for c in ranked) == ["a", "b", "c", "d"]  # each exactly once
    for perm in itertools.permutations(cands):  # deterministic whatever the input order
        assert [c.info.request_id for c in policy.rank(list(perm), mode)] == [c.info.request_id for c in ranked]
    for c in ranked:
        if mode == "swap":
            assert c.mode is PreemptMode.SWAP and c.cost_s == c.info.swap_cost_s
        elif mode == "recompute":
            assert c.mode is PreemptMode.RECOMPUTE and c.cost_s == c.info.recompute_cost_s
        else:
            assert c.cost_s == min(c.info.swap_cost_s, c.info.recompute_cost_s)
    assert policy.rank([], mode) == []
    # Without CPU room a policy never picks swap in auto mode.
    for c in policy.rank(candidates(cpu_free=0), "auto"):
        assert c.mode is PreemptMode.RECOMPUTE


def test_lru_order_ties_break_by_admission():
    assert [c.info.request_id for c in get_policy("lru").rank(candidates(), "recompute")] == ["b", "d", "a", "c"]


def test_largest_order():
    assert [c.info.request_id for c in get_policy("largest").rank(candidates(), "recompute")] == ["b", "d", "a", "c"]
    small = [info("x", 1, 1, 3, 48, 48), info("y", 2, 2, 5, 80, 80, start=10)]
    assert [c.info.request_id for c in get_policy("largest").rank(small, "recompute")] == ["y", "x"]


def test_prefill_aware_puts_mid_prefill_last_and_least_work_first():
    order = [c.info.request_id for c in get_policy("prefill_aware").rank(candidates(), "recompute")]
    # b (128 computed of a 100-token prompt: decoding) is not mid-prefill; c is (20 of 40).
    assert order == ["a", "d", "b", "c"]


def test_cost_aware_minimises_time_lost_per_block_freed():
    cands = candidates()
    ranked = get_policy("cost_aware").rank(cands, "auto")
    per_block = [c.cost_s / c.info.num_freeable_blocks for c in ranked]
    assert per_block == sorted(per_block)
    assert [c.info.num_freeable_blocks for c in ranked if c.info.request_id == "b"] == [6]


def test_victim_info_counts_exclusive_blocks_and_runs():
    v = VictimInfo(
        "v", 1, 1, [KVCacheBlock(5, 2), KVCacheBlock(6, 1), KVCacheBlock(7, 1), KVCacheBlock(9, 1)], 40, 40, CM, 10
    )
    assert (v.num_freeable_blocks, v.num_runs) == (3, 2)
    assert math.isclose(v.swap_cost_s, 2 * (3 * 16 * 1024 / 1e9 + 2 * 1e-5))
    assert v.recompute_cost_s == 40 / 5e4
    assert VictimInfo("w", 1, 1, [KVCacheBlock(1, 1)], 16, 16, CM, 0).swap_cost_s == math.inf


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_cost_aware_best_first_matches_a_full_sort(mode):
    import random

    rng = random.Random(7)
    policy = get_policy("cost_aware")
    for trial in range(30):
        cands = []
        start = 1
        for seq in range(rng.randrange(1, 40)):
            n = rng.randrange(0, 12)
            table = [
                KVCacheBlock(start + i + (i // 3) * rng.randrange(0, 2), ref_cnt=rng.choice([1, 1, 1, 2]))
                for i in range(n)
            ]
            start += 2 * n + 1
            cm = CM if trial % 2 else CostModel(kv_bytes_per_token=1024, block_size=16, prefill_tokens_per_s=1e6)
            cands.append(
                VictimInfo(
                    f"r{seq}", seq, rng.randrange(5), table, rng.randrange(1, 300), 150, cm, rng.choice([0, 5, 100])
                )
            )
        for c in cands:
            lb = policy.lower_key(c, mode)
            assert lb <= policy.key(c, mode), (lb, policy.key(c, mode))
        expect = sorted(cands, key=lambda c: policy.key(c, mode))
        assert [c.info for c in policy.rank(cands, mode)] == expect
