"""Layer-wise swap-in: a resumed request computes while its KV lands, layer by layer.

The scheduler half is driven with the controlled engine (the test lands each
layer, in any order, or fails the load); the engine half runs the real model on
CPU copy engines whose layer order and faults the test sets, and compares every
token and logit with the request run alone.
"""

from __future__ import annotations

import threading

import pytest
from engine_configs import engine_config
from test_engine_exact import LAYOUTS, check, prompts, run

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, PlanError
from tiered_kv.manager import CostModel, ManagerConfig, PreemptMode, Residency, TierManager
from tiered_kv.sched import RequestStatus, Scheduler, SchedulerConfig
from tiered_kv.storage.kv_storage import KVStorage
from tiered_kv.storage.spec import KVSpec
from tiered_kv.transfer import ControlledCopyEngine
from tiered_kv.transfer.cpu_engine import CpuCopyEngine
from tiered_kv.transfer.plan import PlanKind, TransferPlan, TransferStatus

SPEC = KVSpec(3, 1, 2, "float32", 4)


def sched(**cfg):
    eng = ControlledCopyEngine({"GPU": 7, "CPU": 16})
    tm = TierManager(ManagerConfig(7, 16, 4), eng, kv_spec=SPEC)
    s = Scheduler(tm, SchedulerConfig(mode="swap", layerwise=True, **cfg))
    for i, rid in enumerate("AB"):
        s.add_request(Request(rid, [i * 10 + k for k in range(8)], max_tokens=8, arrival_time=float(i)))
    return s, eng


def step(s, eng, out=None):
    """Land every copy, then apply the step (sampling token 1 wherever a token is due)."""
    eng.complete_all()
    s.update(out, {r.request_id: 1 for r, n in out.scheduled if out.needs_sample(r, n)})
    s.check_consistency()
    s.tm.check_invariants()


def to_resume(s, eng):
    """Run until B, swapped out when A needed its block, is resumed; return that step's output."""
    for _ in range(20):
        out = s.schedule()
        if out.resumed:
            return out
        assert not out.loads
        step(s, eng, out)
    raise AssertionError("B was never resumed")


def test_a_resumed_request_computes_in_the_step_its_load_starts_and_layers_land_in_any_order():
    s, eng = sched()
    out = to_resume(s, eng)
    b = s.requests["B"]
    assert out.resumed == ["B"] and [(r.request_id, n) for r, n in out.scheduled] == [("B", 1)]
    h = out.loads["B"]
    # B's two prompt blocks (GPU 3, 4) were still cached there; only its private tail (CPU 3) is
    # copied, into GPU 6, as 3 layers.  GPU 5 is new, for the token B computes in this very step.
    assert (h.plan.kind, h.plan.src_block_ids, h.plan.dst_block_ids, h.plan.num_layers) == (
        PlanKind.SWAP_IN,
        (3,),
        (6,),
        3,
    )
    assert s.tm.gpu_block_ids("B") == [3, 4, 6, 5]
    assert s.tm.residency("B") is Residency.SWAPPING_IN and s.status["B"] is RequestStatus.RUNNING
    s.check_consistency()
    before = b.num_computed_tokens
    eng.complete_layer(h.plan.plan_id, 2)
    eng.complete_layer(h.plan.plan_id, 0)
    assert [h.layer_done(i) for i in range(3)] == [True, False, True] and not h.done()
    eng.complete_layer(h.plan.plan_id, 1)
    step(s, eng, out)
    assert b.num_computed_tokens == before + 1 and s.tm.residency("B") is Residency.GPU
    while s.num_unfinished:
        step(s, eng, s.schedule())
    assert s.tm.num_free_gpu_blocks() == 6


def test_a_load_that_fails_at_layer_k_discards_the_step_and_the_request_resumes_later():
    s, eng = sched()
    out = to_resume(s, eng)
    b = s.requests["B"]
    h = out.loads["B"]
    before = b.num_computed_tokens
    assert s.tm.num_free_gpu_blocks() == 2  # 6 usable: B holds 3, 4 (hits), 6 (loading), 5 (new)
    eng.complete_layer(h.plan.plan_id, 0)
    eng.fail(h.plan.plan_id)  # layer 0 landed; layers 1 and 2 never will
    assert h.wait_layer(0) and not h.wait_layer(1) and not h.wait_layer(2)
    s.update(out, {"B": 1})  # whatever B sampled on KV that never landed is ignored
    assert b.num_computed_tokens == before and len(b.output_token_ids) == before - 8 + 1
    assert s.status["B"] is RequestStatus.SWAPPED and list(s.swapped) == [b]
    assert s.tm.residency("B") is Residency.CPU
    assert s.tm.num_free_gpu_blocks() == 6  # all four went back (3 and 4 stay cached, free)
    s.check_consistency()
    s.tm.check_invariants()
    out = s.schedule()  # resumed again, at once
    assert out.resumed == ["B"] and "B" in out.loads
    step(s, eng, out)
    while s.num_unfinished:
        step(s, eng, s.schedule())
    assert len(b.output_token_ids) == 8 and s.tm.num_free_gpu_blocks() == 6


def test_abort_during_a_layerwise_load_cancels_it_and_frees_everything():
    s, eng = sched()
    out = to_resume(s, eng)
    h = out.loads["B"]
    s.abort("B")
    assert h.done() and not h.ok
    s.update(out, {"B": 1})
    assert s.num_unfinished == 0 and s.tm.requests() == [] and s.tm.num_free_gpu_blocks() == 6
    s.tm.check_invariants()


def test_resume_layered_needs_the_layer_count_and_a_flag():
    eng = ControlledCopyEngine({"GPU": 7, "CPU": 16})
    cm = CostModel(kv_bytes_per_token=8, block_size=4)
    tm = TierManager(ManagerConfig(7, 16, 4), eng, cost_model=cm)  # no kv_spec, and the engine has none
    assert tm.num_layers == 0
    req = Request("A", list(range(8)), max_tokens=4)
    tm.admit(req, 8)
    req.num_computed_tokens = 8
    tm.preempt("A", "swap")
    eng.complete_all()
    tm.poll()
    free = tm.num_free_gpu_blocks()
    with pytest.raises(InvalidArgumentError, match="layer count"):
        tm.resume("A", layered=True)
    with pytest.raises(InvalidArgumentError, match="layered"):
        tm.resume("A", layered="yes")  # type: ignore[arg-type]
    assert tm.residency("A") is Residency.CPU and tm.num_free_gpu_blocks() == free and not tm.plans_in_flight()
    with pytest.raises(InvalidArgumentError, match="layerwise"):
        SchedulerConfig(layerwise=1)  # type: ignore[arg-type]


def test_growing_a_request_whose_kv_is_not_layerwise_loading_is_refused():
    spec_eng = ControlledCopyEngine({"GPU": 7, "CPU": 16})
    tm = TierManager(ManagerConfig(7, 16, 4), spec_eng, kv_spec=SPEC)
    req = Request("A", list(range(10)), max_tokens=4)  # a partial tail: always copied
    tm.admit(req, 10)
    req.num_computed_tokens = 10
    assert tm.preempt("A", "swap").mode is PreemptMode.SWAP
    spec_eng.complete_all()
    tm.poll()
    res = tm.resume("A")  # a whole-request load: the request may not grow until it lands
    assert res.plan is not None and res.plan.num_layers == 0
    ids = tm.gpu_block_ids("A")
    with pytest.raises(InvalidTransitionError, match=f"is {Residency.SWAPPING_IN.value}, not {Residency.GPU.value}"):
        tm.allocate("A", 1)
    assert tm.gpu_block_ids("A") == ids


# ------------------------------------------------------------- the real engine
class Recording(CpuCopyEngine):
    """Records the layer-wise swap-ins submitted."""

    def __init__(self, tiers, **kw):
        super().__init__(tiers, **kw)
        self.layered: list[int] = []

    def submit(self, plan):
        if plan.kind is PlanKind.SWAP_IN and plan.num_layers:
            self.layered.append(plan.plan_id)
        return super().submit(plan)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_swap_in_is_bit_exact_when_layers_land_in_reverse(layout):
    engines = []

    def make(tiers):
        engines.append(Recording(tiers, layer_order=lambda n: list(reversed(range(n)))))
        return engines[-1]

    ps = prompts(1)
    e = run(ps, num_gpu_blocks=16, layout=layout, mode="swap", layerwise=True, copy_engine=make)
    c = e.metrics().counters
    assert c.preemptions_swap > 0 and c.swap_in_blocks > 0 and engines[0].layered
    check(e, ps, layout, exact_logits=True)
    e.scheduler.tm.check_invariants()


def test_layerwise_swap_in_failing_at_layer_k_keeps_every_request_exact():
    failed: list[int] = []

    class FailsAtLayer1(Recording):
        def copy_run_layer(self, plan, run, layer, non_blocking=False):
            if plan.kind is PlanKind.SWAP_IN and layer == 1 and len(failed) < 2 and plan.plan_id not in failed:
                failed.append(plan.plan_id)  # the first two loads land layer 0, then fail
                raise RuntimeError("injected fault at layer 1")
            super().copy_run_layer(plan, run, layer, non_blocking)

    ps = prompts(6)
    e = run(ps, num_gpu_blocks=16, mode="swap", layerwise=True, copy_engine=FailsAtLayer1)
    c = e.metrics().counters
    assert len(failed) == 2 and c.plans_failed >= 2 and c.swap_in_blocks > 0
    check(e, ps, "block_contiguous", exact_logits=True)
    e.scheduler.tm.check_invariants()


def test_compute_reaches_layer_i_before_layer_i_is_copied():
    # Each layer's copy is held until the forward pass asks for that layer, which it does only after
    # computing the layers before it: an engine that waited for the whole load would time out here.
    asked: dict[tuple[int, int], threading.Event] = {}
    timeouts = []

    class Gated(Recording):
        def __init__(self, tiers):
            super().__init__(tiers, layer_hook=self.gate)

        def gate(self, plan, layer):  # on the copy thread, before the layer's copies
            if plan.kind is PlanKind.SWAP_IN and not asked[plan.plan_id, layer].wait(10):
                timeouts.append((plan.plan_id, layer))

        def submit(self, plan):
            for i in range(plan.num_layers):
                asked[plan.plan_id, i] = threading.Event()
            handle = super().submit(plan)
            if plan.num_layers:
                inner = handle.wait_layer

                def wait_layer(layer, timeout=None, pid=plan.plan_id):
                    asked[pid, layer].set()
                    return inner(layer, timeout)

                handle.wait_layer = wait_layer
            return handle

    ps = prompts(1)
    e = run(ps, num_gpu_blocks=16, mode="swap", layerwise=True, copy_engine=Gated)
    assert e.copy.layered and not timeouts
    assert sorted(asked) == [(pid, i) for pid in sorted(e.copy.layered) for i in range(2)]
    check(e, ps, "block_contiguous", exact_logits=True)


# ------------------------------------------------------------------ layer-wise stores of a prefill
class Gating(CpuCopyEngine):
    """Records the gated stores and every open, with the forward pass's layers in between."""

    def __init__(self, tiers, **kw):
        super().__init__(tiers, **kw)
        self.gated: list[int] = []
        self.events: list[tuple] = []

    def submit(self, plan):
        if plan.gated:
            self.gated.append(plan.plan_id)
        return super().submit(plan)

    def open_layer(self, handle, layer, stream=None):
        self.events.append(("open", handle.plan.plan_id, layer))
        super().open_layer(handle, layer, stream)


def test_a_prefill_is_stored_layer_by_layer_as_the_forward_pass_writes_it():
    engines = []

    def make(tiers):
        engines.append(Gating(tiers))
        return engines[-1]

    from tiered_kv.engine.engine import Engine

    ps = prompts(7, n=3)
    config = engine_config(num_gpu_blocks=64, offload="write_through", layerwise=True, record_logits=True)
    e = Engine(config=config, copy_engine=make)
    eng = engines[0]
    for i, layer in enumerate(e.model.layers):
        layer.register_forward_hook(lambda *a, i=i: eng.events.append(("layer", i)))
    for rid, p in ps.items():
        e.add_request(rid, p, 10)
    e.run()
    e.close()
    c = e.metrics().counters
    assert eng.gated and c.offload_blocks > 0
    layers = len(e.model.layers)
    for pid in eng.gated:
        opens = [k for k, ev in enumerate(eng.events) if ev[0] == "open" and ev[1] == pid]
        assert [eng.events[k][2] for k in opens] == list(range(layers))
        # Each layer is opened right after the forward pass computed it, not after the step.
        assert all(eng.events[k - 1] == ("layer", eng.events[k][2]) for k in opens)
    check(e, ps, "block_contiguous", exact_logits=True)
    e.scheduler.tm.check_invariants()


def test_a_layerwise_store_failing_at_layer_k_stores_nothing_and_loses_nothing():
    failed: list[int] = []

    class FailsStoreAtLayer1(Gating):
        def copy_run_layer(self, plan, run, layer, non_blocking=False):
            if plan.gated and layer == 1 and plan.plan_id not in failed:
                failed.append(plan.plan_id)
                raise RuntimeError("injected store fault at layer 1")
            super().copy_run_layer(plan, run, layer, non_blocking)

    from tiered_kv.engine.engine import Engine

    ps = prompts(7, n=3)
    config = engine_config(num_gpu_blocks=64, offload="write_through", layerwise=True, record_logits=True)
    e = Engine(config=config, copy_engine=FailsStoreAtLayer1)
    for rid, p in ps.items():
        e.add_request(rid, p, 10)
    e.run()
    e.close()
    c = e.metrics().counters
    assert failed and c.plans_failed == len(failed) and c.offload_blocks == 0
    assert e.metrics().cpu_cached_blocks == 0  # nothing half-stored was published
    check(e, ps, "block_contiguous", exact_logits=True)
    e.scheduler.tm.check_invariants()


def test_a_gated_store_is_copied_only_once_its_layers_are_open():
    eng = ControlledCopyEngine({"GPU": 16, "CPU": 16})
    tm = TierManager(ManagerConfig(16, 16, 4, offload="write_through"), eng, kv_spec=SPEC)
    s = Scheduler(tm, SchedulerConfig(layerwise=True))
    s.add_request(Request("A", list(range(10)), max_tokens=2))
    out = s.schedule()
    h = out.saves["A"]
    assert h.plan.gated and h.plan.num_layers == 3 and h.plan.src_block_ids == (1, 2)  # two full prompt blocks
    with pytest.raises(PlanError, match="layer 0 is not opened"):
        eng.complete(h.plan.plan_id)
    eng.open_layer(h, 0)
    with pytest.raises(PlanError, match="the next is 1, not 2"):
        eng.open_layer(h, 2)
    assert eng.complete_all() == [] and h.num_opened == 1  # still gated: layers 1 and 2 are not written
    s.update(out, {"A": 1})  # the step is computed: update opens what the driver did not
    assert h.num_opened == 3
    eng.complete_all()
    s.settle()
    assert tm.metrics().counters.offload_blocks == 2 and tm.metrics().cpu_cached_blocks == 2
    with pytest.raises(InvalidArgumentError, match="num_tokens_after_step"):
        tm.start_layerwise_store("A", 99)
    assert tm.plans_in_flight() == []


def test_cancel_after_one_layer_landed_settles_the_load_as_failed_with_its_kv_on_the_cpu():
    s, eng = sched()
    out = to_resume(s, eng)
    tm, h = s.tm, out.loads["B"]
    cpu_ids = tm.cpu_block_ids("B")
    eng.complete_layer(h.plan.plan_id, 0)  # one layer landed, two to go
    assert tm.cancel("B") is True
    assert h.status is TransferStatus.CANCELLED and eng.pending_ids() == []
    with pytest.raises(PlanError):
        eng.complete(h.plan.plan_id)  # settled: nothing is left to finish
    assert tm.residency("B") is Residency.CPU and tm.cpu_block_ids("B") == cpu_ids
    assert tm.plans_in_flight() == [] and tm.num_free_gpu_blocks() == 6
    assert tm.counters.plans_cancelled == 1
    tm.check_invariants()
    res = tm.resume("B")  # the KV is still whole on the CPU: it resumes, and this time lands
    assert res is not None and res.plan is not None
    eng.complete(res.plan.plan_id)
    (c,) = tm.poll()
    assert (c.kind, c.ok, c.residency) == (PlanKind.SWAP_IN, True, Residency.GPU)


def test_abort_after_one_layer_landed_frees_the_request_at_once():
    s, eng = sched()
    out = to_resume(s, eng)
    h = out.loads["B"]
    eng.complete_layer(h.plan.plan_id, 0)
    s.abort("B")  # the cancel answers and settles: nothing is left waiting for a copy nobody can finish
    assert h.status is TransferStatus.CANCELLED and "B" not in s.requests
    s.update(out, {})
    assert s.tm.requests() == list(s.requests) and "B" not in s.tm.requests() and s.tm.plans_in_flight() == []
    s.check_consistency()
    s.tm.check_invariants()
    while s.num_unfinished:
        step(s, eng, s.schedule())
    assert s.tm.num_free_gpu_blocks() == 6


@pytest.mark.parametrize("landed", [0, 1, 2])
def test_cpu_engine_cancel_of_a_partly_landed_layerwise_plan_ends_it_cancelled(landed):
    tiers = {"GPU": KVStorage(SPEC, 4, "GPU", device="cpu"), "CPU": KVStorage(SPEC, 4, "CPU")}
    gate, inside = threading.Event(), threading.Event()

    def hook(plan, layer):
        if layer == landed:
            inside.set()
            gate.wait(5)

    with CpuCopyEngine(tiers, layer_hook=hook) as eng:
        h = eng.submit(TransferPlan(1, "CPU", "GPU", (1, 2), (1, 2), PlanKind.SWAP_IN, "A", num_layers=3))
        assert inside.wait(5)  # layers before `landed` have landed; `landed` is being copied
        assert [h.layer_done(i) for i in range(3)] == [i < landed for i in range(3)]
        assert eng.cancel(h) is True
        gate.set()
        assert not h.wait(5) and h.done() and h.status is TransferStatus.CANCELLED
        # The worker was inside layer `landed` when the cancel came: it stops at the next layer boundary.
        assert [h.layer_done(i) for i in range(3)] == [i <= landed for i in range(3)]
