"""Random admit / extend / free sequences against an obviously correct reference model.

The reference keeps the free queue as a plain Python list and hashes a block by
the tuple of every token up to its end (the seed's ``hashOf(prefix)``).  After
every step the real pool must match it exactly: free-queue order, ref counts,
which blocks are cached, and which blocks each cached prefix maps to (in order).
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv.core import KVCacheManager, Request

BS = 2
NUM_BLOCKS = 12


class Reference:
    def __init__(self, caching: bool = True) -> None:
        self.caching = caching
        self.free = list(range(1, NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.key: list[tuple | None] = [None] * NUM_BLOCKS
        self.map: dict[tuple, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.ncached: dict[str, int] = {}

    def _take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.free.pop(0)
            if self.key[b] is not None:
                self.map[self.key[b]].remove(b)
                if not self.map[self.key[b]]:
                    del self.map[self.key[b]]
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def _cache(self, rid: str, tokens: list[int], upto: int) -> None:
        if not self.caching:
            return
        table = self.tables[rid]
        for i in range(self.ncached[rid], upto // BS):
            k = tuple(tokens[: (i + 1) * BS])
            self.key[table[i]] = k
            self.map.setdefault(k, []).append(table[i])
        self.ncached[rid] = max(self.ncached[rid], upto // BS)

    def admit(self, rid: str, tokens: list[int]) -> bool:
        hits = []
        for i in range((len(tokens) - 1) // BS if self.caching else 0):
            blocks = self.map.get(tuple(tokens[: (i + 1) * BS]))
            if not blocks:
                break
            hits.append(blocks[0])
        need = -(-len(tokens) // BS) - len(hits)
        if need + sum(self.ref[b] == 0 for b in hits) > len(self.free):
            return False
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        self.tables[rid] = hits + self._take(need)
        self.ncached[rid] = len(hits)
        self._cache(rid, tokens, len(tokens))
        return True

    def extend(self, rid: str, tokens: list[int], computed: int, k: int, la: int) -> bool:
        need = -(-(computed + k + la) // BS) - len(self.tables[rid])
        if max(need, 0) > len(self.free):
            return False
        self.tables[rid] += self._take(max(need, 0))
        self._cache(rid, tokens, min(computed + k, len(tokens)))
        return True

    def release(self, rid: str) -> None:
        front, back = [], []
        for b in reversed(self.tables.pop(rid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (front if self.key[b] is None else back).append(b)
        self.ncached.pop(rid)
        self.free = front + self.free + back


class PoolMachine(RuleBasedStateMachine):
    CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, block_size=BS, hash_fn="fast", enable_caching=self.CACHING)
        self.ref = Reference(self.CACHING)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, tokens)
        hits, n = self.mgr.get_computed_blocks(req)
        ok = self.mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None
        assert ok == self.ref.admit(rid, tokens)
        if ok:
            req.num_computed_tokens = req.num_tokens
            self.reqs[rid] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), k=st.integers(1, 3), la=st.integers(0, 3))
    def extend(self, data, k, la):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        computed = req.num_computed_tokens
        req.append_output_token_ids(data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
        ok = self.mgr.allocate_slots(req, k, num_lookahead_tokens=la) is not None
        assert ok == self.ref.extend(rid, req.all_token_ids, computed, k, la)
        if ok:
            req.num_computed_tokens += k
        else:
            del req.all_token_ids[-k:]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.mgr.free(self.reqs.pop(rid))
        self.ref.release(rid)

    @invariant()
    def matches_reference(self):
        pool = self.mgr.block_pool
        assert pool.free_queue_ids() == self.ref.free
        assert [b.ref_cnt for b in pool.blocks[1:]] == self.ref.ref[1:]
        assert [b.block_hash is not None for b in pool.blocks] == [k is not None for k in self.ref.key]
        groups = sorted(
            tuple(v) if isinstance(v, dict) else (v.block_id,) for v in pool.cached_block_hash_to_block.values()
        )
        assert groups == sorted(tuple(v) for v in self.ref.map.values())
        for rid in self.reqs:
            assert self.mgr.get_block_ids(rid) == self.ref.tables[rid]

    @invariant()
    def invariants_hold(self):
        pool = self.mgr.block_pool
        held = sum(b.ref_cnt > 0 for b in pool.blocks[1:])
        assert pool.get_num_free_blocks() + held == NUM_BLOCKS - 1
        pool.check_invariants()

    def teardown(self):
        for req in list(self.reqs.values()):
            self.mgr.free(req)
        pool = self.mgr.block_pool
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1


class PoolMachineWithoutCaching(PoolMachine):
    """Prefix caching off: no hits, nothing hashed, every freed block to the front (a LIFO allocator)."""

    CACHING = False


SETTINGS = settings(
    max_examples=int(os.environ.get("TIERED_KV_STATEFUL_EXAMPLES", "200")), stateful_step_count=40, deadline=None
)
PoolMachine.TestCase.settings = SETTINGS
PoolMachineWithoutCaching.TestCase.settings = SETTINGS
TestPool = PoolMachine.TestCase
TestPoolWithoutCaching = PoolMachineWithoutCaching.TestCase
