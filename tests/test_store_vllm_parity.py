"""The CPU store against vLLM 0.33.0's own ``CPUOffloadingManager``, side by side.

Seeded random serving traces (overlapping requests with shared prefixes,
chunked stores that overlap what is already stored, failed stores, loads in
flight across requests, finishes before the copies complete, explicit touches,
resets) are replayed through vLLM's object (imported from its wheel, see
``vllm_ref_offload.py``) and through :class:`~tiered_kv.tiers.cpu_store.CPUStore`
with the same policy.  Every answer is compared: each lookup, each load's slots,
each store's keys, slots and evictions (in order), each batch of events, the
usage gauges and allocation sizes, and at intervals the policy's whole order
(LRU's ranking; ARC's T1, T2, B1, B2 and target).  Our slots are vLLM's plus
one (slot 0 is reserved here).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import vllm_ref_offload

from tiered_kv.tiers.cpu_store import CPUStore, RequestContext
from tiered_kv.tiers.store import LookupResult

BLOCK = 16


@pytest.fixture(scope="module")
def vllm():
    return vllm_ref_offload.load()


@dataclass
class Req:
    rid: str
    keys: list[bytes]
    ours: RequestContext
    theirs: object
    next_store: int = 0
    stores: list[tuple[list[bytes], bool]] = field(default_factory=list)  # (keys, success) in flight
    loads: list[list[bytes]] = field(default_factory=list)
    finished: bool = False


class Replay:
    """Drives both managers through one trace, asserting after every call that they agree."""

    def __init__(self, vllm, policy: str, num_chunks: int, seed: int) -> None:
        self.v = vllm
        self.rng = random.Random(seed)
        self.policy = policy
        self.theirs = vllm.manager.CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True)
        self.ours = CPUStore(num_chunks + 1, policy, enable_events=True)
        self.active: list[Req] = []
        self.closing: list[Req] = []  # finished, with copies still in flight
        self.n_requests = 0
        self.calls = 0
        self.evictions = 0
        self.failed = 0
        self.hits = 0
        # A few documents whose prefixes requests share (system prompts, multi-turn histories).
        self.docs = [[self._key(f"d{d}-{i}") for i in range(64)] for d in range(48)]

    def _key(self, name: str) -> bytes:
        return self.v.base.make_offload_key(name.encode(), 0)

    # ------------------------------------------------------------- one call each
    def new_request(self) -> Req:
        rng = self.rng
        rid = f"r{self.n_requests}"
        self.n_requests += 1
        doc = self.docs[min(int(rng.paretovariate(1.2)) - 1, len(self.docs) - 1)]
        shared = rng.randint(0, 40)
        own = rng.randint(1, 16)
        keys = doc[:shared] + [self._key(f"{rid}-{i}") for i in range(own)]
        ours = RequestContext(rid)
        theirs = self.v.base.ReqContext(req_id=rid)
        if rng.random() < 0.9:  # the rest exercise the paths without positions
            for i, k in enumerate(keys):
                theirs.set_offload_key_position(k, (i + 1) * BLOCK)
            ours.set_positions(keys, BLOCK, BLOCK)
        req = Req(rid, keys, ours, theirs)
        self.theirs.on_new_request(theirs)
        self.ours.on_new_request(ours)
        # Lookup of the prefix, then a load of the hits, as a connector does at admission.
        n = 0
        for k in keys[:-1]:
            a, b = self.theirs.lookup(k, theirs), self.ours.lookup(k, ours)
            assert a.name == b.name, (rid, k, a, b)
            if b is not LookupResult.HIT:
                break
            n += 1
        self.calls += n + 1
        if n:
            self.hits += n
            hit = keys[:n]
            a = self.theirs.prepare_load(hit, theirs)
            b = self.ours.prepare_load(hit, ours)
            assert [i + 1 for i in a.block_ids.tolist()] == list(b.block_ids)
            req.loads.append(hit)
        req.next_store = n
        self.active.append(req)
        return req

    def store_chunk(self, req: Req) -> None:
        rng = self.rng
        start = req.next_store
        if rng.random() < 0.3 and start:
            start = rng.randrange(0, start)  # overlap: offer again what may be there already
        end = min(len(req.keys), req.next_store + rng.randint(1, 8))
        keys = req.keys[start:end]
        req.next_store = max(req.next_store, end)
        if not keys:
            return
        a = self.theirs.prepare_store(keys, req.theirs)
        b = self.ours.prepare_store(keys, req.ours)
        self.calls += 1
        if a is None or b is None:
            assert a is None and b is None, (req.rid, keys, a, b)
            return
        assert a.keys_to_store == b.keys_to_store
        assert [i + 1 for i in a.store_spec.block_ids.tolist()] == list(b.store_spec.block_ids)
        assert a.evicted_keys == b.evicted_keys
        self.evictions += len(b.evicted_keys)
        if b.keys_to_store:
            # The connector completes the whole offer, as a set.
            req.stores.append((list(keys), rng.random() >= 0.05))

    def complete_one(self, req: Req) -> None:
        rng = self.rng
        if req.stores and (not req.loads or rng.random() < 0.6):
            keys, ok = req.stores.pop(rng.randrange(len(req.stores)))
            self.failed += not ok
            self.theirs.complete_store(set(keys), req.theirs, ok)
            self.ours.complete_store(set(keys), ok, req.ours)
        elif req.loads:
            keys = req.loads.pop(0)
            self.theirs.complete_load(keys, req.theirs)
            self.ours.complete_load(keys, req.ours)
        self.calls += 1

    def finish(self, req: Req) -> None:
        self.theirs.on_request_finished(req.theirs)
        self.ours.on_request_finished(req.ours)
        req.finished = True
        self.calls += 1

    def touch(self, req: Req) -> None:
        keys = [k for k in req.keys[: self.rng.randint(1, len(req.keys))]]
        self.theirs.touch(keys, req.theirs)
        self.ours.touch(keys, req.ours)
        self.calls += 1

    def events(self) -> None:
        a = [(e.keys, e.removed, e.metadata_only) for e in self.theirs.take_events()]
        b = [(e.keys, e.removed, e.metadata_only) for e in self.ours.take_events()]
        assert a == b

    def stats(self) -> None:
        v = self.v.common.CPUOffloadingMetrics
        stats = self.theirs.get_stats()
        a, b = stats.gauges, self.ours.get_stats()
        assert a[v.CPU_CACHE_USAGE_PERC] == pytest.approx(b.usage)
        assert a[v.CPU_CACHE_WRITE_USAGE_PERC] == pytest.approx(b.write_usage)
        assert a[v.CPU_CACHE_READ_USAGE_PERC] == pytest.approx(b.read_usage)
        assert tuple(stats.histograms.get(v.CPU_ALLOCATION_SIZE, ())) == b.allocation_sizes

    def same_state(self) -> None:
        pol = self.theirs._policy  # vLLM's internals: the reference's whole decision state
        if self.policy == "lru":
            theirs = sorted(pol._ranks, key=pol._ranks.__getitem__)
            assert theirs == self.ours.policy.order()
        else:
            ours = self.ours.policy
            assert (list(pol.t1), list(pol.t2), list(pol.b1), list(pol.b2)) == (
                list(ours.t1),
                list(ours.t2),
                list(ours.b1),
                list(ours.b2),
            )
            assert pol.target_t1_size == ours.target_t1_size
        self.ours.check_invariants()

    # --------------------------------------------------------------- the trace
    def run(self, n_requests: int, max_active: int = 12, check_every: int = 500) -> None:
        rng = self.rng
        step = 0
        while self.n_requests < n_requests or self.active or self.closing:
            step += 1
            new_ids = []
            if self.n_requests < n_requests and len(self.active) < max_active and rng.random() < 0.5:
                new_ids.append(self.new_request().rid)
            for req in list(self.active):
                r = rng.random()
                if req.next_store < len(req.keys) and r < 0.6:
                    self.store_chunk(req)
                elif r < 0.75 and (req.stores or req.loads):
                    self.complete_one(req)
                elif r < 0.77:
                    self.touch(req)
                elif req.next_store >= len(req.keys) or r < 0.8:
                    self.finish(req)
                    self.active.remove(req)
                    if req.stores or req.loads:
                        self.closing.append(req)
            for req in list(self.closing):  # copies of finished requests land later
                if rng.random() < 0.5:
                    self.complete_one(req)
                    if not (req.stores or req.loads):
                        self.closing.remove(req)
            ctx = self.v.base.ScheduleEndContext(new_req_ids=new_ids, preempted_req_ids=[])
            self.theirs.on_schedule_end(ctx)
            self.ours.on_schedule_end(new_ids, ())
            if step % 7 == 0:
                self.events()
            if step % 11 == 0:
                self.stats()
            if step % check_every == 0:
                self.same_state()
            if step % 5000 == 0 and not self.closing and not any(r.stores or r.loads for r in self.active):
                self.theirs.reset_cache()
                self.ours.reset_cache()
        self.events()
        self.stats()
        self.same_state()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", [1, 2])
def test_replay_matches_vllm(vllm, policy, seed):
    replay = Replay(vllm, policy, num_chunks=96 + 64 * seed, seed=seed)
    replay.run(2_000)
    # The trace must exercise what it claims to compare.
    assert replay.evictions > 500 and replay.failed > 10 and replay.hits > 1000


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_replay_10k_requests_matches_vllm(vllm, policy):
    replay = Replay(vllm, policy, num_chunks=256, seed=10_000)
    replay.run(10_000)
    assert replay.evictions > 10_000 and replay.failed > 100 and replay.hits > 10_000


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_an_empty_load_ranks_no_request_as_in_vllm(vllm, policy):
    """A load of no keys (a prefix lookup with no hit) is no access: the next evictions are vLLM's.

    With LRU, a request's rank is taken at its first access; an empty load that took it would
    make request A older than B, so A's block would go first where vLLM evicts B's.
    """
    theirs = vllm.manager.CPUOffloadingManager(2, cache_policy=policy)
    ours = CPUStore(3, policy)
    key = {name: vllm.base.make_offload_key(name.encode(), 0) for name in ("a1", "b1", "c1")}
    ctx = {}
    for rid in "ABC":
        o, t = RequestContext(rid), vllm.base.ReqContext(req_id=rid)
        o.set_position(key[rid.lower() + "1"], BLOCK)
        t.set_offload_key_position(key[rid.lower() + "1"], BLOCK)
        ours.on_new_request(o)
        theirs.on_new_request(t)
        ctx[rid] = (o, t)
    assert list(ours.prepare_load([], ctx["A"][0]).block_ids) == []
    theirs.prepare_load([], ctx["A"][1])
    for rid in "BA":
        o, t = ctx[rid]
        k = key[rid.lower() + "1"]
        assert ours.prepare_store([k], o).keys_to_store == theirs.prepare_store([k], t).keys_to_store == [k]
        ours.complete_store([k], True, o)
        theirs.complete_store([k], t)
    expected = list(theirs.prepare_store([key["c1"]], ctx["C"][1]).evicted_keys)
    assert expected == [key["b1"]]  # vLLM: B's block is the older one
    assert list(ours.prepare_store([key["c1"]], ctx["C"][0]).evicted_keys) == expected
