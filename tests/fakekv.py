"""A fake KV store: each block holds the token ids whose KV it contains.

Copies performed by the controlled engine move these contents between tiers,
so tests can check that every request's KV is where the manager says it is,
with exactly the right contents, after any sequence of faults.
"""

from __future__ import annotations

from tiered_kv.manager import RequestState, TierManager
from tiered_kv.transfer import TransferPlan


class FakeKV:
    def __init__(self) -> None:
        self.store: dict[str, dict[int, tuple[int, ...]]] = {"GPU": {}, "CPU": {}}
        self.by_hash: dict[object, tuple[int, ...]] = {}  # block hash -> the tokens that block holds

    def learn(self, req, bs: int) -> None:
        """Remember what each hashed block of ``req`` must contain (a chained hash names its block)."""
        for i, h in enumerate(req.block_hashes):
            self.by_hash[h] = tuple(req.all_token_ids[i * bs : (i + 1) * bs])

    def copy(self, plan: TransferPlan) -> None:
        src, dst = self.store[plan.src_medium], self.store[plan.dst_medium]
        for s, d in zip(plan.src_block_ids, plan.dst_block_ids, strict=True):
            dst[d] = src.get(s, ())

    def compute(self, tm: TierManager, rid, upto: int) -> None:
        """The model wrote KV for tokens [computed, upto) of ``rid``."""
        e = tm._entries[rid]
        req = e.request
        table = tm.gpu.req_to_blocks[rid]
        bs = tm.block_size
        for i in range(req.num_computed_tokens // bs, -(-upto // bs)):
            self.store["GPU"][table[i].block_id] = tuple(req.all_token_ids[i * bs : min((i + 1) * bs, upto)])

    def check_cached(self, tm: TierManager) -> None:
        """Every block cached on the CPU holds exactly the KV its hash names (no wrong KV is ever served)."""
        if tm.cpu_pool is None:
            return
        for b in tm.cpu_pool.blocks[1:]:
            if b.block_hash is not None and b.block_hash in self.by_hash:
                got = self.store["CPU"].get(b.block_id, ())
                assert got == self.by_hash[b.block_hash], f"CPU block {b.block_id} holds {got}, not what its hash names"

    def check(self, tm: TierManager) -> None:
        """Every settled request's computed KV is intact in the tier its state says."""
        self.check_cached(tm)
        bs = tm.block_size
        for rid, e in tm._entries.items():
            req = e.request
            if e.state is RequestState.RUNNING:
                table = tm.gpu.req_to_blocks[rid]
                for i in range(-(-req.num_computed_tokens // bs)):
                    want = tuple(req.all_token_ids[i * bs : min((i + 1) * bs, req.num_computed_tokens)])
                    got = self.store["GPU"].get(table[i].block_id, ())
                    assert got[: len(want)] == want, f"{rid}: GPU block {table[i].block_id} (logical {i}) lost KV"
            elif e.state is RequestState.SWAPPED:
                for i, c in enumerate(e.cpu_table):
                    if c is None:
                        continue
                    want = tuple(req.all_token_ids[i * bs : min((i + 1) * bs, e.num_kv_tokens)])
                    got = self.store["CPU"].get(c.block_id, ())
                    assert got[: len(want)] == want, f"{rid}: CPU block {c.block_id} (logical {i}) lost KV"
