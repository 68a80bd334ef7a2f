"""The free queue keeps vLLM's order exactly, including across lazy removals."""

import subprocess
import sys

import pytest

from tiered_kv.core import FreeBlockQueue, KVCacheBlock
from tiered_kv.errors import NotEnoughFreeBlocksError


def ids(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def make(n: int):
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def test_take_put_front_put_back_exact_order():
    blocks, q = make(6)
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    q.prepend_n([blocks[1], blocks[0]])
    assert ids(q) == [1, 0, 2, 3, 4, 5]
    q.append_n([])
    q.prepend_n([])
    assert ids(q) == [1, 0, 2, 3, 4, 5]
    assert q.popleft().block_id == 1
    q.append(blocks[1])
    assert ids(q) == [0, 2, 3, 4, 5, 1]
    assert len(q) == 6


def test_remove_from_middle_then_requeue_at_back():
    blocks, q = make(5)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.append(blocks[2])  # re-queued behind its dead entry
    assert ids(q) == [0, 1, 3, 4, 2]
    assert [b.block_id for b in q.popleft_n(5)] == [0, 1, 3, 4, 2]
    assert q.num_free_blocks == 0 and blocks[2].stale == 0


def test_repeated_remove_and_requeue_of_one_block():
    blocks, q = make(4)
    for _ in range(3):
        q.remove(blocks[1])
        q.append(blocks[1])
    assert ids(q) == [0, 2, 3, 1]
    assert blocks[1].stale == 3
    assert [b.block_id for b in q.popleft_n(4)] == [0, 2, 3, 1]
    assert blocks[1].stale == 0


def test_compaction_keeps_order_and_bounds_memory():
    blocks, q = make(200)
    for b in blocks[10:190]:
        q.remove(b)  # triggers compaction once dead entries outnumber live ones
    assert ids(q) == list(range(10)) + list(range(190, 200))
    assert q.num_entries <= 2 * q.num_free_blocks + 65
    q.append_n(blocks[50:53])
    assert ids(q)[-3:] == [50, 51, 52]
    assert [b.block_id for b in q.popleft_n(23)] == [*range(10), *range(190, 200), 50, 51, 52]


def test_popleft_on_an_empty_queue_raises_vllms_value_error_and_changes_nothing():
    q = FreeBlockQueue([KVCacheBlock(1)])
    q.popleft()
    with pytest.raises(ValueError, match=r"^No free blocks available$") as e:
        q.popleft()
    assert isinstance(e.value, NotEnoughFreeBlocksError)
    assert (q.num_free_blocks, q.get_all_free_blocks()) == (0, [])
    with pytest.raises(NotEnoughFreeBlocksError):
        q.popleft_n(1)
    assert (q.num_free_blocks, q.get_all_free_blocks()) == (0, [])


_OPTIMIZED_POPLEFT = """
import sys
from tiered_kv.core import FreeBlockQueue, KVCacheBlock
assert sys.flags.optimize == 1
q = FreeBlockQueue([KVCacheBlock(1), KVCacheBlock(2)])
try:
    q.popleft_n(3)
except ValueError as e:
    print("popleft_n:", e)
q.popleft_n(2)
try:
    q.popleft()
except ValueError as e:
    print("popleft:", e)
print("free:", q.num_free_blocks, [b.block_id for b in q.get_all_free_blocks()])
"""


def test_empty_queue_errors_hold_under_python_dash_o():
    """No assertion carries control flow: under ``-O`` the checks still raise and the count stays right."""
    out = subprocess.run(
        [sys.executable, "-O", "-c", _OPTIMIZED_POPLEFT], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines() == [
        "popleft_n: cannot take 3 blocks: 2 free",
        "popleft: No free blocks available",
        "free: 0 []",
    ]
