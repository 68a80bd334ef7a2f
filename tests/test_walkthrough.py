"""The seed's walk-through, asserted after every event, and its "Try it" variants."""

from poolutil import admit, queue

from tiered_kv.core import BlockPool, KVCacheManager
from tiered_kv.demo import run_walkthrough


def new_manager() -> KVCacheManager:
    return KVCacheManager(11, block_size=4)


def test_walkthrough_exact_queue_after_every_event():
    mgr = new_manager()
    pool = mgr.block_pool
    assert queue(pool) == ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"]

    r0 = admit(mgr, "r0", "ABCDEFGHIJKLMNO")
    assert mgr.get_block_ids("r0") == [1, 2, 3, 4]
    assert queue(pool) == ["5", "6", "7", "8", "9", "10"]

    r1 = admit(mgr, "r1", "ABCDEFGHIJxxxx")
    assert mgr.get_block_ids("r1") == [1, 2, 5, 6]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5, 6)] == [2, 2, 1, 1, 1, 1]
    assert queue(pool) == ["7", "8", "9", "10"]

    mgr.free(r0)  # the partial block 4 goes to the front, hashed block 3 to the back
    assert queue(pool) == ["4", "7", "8", "9", "10", "3*"]

    mgr.free(r1)  # 5, 2, 1 join the back, deepest first
    assert queue(pool) == ["6", "4", "7", "8", "9", "10", "3*", "5*", "2*", "1*"]

    admit(mgr, "r2", "ABCDEFGHIJKLyyyyyyyyyyyyyyyyy")
    # 1, 2, 3 are plucked from the middle; nothing is evicted.
    assert mgr.get_block_ids("r2") == [1, 2, 3, 6, 4, 7, 8, 9]
    assert queue(pool) == ["10", "5*"]

    hash_of_5 = pool.blocks[5].block_hash
    admit(mgr, "r3", "zzzzzzzz")
    assert mgr.get_block_ids("r3") == [10, 5]
    assert queue(pool) == []
    assert pool.get_cached_block(hash_of_5) is None  # r1's third block was evicted at hand-out
    pool.check_invariants()


def test_demo_prints_the_same_tables():
    lines: list[str] = []
    result = run_walkthrough(lines.append)
    assert result["tables"] == {
        "r0": [1, 2, 3, 4],
        "r1": [1, 2, 5, 6],
        "r2": [1, 2, 3, 6, 4, 7, 8, 9],
        "r3": [10, 5],
    }
    assert "    evict: block 5 loses its hash" in lines
    assert any("6 4 7 8 9 10 3* 5* 2* 1*" in line for line in lines)


class AllToBackPool(BlockPool):
    """The older published design: every freed block goes to the back."""

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        for b in blocks:
            b.ref_cnt -= 1
        self.free_block_queue.append_n([b for b in blocks if b.ref_cnt == 0])


def _after_r0_r1(mgr: KVCacheManager) -> None:
    r0 = admit(mgr, "r0", "ABCDEFGHIJKLMNO")
    r1 = admit(mgr, "r1", "ABCDEFGHIJxxxx")
    mgr.free(r0)
    mgr.free(r1)


def test_try_it_all_to_back_evicts_cache_while_garbage_is_free():
    real = new_manager()
    old = KVCacheManager(block_size=4, block_pool=AllToBackPool(11))
    _after_r0_r1(real)
    _after_r0_r1(old)
    assert queue(old.block_pool) == ["7", "8", "9", "10", "4", "3*", "6", "5*", "2*", "1*"]
    # A newcomer needing 6 blocks: the real rules spend only worthless blocks...
    admit(real, "n", "q" * 24)
    assert real.get_block_ids("n") == [6, 4, 7, 8, 9, 10]
    assert real.block_pool.blocks[3].block_hash is not None
    # ...the old rule evicts block 3 (the ABCDEFGHIJKL prefix) while unhashed block 6 is still free.
    admit(old, "n", "q" * 24)
    assert old.get_block_ids("n") == [7, 8, 9, 10, 4, 3]
    assert queue(old.block_pool)[0] == "6"


def test_try_it_forward_free_order_evicts_the_shared_first_block_first():
    fwd = new_manager()
    r0 = admit(fwd, "r0", "ABCDEFGHIJKLMNO")
    r1 = admit(fwd, "r1", "ABCDEFGHIJxxxx")
    for r in (r0, r1):  # forward order instead of the manager's reverse order, straight to the pool
        fwd.block_pool.free_blocks(fwd.get_blocks(r.request_id))
    assert queue(fwd.block_pool) == ["6", "4", "7", "8", "9", "10", "3*", "1*", "2*", "5*"]
    rev = new_manager()
    _after_r0_r1(rev)
    assert queue(rev.block_pool) == ["6", "4", "7", "8", "9", "10", "3*", "5*", "2*", "1*"]
    # Eight blocks of unrelated work: forward order loses block 1 ("ABCD", the block every
    # request with this system prompt starts with); reverse order loses the deep block 5.
    admit(fwd, "x", "w" * 32)
    admit(rev, "x", "w" * 32)
    assert (
        fwd.get_block_ids("x")[-1] == 1 and fwd.block_pool.get_cached_block(rev.block_pool.blocks[1].block_hash) is None
    )
    assert rev.get_block_ids("x")[-1] == 5 and rev.block_pool.blocks[1].block_hash is not None


def test_try_it_usage_stays_below_one_with_only_cached_blocks_free():
    mgr = new_manager()
    _after_r0_r1(mgr)
    admit(mgr, "r2", "ABCDEFGHIJKLyyyyyyyyyyyyyyyyy")
    # Two blocks free, one of them (5) holding cached data: usage reads 0.8, not 0.9.
    assert queue(mgr.block_pool) == ["10", "5*"]
    assert mgr.usage == 1 - 2 / 10
    admit(mgr, "r3", "zzzzzzzz")
    assert mgr.usage == 1.0


def test_cli_demo_prints_walkthrough(capsys):
    from tiered_kv.cli import main

    assert main(["demo", "--hash", "fast"]) == 0
    out = capsys.readouterr().out
    assert "r2: 29 tokens, 3 block(s) from cache, 5 new" in out
    assert "free queue (front first, * = cached): 10 5*   usage 0.80" in out
