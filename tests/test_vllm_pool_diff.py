"""Our BlockPool against vLLM 0.33.0's own BlockPool, side by side on seeded random traces.

Every operation goes to both pools: admissions (prefix lookup, touch of the hits, allocation,
chunked caching), decode steps (the one-block caching path), finishes and preemptions (frees,
last block first), sliding-window-style tables that start with null blocks, allocations that do
not fit, and prefix-cache resets.  After each one the two must agree on every answer (blocks
handed out, hits found, reset refused or done), the whole free-queue order, every block's owner
count and hash, and every event, field by field, with hashes published as 64-bit ints (vLLM's
default) and as raw bytes.  vLLM's pool is imported from its source by ``vllm_ref_core``.

What vLLM has and this does not exercise, because tiered_kv does not claim it: several KV cache
groups, partial-block cache entries, lookahead hashing, multimodal extra keys and LoRA adapter
ids (``lora_id``: tiered_kv knows LoRA names only, and publishes ``None``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, fields

import pytest
import vllm_ref_core

from tiered_kv.core import AllBlocksCleared, BlockPool, Request
from tiered_kv.errors import NotEnoughFreeBlocksError

BS = 4


@dataclass
class Live:
    """One request held by both pools."""

    ours: Request
    theirs: vllm_ref_core.VllmRequest
    table: list[int]  # block ids, the same on both sides
    num_cached: int
    lora: bool


class Twin:
    """Both pools, driven by the same calls and compared after each."""

    def __init__(self, num_blocks: int, int_hashes: bool) -> None:
        self.v = vllm_ref_core.load()
        self.v.set_int_hashes(int_hashes)
        self.ours = BlockPool(num_blocks, True, True, "GPU", int_hashes)
        self.theirs = self.v.BlockPool(num_blocks, True, BS, enable_kv_cache_events=True)
        self.get_hash = self.v.kv_cache_utils.get_block_hash
        self.num_events = 0

    # ------------------------------------------------------------ the two sides' calls
    def lookup(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        ours = [b.block_id for b in self.ours.get_cached_prefix(hashes, max_blocks)]
        theirs: list[int] = []
        for h in hashes[:max_blocks]:  # vLLM's find_longest_cache_hit for one full-attention group
            hit = self.theirs.get_cached_block(h, [0])
            if not hit:
                break
            theirs.append(hit[0].block_id)
        assert ours == theirs, f"lookup: ours {ours}, vLLM {theirs}"
        for h, i in zip(hashes, ours, strict=False):
            assert self.ours.get_cached_block(h).block_id == i
        return ours

    def get_new_blocks(self, n: int) -> list[int] | None:
        if n > self.theirs.get_num_free_blocks():
            with pytest.raises(ValueError):
                self.theirs.get_new_blocks(n)
            with pytest.raises(NotEnoughFreeBlocksError):
                self.ours.get_new_blocks(n)
            return None
        ours = [b.block_id for b in self.ours.get_new_blocks(n)]
        theirs = [b.block_id for b in self.theirs.get_new_blocks(n)]
        assert ours == theirs, f"get_new_blocks({n}): ours {ours}, vLLM {theirs}"
        return ours

    def touch(self, ids: list[int]) -> None:
        self.ours.touch([self.ours.blocks[i] for i in ids])
        self.theirs.touch([self.theirs.blocks[i] for i in ids])

    def free(self, ids: list[int]) -> None:
        self.ours.free_blocks([self.ours.blocks[i] for i in ids])
        self.theirs.free_blocks([self.theirs.blocks[i] for i in ids])

    def cache(self, live: Live, num_full: int) -> None:
        ours_table = [self.ours.blocks[i] for i in live.table]
        theirs_table = [self.theirs.blocks[i] for i in live.table]
        self.ours.cache_full_blocks(live.ours, ours_table, live.num_cached, num_full, BS)
        self.theirs.cache_full_blocks(live.theirs, theirs_table, live.num_cached, num_full, BS, 0)
        live.num_cached = max(live.num_cached, num_full)

    def reset(self) -> None:
        ours, theirs = self.ours.reset_prefix_cache(), self.theirs.reset_prefix_cache()
        assert ours == theirs, f"reset_prefix_cache: ours {ours}, vLLM {theirs}"

    # ---------------------------------------------------------------------- checks
    def check(self, lora_ids: set[str]) -> None:
        o, t = self.ours, self.theirs
        assert o.free_queue_ids() == [b.block_id for b in t.free_block_queue.get_all_free_blocks()]
        assert o.get_num_free_blocks() == t.get_num_free_blocks()
        assert o.get_usage() == t.get_usage()
        assert [b.ref_cnt for b in o.blocks[1:]] == [b.ref_cnt for b in t.blocks[1:]]
        assert [b.block_hash for b in o.blocks] == [
            None if b.block_hash is None else self.get_hash(b.block_hash) for b in t.blocks
        ]
        ours_ev, theirs_ev = o.take_events(), t.take_events()
        assert len(ours_ev) == len(theirs_ev), f"events: ours {ours_ev}, vLLM {theirs_ev}"
        for mine, ref in zip(ours_ev, theirs_ev, strict=True):
            assert type(mine).__name__ == type(ref).__name__, (mine, ref)
            want = vllm_ref_core.struct_fields(ref)
            got = {f.name: getattr(mine, f.name) for f in fields(mine)}
            if isinstance(mine, AllBlocksCleared):
                assert want == {} and got == {"medium": "GPU"}  # vLLM's event has no fields
                continue
            assert list(got) == list(want), "the event's fields differ from vLLM 0.33's, or their order"
            if "lora_id" in want and want["lora_id"] is not None:
                assert got["lora_id"] is None and got["lora_name"] in lora_ids  # no adapter ids here
                want["lora_id"] = None
            assert got == want
        self.num_events += len(ours_ev)
        o.check_invariants()


def chain(tokens: list[int], extra: str) -> list[bytes]:
    out: list[bytes] = []
    parent = extra.encode()
    for s in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hashlib.sha256(parent + bytes(tokens[s : s + BS])).digest()
        out.append(parent)
    return out


def replay(seed: int, num_requests: int, num_blocks: int, int_hashes: bool) -> Twin:
    """Drive ``num_requests`` admissions (and their steps, finishes, resets) through both pools."""
    rng = random.Random(seed)
    tw = Twin(num_blocks, int_hashes)
    prefixes = [[rng.randrange(64) for _ in range(rng.randrange(2, 7) * BS)] for _ in range(6)]
    live: dict[str, Live] = {}
    lora_names: set[str] = set()
    admitted = 0
    while admitted < num_requests:
        r = rng.random()
        if r < 0.3 or not live:
            admitted += 1
            rid = f"r{admitted}"
            tokens = list(rng.choice(prefixes))[: rng.randrange(1, 7) * BS]
            tokens += [rng.randrange(64) for _ in range(rng.randrange(1, 3 * BS))]
            lora = rng.random() < 0.1
            salt = "salt" if rng.random() < 0.1 else None
            name = "adapter" if lora else None
            ours = Request(rid, tokens, lora_name=name, cache_salt=salt)
            ours.block_hashes = chain(tokens, f"{name}|{salt}")
            theirs = vllm_ref_core.VllmRequest(
                rid,
                ours.all_token_ids,  # one list: a decode step appends to both
                ours.block_hashes,
                vllm_ref_core.VllmLoRARequest("adapter", 7) if lora else None,
                salt,
            )
            if lora:
                lora_names.add("adapter")
            n_blocks = -(-len(tokens) // BS)
            num_null = rng.randrange(1, 3) if rng.random() < 0.05 and n_blocks > 2 else 0
            hits = [] if num_null else tw.lookup(ours.block_hashes, (len(tokens) - 1) // BS)
            need = n_blocks - len(hits) - num_null
            free_hits = sum(1 for i in hits if tw.ours.blocks[i].ref_cnt == 0)  # touching takes them
            if need > tw.ours.get_num_free_blocks() - free_hits:  # does not fit: a manager admits nothing
                if need > tw.ours.get_num_free_blocks():
                    assert tw.get_new_blocks(need) is None  # both pools refuse, and nothing changes
                tw.check(lora_names)
                continue
            tw.touch(hits)
            new = tw.get_new_blocks(need)
            assert new is not None
            # A table with a null head is cached from block 0: the range starts with null blocks.
            lv = Live(ours, theirs, [0] * num_null + hits + new, 0 if num_null else len(hits), lora)
            num_full = len(tokens) // BS
            chunk = rng.randrange(lv.num_cached, num_full + 1)  # chunked prefill: cache part now
            tw.cache(lv, chunk)
            live[rid] = lv
        elif r < 0.75:
            lv = live[rng.choice(list(live))]
            num_full = len(lv.ours.all_token_ids) // BS
            if lv.num_cached < num_full:
                tw.cache(lv, rng.randrange(lv.num_cached + 1, num_full + 1))
            else:  # decode: final tokens, maybe a new block, then cache the blocks they filled
                before = len(lv.ours.all_token_ids)
                lv.ours.all_token_ids.extend(rng.randrange(64) for _ in range(rng.randrange(1, BS + 1)))
                n_tok = len(lv.ours.all_token_ids)
                if -(-n_tok // BS) > len(lv.table):
                    got = tw.get_new_blocks(1)
                    if got is None:  # does not fit: the step is not taken
                        del lv.ours.all_token_ids[before:]
                        tw.check(lora_names)
                        continue
                    lv.table += got
                lv.ours.block_hashes[:] = chain(lv.ours.all_token_ids, f"{lv.ours.lora_name}|{lv.ours.cache_salt}")
                tw.cache(lv, n_tok // BS)
        elif r < 0.99:
            lv = live.pop(rng.choice(list(live)))
            tw.free(lv.table[::-1])  # a request's blocks, last block first
        else:
            tw.reset()
        tw.check(lora_names)
    for lv in live.values():
        tw.free(lv.table[::-1])
    tw.reset()
    tw.check(lora_names)
    assert tw.ours.get_num_free_blocks() == num_blocks - 1
    return tw


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "raw-hashes"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traces_match_vllm_block_pool(seed: int, int_hashes: bool) -> None:
    tw = replay(seed, num_requests=400, num_blocks=48, int_hashes=int_hashes)
    assert tw.num_events > 400  # the trace did store and evict


@pytest.mark.slow
def test_long_random_trace_matches_vllm_block_pool() -> None:
    tw = replay(7, num_requests=10_000, num_blocks=96, int_hashes=True)
    assert tw.num_events > 10_000
