"""Random tier-manager operations with a fake KV store that the controlled engine copies.

After every step: each block has exactly the owners its ref count says (request
tables plus in-flight plans), every settled request's computed KV is intact in
the tier its state names (or it is marked for recompute), and both pools keep
their invariants.  At the end, with all plans settled and all requests
finished, no block is held in either tier.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from fakekv import FakeKV
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv.core import Request
from tiered_kv.errors import InvalidTransitionError
from tiered_kv.manager import CostModel, RequestState, TierManager
from tiered_kv.transfer import ControlledCopyEngine

BS = 2
GPU, CPU = 10, 8


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = FakeKV()
        self.eng = ControlledCopyEngine({"GPU": GPU, "CPU": CPU}, on_complete=self.kv.copy)
        self.tm: TierManager | None = None
        self.n = 0
        self.history: list[list[int]] = []

    @precondition(lambda self: self.tm is None)
    @rule(
        offload=st.sampled_from(["none", "write_through", "on_evict", "no caching"]),
        policy=st.sampled_from(["lru", "largest", "prefill_aware", "cost_aware"]),
        window=st.integers(1, 6),
    )
    def configure(self, offload, policy, window):
        cm = CostModel(kv_bytes_per_token=8, block_size=BS)
        caching = offload != "no caching"
        self.tm = TierManager(
            GPU,
            CPU,
            BS,
            self.eng,
            cost_model=cm,
            offload=offload if caching else "none",
            policy=policy,
            hash_fn="fast",
            enable_caching=caching,
            evict_window=window,
        )

    def _runnable(self):
        return sorted(r for r in self.tm.requests(RequestState.RUNNING) if self.tm.is_runnable(r))

    def _compute(self, rid, n):
        e = self.tm._entries[rid]
        self.kv.compute(self.tm, rid, e.request.num_computed_tokens + n)
        e.request.num_computed_tokens += n
        self.kv.learn(e.request, BS)
        self.tm.on_tokens_computed(rid)

    @precondition(lambda self: self.tm is not None)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7), chunk=st.integers(1, 7))
    def admit(self, tokens, chunk):
        self._admit(tokens, chunk)

    @precondition(lambda self: self.tm is not None and self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), chunk=st.integers(1, 9))
    def admit_again(self, data, extra, chunk):
        """A follow-up that resends an earlier prompt: prefix hits on the GPU or the CPU tier."""
        self._admit(data.draw(st.sampled_from(self.history)) + extra, chunk)

    @precondition(lambda self: self.tm is not None)
    @rule()
    def settle_all(self):
        while True:
            ready = [
                p
                for p in self.eng.pending_ids()
                if not any(w in self.eng.pending for w in self.eng.pending[p].plan.wait_for)
            ]
            if not ready:
                break
            self.eng.complete(ready[0])
        self.tm.poll()

    def _admit(self, tokens, chunk):
        self.history.append(list(tokens))
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, tokens, max_tokens=6)
        res = self.tm.admit(req, min(chunk, len(tokens)))
        if res is not None and res.runnable:
            self._compute(rid, res.num_new_tokens)

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data(), k=st.integers(1, 3))
    def step(self, data, k):
        """Compute the next chunk of a runnable request (rest of prompt, or new output tokens)."""
        ids = self._runnable()
        if not ids:
            return
        rid = data.draw(st.sampled_from(ids))
        req = self.tm._entries[rid].request
        pending = req.num_tokens - req.num_computed_tokens
        appended = 0
        if pending == 0:
            req.append_output_token_ids(data.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k)))
            pending = appended = k
        if self.tm.allocate(rid, pending) is None:
            if appended:
                del req.all_token_ids[-appended:]  # not scheduled: the sample never happened
        else:
            # A successful allocation of a running request may be computed at once, whatever
            # copies are in flight: no block it got is read or written by a copy.
            assert self.tm.is_runnable(rid)
            self._compute(rid, pending)

    @precondition(lambda self: self.tm is not None)
    @rule(n=st.integers(1, 6), mode=st.sampled_from(["swap", "recompute", "auto"]))
    def preempt(self, n, mode):
        self.tm.preempt(n, mode=mode)

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def resume(self, data):
        ids = sorted(self.tm.requests(RequestState.SWAPPED))
        if ids:
            self.tm.resume(data.draw(st.sampled_from(ids)))

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data(), outcome=st.sampled_from(["complete", "fail", "cancel"]))
    def settle_one(self, data, outcome):
        ready = [
            p
            for p in self.eng.pending_ids()
            if not any(w in self.eng.pending for w in self.eng.pending[p].plan.wait_for)
        ]
        if not ready:
            return
        pid = data.draw(st.sampled_from(ready))
        if outcome == "complete":
            self.eng.complete(pid)
        elif outcome == "fail":
            self.eng.fail(pid)
        else:
            self.eng.cancel(self.eng.pending[pid])
        self.tm.poll()

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def finish(self, data):
        ids = sorted(
            r
            for r in self.tm.requests()
            if self.tm.state(r) in (RequestState.RUNNING, RequestState.SWAPPED, RequestState.PREEMPTED)
        )
        if ids:
            self.tm.finish(data.draw(st.sampled_from(ids)))

    @precondition(lambda self: self.tm is not None)
    @rule(data=st.data())
    def finish_in_flight_is_refused(self, data):
        ids = sorted(self.tm.requests(RequestState.SWAPPING_OUT) + self.tm.requests(RequestState.SWAPPING_IN))
        if ids:
            try:
                self.tm.finish(data.draw(st.sampled_from(ids)))
            except InvalidTransitionError:
                pass
            else:
                raise AssertionError("finish of an in-flight request was accepted")

    @invariant()
    def consistent(self):
        if self.tm is None:
            return
        self.tm.check_invariants()
        self.kv.check(self.tm)
        m = self.tm.metrics()
        assert m.plans_in_flight == len(self.eng.pending)

    def teardown(self):
        if self.tm is None:
            return
        while self.eng.pending:
            ready = [
                p
                for p in self.eng.pending_ids()
                if not any(w in self.eng.pending for w in self.eng.pending[p].plan.wait_for)
            ]
            self.eng.complete(ready[0])
            self.tm.poll()
        self.kv.check(self.tm)
        for rid in list(self.tm.requests()):
            self.tm.finish(rid)
        self.tm.check_invariants()
        assert all(b.ref_cnt == 0 for b in self.tm.gpu_pool.blocks)
        assert all(b.ref_cnt == 0 for b in self.tm.cpu_pool.blocks)
        assert self.tm.gpu_pool.get_num_free_blocks() == GPU - 1
        assert self.tm.cpu_pool.get_num_free_blocks() == CPU - 1


TierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERED_KV_STATEFUL_EXAMPLES", "300")), stateful_step_count=60, deadline=None
)
TestTier = TierMachine.TestCase
