"""One contract test for every victim policy, then each policy's own order, and victim selection."""

import itertools
import math
import random

import pytest

from tiered_kv.manager import VICTIM_POLICIES, Candidate, CostModel, PreemptMode, get_victim_policy, select_victims
from tiered_kv.manager.pricing import price

CM = CostModel(
    kv_bytes_per_token=1024,
    block_size=16,
    d2h_bytes_per_s=1e9,
    h2d_bytes_per_s=1e9,
    per_copy_overhead_s=1e-5,
    prefill_tokens_per_s=5e4,
)


def cand(rid, rank, nblocks, computed, prompt, shared=0, room=True, start=1, cm=CM):
    """A candidate whose quote prices ``nblocks`` blocks of which ``shared`` are held by others too."""
    ids = list(range(start, start + nblocks))
    freed = ids[shared:]

    def quote(_rid):
        return price(cm, rid, computed, nblocks, freed, ids, nblocks, room, True)

    return Candidate(rid, rank, nblocks, computed, prompt, quote)


def candidates(room=True):
    return [
        cand("a", 0, 4, 64, 64, room=room),
        cand("b", 1, 8, 128, 100, shared=2, room=room, start=20),
        cand("c", 2, 2, 20, 40, room=room, start=40),  # mid-prefill
        cand("d", 3, 6, 90, 90, room=room, start=60),
    ]


@pytest.mark.parametrize("name", sorted(VICTIM_POLICIES))
@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_policy_contract(name, mode):
    policy = get_victim_policy(name, CM)
    cands = candidates()
    ranked = [c.request_id for c in policy.rank(cands, mode)]
    assert sorted(ranked) == ["a", "b", "c", "d"]  # each exactly once
    for perm in itertools.permutations(candidates()):  # deterministic whatever the input order
        assert [c.request_id for c in policy.rank(list(perm), mode)] == ranked
    assert policy.rank([], mode) == []
    # The mode each victim would get comes from its quote, never from the policy.
    for c in policy.rank(candidates(room=False), "auto"):
        assert c.quote.choose("auto")[0] is PreemptMode.RECOMPUTE


def test_last_admitted_is_vllms_order_the_last_of_the_running_queue_first():
    assert [c.request_id for c in get_victim_policy("last_admitted").rank(candidates(), "recompute")] == [
        "d",
        "c",
        "b",
        "a",
    ]


def test_largest_order_falls_back_to_the_queue_order():
    assert [c.request_id for c in get_victim_policy("largest").rank(candidates(), "recompute")] == ["b", "d", "a", "c"]
    same = [cand("x", 0, 3, 48, 48), cand("y", 1, 3, 48, 48, start=10)]
    assert [c.request_id for c in get_victim_policy("largest").rank(same, "recompute")] == ["y", "x"]


def test_prefill_aware_puts_mid_prefill_last_and_least_work_first():
    order = [c.request_id for c in get_victim_policy("prefill_aware").rank(candidates(), "recompute")]
    # b (128 computed of a 100-token prompt: decoding) is not mid-prefill; c is (20 of 40).
    assert order == ["a", "d", "b", "c"]


def test_cost_aware_minimises_time_lost_per_block_freed():
    ranked = get_victim_policy("cost_aware", CM).rank(candidates(), "auto")
    per_block = [c.quote.cost("auto") / c.quote.blocks_freed for c in ranked]
    assert per_block == sorted(per_block)
    assert [c.quote.blocks_freed for c in ranked if c.request_id == "b"] == [6]


def test_quote_prices_copies_by_runs_and_recompute_by_prefill():
    q = price(CM, "v", 40, 4, [6, 7, 9], [5, 6, 7, 9], 4, True, True)
    assert (q.blocks_freed, q.blocks_to_move, q.num_runs) == (3, 4, 2)
    assert math.isclose(q.swap_out_s, 4 * 16 * 1024 / 1e9 + 2 * 1e-5)
    assert math.isclose(q.swap_in_s, 3 * 16 * 1024 / 1e9 + 2 * 1e-5)  # what the GPU gave up comes back
    assert q.recompute_s == 40 / 5e4
    full = price(CM, "w", 16, 1, [1], [1], 1, False, True)
    assert full.cost("swap") == math.inf and full.choose("swap") == (
        None,
        "swap requested but the CPU tier has no room for 1 blocks",
    )
    none = price(CM, "x", 16, 1, [1], [1], 1, False, False)
    assert "there is no CPU tier" in none.choose("auto")[1]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_cost_aware_best_first_matches_a_full_sort(mode):
    rng = random.Random(7)
    for trial in range(30):
        cm = CM if trial % 2 else CostModel(kv_bytes_per_token=1024, block_size=16, prefill_tokens_per_s=1e6)
        policy = get_victim_policy("cost_aware", cm)
        cands = []
        start = 1
        for rank in range(rng.randrange(1, 40)):
            n = rng.randrange(0, 12)
            cands.append(
                cand(
                    f"r{rank}",
                    rank,
                    n,
                    rng.randrange(1, 300),
                    150,
                    rng.randrange(0, n + 1),
                    rng.random() < 0.7,
                    start,
                    cm,
                )
            )
            start += n + 1
        for c in cands:
            assert policy.lower_key(c, mode) <= policy.key(c, mode)
        expect = sorted(cands, key=lambda c: policy.key(c, mode))
        assert policy.rank(cands, mode) == expect


def test_select_victims_is_all_or_nothing_and_skips_what_frees_nothing():
    cands = [*candidates(), cand("e", 4, 3, 48, 48, shared=3, start=80)]  # e frees no block
    order = get_victim_policy("last_admitted")
    assert [c.request_id for c in select_victims(order, cands, 5, "auto", 100)] == ["d"]  # 6 blocks
    assert [c.request_id for c in select_victims(order, cands, 7, "auto", 100)] == ["d", "c"]
    assert select_victims(order, cands, 100, "auto", 100) is None  # 4 + 6 + 2 + 6 = 18 at most
    # Forced swap: a victim must fit in what is left of the CPU room.
    assert [c.request_id for c in select_victims(order, cands, 7, "swap", 9)] == ["d", "c"]  # 6 + 2 <= 9
    assert select_victims(order, cands, 7, "swap", 7) is None  # after d, 1 block of room: nobody else fits
    assert [c.request_id for c in select_victims(order, cands, 9, "swap", 12)] == ["d", "c", "a"]  # b (8) skipped
    assert select_victims(order, candidates(room=False), 1, "swap", 100) is None
