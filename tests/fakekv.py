"""A fake KV store: each block holds the token ids whose KV it contains.

Copies performed by the controlled engine move these contents between tiers,
so tests can check that every request's KV is where the manager says it is,
with exactly the right contents, after any sequence of faults.
"""

from __future__ import annotations

from tiered_kv.core import Request
from tiered_kv.manager import Residency, TierManager
from tiered_kv.transfer import TransferPlan


class FakeKV:
    def __init__(self) -> None:
        self.store: dict[str, dict[int, tuple[int, ...]]] = {"GPU": {}, "CPU": {}}
        self.by_hash: dict[object, tuple[int, ...]] = {}  # block hash -> the tokens that block holds

    def copy(self, plan: TransferPlan) -> None:
        src, dst = self.store[plan.src_medium], self.store[plan.dst_medium]
        for s, d in zip(plan.src_block_ids, plan.dst_block_ids, strict=True):
            dst[d] = src.get(s, ())

    def learn(self, req: Request, bs: int) -> None:
        """Remember what each hashed block of ``req`` must contain (a chained hash names its block)."""
        for i, h in enumerate(req.block_hashes):
            self.by_hash[h] = tuple(req.all_token_ids[i * bs : (i + 1) * bs])

    def compute(self, tm: TierManager, req: Request, upto: int) -> None:
        """The model wrote KV for tokens [computed, upto) of ``req`` into its GPU blocks."""
        table = tm.gpu_block_ids(req.request_id)
        bs = tm.block_size
        for i in range(req.num_computed_tokens // bs, -(-upto // bs)):
            self.store["GPU"][table[i]] = tuple(req.all_token_ids[i * bs : min((i + 1) * bs, upto)])

    def check_cached(self, tm: TierManager) -> None:
        """Every ready block of the CPU store holds exactly the KV its hash names (no wrong KV is ever served)."""
        for e in tm.store.entries():
            if e.ready and e.key in self.by_hash:
                got = self.store["CPU"].get(e.block_id, ())
                assert got == self.by_hash[e.key], f"CPU block {e.block_id} holds {got}, not what its hash names"

    def check(self, tm: TierManager, reqs: dict) -> None:
        """Every settled request's computed KV is intact in the tier its residency names."""
        self.check_cached(tm)
        bs = tm.block_size
        for rid in tm.requests():
            req = reqs[rid]
            res = tm.residency(rid)
            n = req.num_computed_tokens
            if res is Residency.GPU:
                tier, table = "GPU", tm.gpu_block_ids(rid)
            elif res is Residency.CPU:
                tier, table = "CPU", tm.cpu_block_ids(rid)
                assert len(table) == -(-n // bs), f"{rid}: the CPU copy has {len(table)} blocks for {n} tokens"
            else:
                continue
            for i in range(-(-n // bs)):
                want = tuple(req.all_token_ids[i * bs : min((i + 1) * bs, n)])
                got = self.store[tier].get(table[i], ())
                assert got[: len(want)] == want, f"{rid}: {tier} block {table[i]} (logical {i}) lost KV"
