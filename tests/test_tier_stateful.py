"""Random tier-manager operations with a fake KV store that the controlled engine copies.

The machine plays the scheduler: it owns each request's progress and applies
what the manager returns.  After every step: each block has exactly the owners
its ref count says (tables plus copies in flight), every pin of the CPU store is
a swapped request's or a load's, every settled request's computed KV is intact
in the tier its residency names, every block cached on the CPU holds the KV its
hash names, and block tables only grow while a request stays in a tier.  At the
end, with all copies settled and all requests freed, no block is held anywhere.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from fakekv import FakeKV
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError
from tiered_kv.manager import CostModel, ManagerConfig, Residency, TierManager
from tiered_kv.manager.victim_policy import Candidate, get_victim_policy, select_victims
from tiered_kv.transfer import ControlledCopyEngine, PlanKind

BS = 2
GPU, CPU = 10, 8


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = FakeKV()
        self.eng = ControlledCopyEngine({"GPU": GPU, "CPU": CPU}, on_complete=self.kv.copy)
        self.tm: TierManager | None = None
        self.reqs: dict[str, Request] = {}
        self.n = 0
        self.history: list[list[int]] = []
        self.tables: dict[str, tuple[Residency, list[int]]] = {}

    @precondition(lambda self: self.tm is None)
    @rule(
        offload=st.sampled_from(["none", "write_through", "write_back", "no caching"]),
        store_policy=st.sampled_from(["lru", "arc"]),
        window=st.integers(1, 6),
    )
    def configure(self, offload, store_policy, window):
        cm = CostModel(kv_bytes_per_token=8, block_size=BS)
        caching = offload != "no caching"
        self.tm = TierManager(
            ManagerConfig(
                GPU,
                CPU,
                BS,
                offload=offload if caching else "none",
                store_policy=store_policy,
                hash_fn="fast",
                enable_caching=caching,
                evict_window=window,
            ),
            self.eng,
            cost_model=cm,
        )

    # ------------------------------------------------------------------ helpers
    def _apply(self, done) -> None:
        """The scheduler's part of a completion: progress."""
        for c in done:
            if c.request_id is None or c.request_id not in self.reqs:
                continue
            req = self.reqs[c.request_id]
            if c.kind is PlanKind.SWAP_IN and c.ok:
                assert c.num_tokens == req.num_computed_tokens  # a swap keeps all of the KV
            elif c.kind is PlanKind.ONBOARD:
                if c.ok:
                    req.num_computed_tokens = c.num_tokens  # its progress now: GPU hits and the loaded prefix
                else:  # the manager holds nothing for it now: it would be recomputed from scratch
                    del self.reqs[c.request_id]

    def _poll(self) -> None:
        self._apply(self.tm.poll())

    def _compute(self, rid, n):
        req = self.reqs[rid]
        self.kv.compute(self.tm, req, req.num_computed_tokens + n)
        req.num_computed_tokens += n
        self.kv.learn(req, BS)
        self.tm.on_tokens_computed(rid)

    def _on(self, residency):
        return sorted(r for r in self.tm.requests() if self.tm.residency(r) is residency)

    def _ready(self):
        return [
            p
            for p in self.eng.pending_ids()
            if not any(w in self.eng.pending for w in self.eng.pending[p].plan.wait_for)
        ]

    # -------------------------------------------------------------------- rules
    @precondition(lambda self: self.tm is not None)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7), chunk=st.integers(1, 7))
    def admit(self, tokens, chunk):
        self._admit(tokens, chunk)

    @precondition(lambda self: self.tm is not None and self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), chunk=st.integers(1, 9))
    def admit_again(self, data, extra, chunk):
        """A follow-up that resends an earlier prompt: prefix hits on the GPU or the CPU tier."""
        self._admit(data.draw(st.sampled_from(self.history)) + extra, chunk)

    def _admit(self, tokens, chunk):
        self.history.append(list(tokens))
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, tokens, max_tokens=6)
        res = self.tm.admit(req, min(chunk, len(tokens)))
        if res is None:
            return
        self.reqs[rid] = req
        req.num_computed_tokens = res.num_computed_tokens
        if res.runnable:
            self._compute(rid, res.num_new_tokens)

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data(), k=st.integers(1, 3))
    def step(self, data, k):
        """Compute the next chunk of a request on the GPU (rest of prompt, or new output tokens)."""
        ids = self._on(Residency.GPU)
        if not ids:
            return
        rid = data.draw(st.sampled_from(ids))
        req = self.reqs[rid]
        pending = req.num_tokens - req.num_computed_tokens
        appended = 0
        if pending == 0:
            req.append_output_token_ids(data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
            pending = appended = k
        if self.tm.allocate(rid, pending) is None:
            if appended:
                del req.all_token_ids[-appended:]  # not scheduled: the sample never happened
        else:
            # A successful allocation may be computed at once, whatever copies are in flight:
            # no block it got is read or written by a copy.
            self._compute(rid, pending)

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data(), mode=st.sampled_from(["swap", "recompute", "auto"]))
    def preempt_one(self, data, mode):
        ids = self._on(Residency.GPU)
        if not ids:
            return
        rid = data.draw(st.sampled_from(ids))
        p = self.tm.preempt(rid, mode)
        if p is not None and p.residency is None:
            self.reqs[rid].num_computed_tokens = 0  # recompute: the KV is gone
            del self.reqs[rid]  # this machine forgets recompute victims (a scheduler would re-queue them)

    @precondition(lambda self: self.tm is not None)
    @rule(n=st.integers(1, 6), policy=st.sampled_from(["last_admitted", "largest", "prefill_aware", "cost_aware"]))
    def preempt_for_room(self, n, policy):
        """The scheduler's loop: select victims by a policy, then preempt each (all or nothing)."""
        ids = self._on(Residency.GPU)
        tm = self.tm
        cands = [
            Candidate(
                r, i, len(tm.gpu_block_ids(r)), self.reqs[r].num_computed_tokens, 1, tm.quote, tm.preemption_bounds
            )
            for i, r in enumerate(ids)
        ]
        cpu_room = tm.store.num_free + tm.store.num_evictable  # what a store could take now
        victims = select_victims(get_victim_policy(policy, tm.cost_model), cands, n, "auto", cpu_room)
        for v in victims or ():
            p = self.tm.preempt(v.request_id, "auto")
            if p.residency is None:
                del self.reqs[v.request_id]

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def resume(self, data):
        ids = self._on(Residency.CPU)
        if ids:
            res = self.tm.resume(data.draw(st.sampled_from(ids)))
            if res is not None:
                assert res.num_tokens == self.reqs[res.request_id].num_computed_tokens

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data(), outcome=st.sampled_from(["complete", "fail", "cancel"]))
    def settle_one(self, data, outcome):
        ready = self._ready()
        if not ready:
            return
        pid = data.draw(st.sampled_from(ready))
        if outcome == "complete":
            self.eng.complete(pid)
        elif outcome == "fail":
            self.eng.fail(pid)
        else:
            self.eng.cancel(self.eng.pending[pid])
        self._poll()

    @precondition(lambda self: self.tm is not None)
    @rule()
    def settle_all(self):
        while ready := self._ready():
            self.eng.complete(ready[0])
        self._poll()

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def free(self, data):
        ids = self._on(Residency.GPU) + self._on(Residency.CPU)
        if ids:
            rid = data.draw(st.sampled_from(sorted(ids)))
            self.tm.free(rid)
            del self.reqs[rid]

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def drop_swapped(self, data):
        ids = self._on(Residency.CPU)
        if ids:
            rid = data.draw(st.sampled_from(ids))
            self.tm.drop_swapped(rid)
            del self.reqs[rid]

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def free_in_flight_is_refused(self, data):
        ids = self._on(Residency.SWAPPING_OUT) + self._on(Residency.SWAPPING_IN) + self._on(Residency.LOADING)
        if ids:
            try:
                self.tm.free(data.draw(st.sampled_from(sorted(ids))))
            except InvalidTransitionError:
                pass
            else:
                raise AssertionError("freeing a request mid-copy was accepted")

    # --------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        if self.tm is None:
            return
        self.tm.check_invariants()
        self.kv.check(self.tm, self.reqs)
        assert self.tm.metrics().plans_in_flight == len(self.eng.pending)
        assert set(self.tm.requests()) == set(self.reqs)

    @invariant()
    def tables_only_grow_within_a_tier(self):
        if self.tm is None:
            return
        now = {}
        for rid in self.tm.requests():
            res = self.tm.residency(rid)
            table = self.tm.cpu_block_ids(rid) if res is Residency.CPU else self.tm.gpu_block_ids(rid)
            now[rid] = (res, table)
            before = self.tables.get(rid)
            if before is not None and before[0] is res and res in (Residency.GPU, Residency.CPU):
                assert table[: len(before[1])] == before[1], f"{rid}: its {res.value} table changed"
        self.tables = now

    def teardown(self):
        if self.tm is None:
            return
        for _ in range(100):  # saves before eviction top up at each poll, until the window is stored
            while ready := self._ready():
                self.eng.complete(ready[0])
            self._poll()
            if not self.eng.pending:
                break
        self.kv.check(self.tm, self.reqs)
        for rid in list(self.tm.requests()):
            self.tm.free(rid)
        self._poll()
        while ready := self._ready():
            self.eng.complete(ready[0])
            self._poll()
        self.tm.check_invariants()
        assert all(b.ref_cnt == 0 for b in self.tm.gpu.block_pool.blocks)
        assert self.tm.num_free_gpu_blocks() == GPU - 1 or self.eng.pending
        assert self.tm.store.num_pinned == 0


TierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERED_KV_STATEFUL_EXAMPLES", "300")), stateful_step_count=60, deadline=None
)
TestTier = TierMachine.TestCase
