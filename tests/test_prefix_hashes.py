"""Requests that carry prefix hashes instead of token ids: keys, sharing, exact blocks, bad input."""

from __future__ import annotations

import pytest
from poolutil import manager_snapshot

from tiered_kv.core import KVCacheManager, Request
from tiered_kv.errors import InvalidArgumentError


def _admit(mgr: KVCacheManager, req: Request) -> tuple[list[int], int]:
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in hits], n


def test_a_512_token_hash_becomes_32_keys_shared_exactly_with_its_block():
    mgr = KVCacheManager(num_blocks=200, block_size=16)
    a = Request.from_hashes("a", 1024, [7, 8], 512)
    b = Request.from_hashes("b", 1024, [7, 9], 512)  # shares a's first 512-token block only
    c = Request.from_hashes("c", 1024, [6, 8], 512)  # same second id, other first block: a remapped chain
    ka, kb, kc = (mgr.hasher.update(r) for r in (a, b, c))
    assert len(ka) == len(kb) == len(kc) == 64
    assert len(set(ka)) == 64
    assert ka[:32] == kb[:32] and not set(ka[32:]) & set(kb[32:])
    assert not set(ka[:32]) & set(kc[:32])
    # Sub-block keys depend on the hash id and the offset only: the same in a second manager.
    assert KVCacheManager(num_blocks=8, block_size=16).hasher.update(Request.from_hashes("z", 1024, [7, 8], 512)) == ka


def test_a_partial_last_block_covers_only_its_tokens():
    mgr = KVCacheManager(num_blocks=64, block_size=16)
    a = Request.from_hashes("a", 600, [1, 2], 512)  # 512 + 88 tokens: 37 full pool blocks, 8 tokens left
    b = Request.from_hashes("b", 560, [1, 3], 512)  # 512 + 48: 35 full blocks
    ka, kb = mgr.hasher.update(a), mgr.hasher.update(b)
    assert (len(ka), len(kb)) == (37, 35)
    assert ka[:32] == kb[:32] and not set(ka[32:]) & set(kb[32:])
    # The block that mixes a's last 8 prompt tokens with output is keyed from hash 2, then its tokens.
    a.append_output_token_ids(list(range(100, 108)))
    assert len(mgr.hasher.update(a)) == 38
    twin = Request.from_hashes("t", 600, [1, 2], 512)
    twin.append_output_token_ids(list(range(100, 108)))
    other = Request.from_hashes("o", 600, [1, 4], 512)  # other content in the same positions
    other.append_output_token_ids(list(range(100, 108)))
    assert mgr.hasher.update(twin)[37] == mgr.hasher.update(a)[37] != mgr.hasher.update(other)[37]


def test_the_pool_hands_back_exactly_the_shared_blocks():
    mgr = KVCacheManager(num_blocks=12, block_size=4)
    a = Request.from_hashes("a", 16, [5, 6], 8, max_tokens=1)  # blocks 1-4
    assert _admit(mgr, a) == ([], 0)
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    b = Request.from_hashes("b", 10, [5, 9], 8, max_tokens=1)  # shares a's first 8 tokens: blocks 1, 2
    assert _admit(mgr, b) == ([1, 2], 8)
    assert mgr.get_block_ids("b") == [1, 2, 5]


def test_a_hash_request_needs_no_token_list():
    req = Request.from_hashes("r", 100_000, list(range(196)), 512)
    assert req.num_prompt_tokens == 100_000 and req.prefix_hashes == tuple(range(196))
    # One shared int object for every placeholder: 8 bytes a token, no int objects of its own.
    assert len({id(t) for t in req.all_token_ids}) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, [1], 512), "num_prompt_tokens must be an int >= 1, got 0"),
        ((True, [1], 512), "num_prompt_tokens must be an int >= 1"),
        ((10, [1], 0), "hash_block_size must be an int >= 1, got 0"),
        ((10, "ab", 512), "hashes must be a sequence of ints"),
        ((10, [-1], 512), r"hashes must be ints in \[0, 2\*\*63\), got -1"),
        ((10, [1 << 63], 512), r"hashes must be ints in \[0, 2\*\*63\)"),
        ((10, [1.0], 512), r"hashes must be ints in \[0, 2\*\*63\), got 1.0 \(float\)"),
        ((600, [1, 2, 3], 512), "600 prompt tokens in blocks of 512 need 2 hashes, got 3"),
        ((600, [1], 512), "600 prompt tokens in blocks of 512 need 2 hashes, got 1"),
    ],
)
def test_bad_hashes_are_refused_and_change_nothing(args, message):
    mgr = KVCacheManager(num_blocks=12, block_size=4)
    _admit(mgr, Request.from_hashes("a", 16, [5, 6], 8, max_tokens=1))
    before = manager_snapshot(mgr)
    with pytest.raises(InvalidArgumentError, match=message):
        Request.from_hashes("bad", *args)
    assert manager_snapshot(mgr) == before
