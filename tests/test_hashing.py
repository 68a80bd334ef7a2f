"""Chained block hashes: what they cover, determinism, and incrementality."""

import subprocess
import sys

import pytest

from tiered_kv.core import BlockHasher, MultiModalFeature, Request
from tiered_kv.core.hashing import HASH_FUNCTIONS, root_hash
from tiered_kv.errors import HashingError, InvalidArgumentError


@pytest.mark.parametrize("fn", sorted(HASH_FUNCTIONS))
def test_chain_covers_parent_tokens_and_extra_keys(fn):
    h = BlockHasher.create(4, fn)
    base = h.update(Request("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    assert len(base) == 2 and base[0] != base[1]
    assert h.update(Request("b", [1, 2, 3, 4, 5, 6, 7, 8])) == base
    # Same second block, different first block: the chain makes the second hash differ.
    other = h.update(Request("c", [9, 2, 3, 4, 5, 6, 7, 8]))
    assert other[1] != base[1]
    assert h.update(Request("d", [1, 2, 3, 4, 5, 6, 7, 8], lora_name="L"))[0] != base[0]
    salted = h.update(Request("e", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant"))
    assert salted[0] != base[0] and salted[1] != base[1]  # salt on block 0, carried by the chain
    img = MultiModalFeature("img-1", offset=5, length=2)
    mm = h.update(Request("f", [1, 2, 3, 4, 5, 6, 7, 8], mm_features=[img]))
    assert mm[0] == base[0] and mm[1] != base[1]  # only the overlapped block changes
    moved = h.update(Request("g", [1, 2, 3, 4, 5, 6, 7, 8], mm_features=[MultiModalFeature("img-1", 4, 2)]))
    assert moved[1] != mm[1]  # the offset is part of the key


def test_seeded_root_changes_every_hash():
    a = BlockHasher.create(2, "sha256", seed=0).update(Request("a", [1, 2]))
    b = BlockHasher.create(2, "sha256", seed=1).update(Request("a", [1, 2]))
    assert a != b
    assert root_hash(HASH_FUNCTIONS["fast"], 0) != root_hash(HASH_FUNCTIONS["fast"], 1)


def test_hashing_is_incremental():
    calls = []

    def counting(parent, tokens, extra):
        calls.append(tuple(tokens))
        return hash((parent, *tokens))

    h = BlockHasher.create(2, counting)
    calls.clear()
    r = Request("r", [1, 2, 3])
    h.update(r)
    assert calls == [(1, 2)]
    h.update(r)
    assert calls == [(1, 2)]
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6])
    h.update(r)
    assert calls == [(1, 2), (3, 4), (5, 6)]
    assert h.num_hashed_blocks == 3


@pytest.mark.parametrize("fn", sorted(HASH_FUNCTIONS))
def test_hashes_are_identical_across_processes(fn):
    code = (
        "from tiered_kv.core import BlockHasher, Request;"
        f"print(BlockHasher.create(2, {fn!r}).update(Request('x', [1, 2, 3, 4], lora_name='L', cache_salt='s')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().startswith("[")


def test_partial_block_and_bad_names_are_refused():
    h = BlockHasher.create(4)
    with pytest.raises(HashingError, match="partial block: 3 tokens, block size 4"):
        h.hash_block(None, [1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="unknown hash function 'md5'"):
        BlockHasher.create(4, "md5")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        BlockHasher.create(0)
