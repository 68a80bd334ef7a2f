"""The CUDA and cupy engines' own code, run on the CPU through stand-ins of their APIs."""

import pytest
import torch
from engineutil import SPEC, fill_random, tiers
from fakecuda import FakeEvent, install_fake_cuda, install_fake_cupy

from tiered_kv.errors import InvalidArgumentError, PlanError, TransferError
from tiered_kv.transfer import CopyRun, PlanKind, TransferPlan, TransferStatus
from tiered_kv.transfer.cpu_engine import CpuCopyEngine
from tiered_kv.transfer.cuda_engine import run_byte_ranges

LAYOUTS = ["block_contiguous", "layer_first"]
IDS = [([3, 4, 5, 6], [2, 3, 4, 5], [9, 10, 11, 12]), ([7, 2, 13, 5], [11, 3, 8, 1], [4, 15, 6, 10])]
#: The engines' documented default for max_tracked_plans, written out so the
#: bound test also runs against engines that do not expose it.
DEFAULT_MAX_TRACKED = 4096
#: Fake-device operations that move bytes (the torch engine issues its copies
#: inside ``torch.cuda.stream``; cupy's are memcpys or one kernel launch).
COPY_OPS = {"issue", "memcpy", "memcpy2d", "kernel"}
# (engine, kernel_min_runs): the cupy engine copies by memcpy or by its gather kernel.
DEVICE_ENGINES = [("cuda", None), ("cupy", None), ("cupy", 1)]


def fake_engine(monkeypatch, kind, t, kernel_min_runs=None, **kw):
    """A device engine over ``t`` (made before CUDA is faked) on a new fake GPU; returns ``(gpu, engine)``."""
    if kind == "cuda":
        gpu = install_fake_cuda(monkeypatch)
        from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

        return gpu, TorchCudaCopyEngine(t, **kw)
    gpu = install_fake_cupy(monkeypatch)
    from tiered_kv.transfer.cuda_engine import CupyCopyEngine

    if kernel_min_runs is not None:
        kw["kernel_min_runs"] = kernel_min_runs
    return gpu, CupyCopyEngine(t, **kw)


def swap_out(plan_id, src=(1,), dst=(1,), **kw):
    return TransferPlan(plan_id, "GPU", "CPU", tuple(src), tuple(dst), PlanKind.SWAP_OUT, **kw)


def swap_in(plan_id, src=(1,), dst=(1,), **kw):
    return TransferPlan(plan_id, "CPU", "GPU", tuple(src), tuple(dst), PlanKind.SWAP_IN, urgent=True, **kw)


def round_trip(eng, t):
    for gpu_ids, cpu_ids, back_ids in IDS:
        want = fill_random(t["GPU"], gpu_ids, seed=sum(gpu_ids))
        out = eng.submit(TransferPlan(1, "GPU", "CPU", tuple(gpu_ids), tuple(cpu_ids), PlanKind.SWAP_OUT))
        assert out.wait() and out.done()
        fill_random(t["GPU"], range(1, 16), seed=5)
        back = eng.submit(TransferPlan(2, "CPU", "GPU", tuple(cpu_ids), tuple(back_ids), PlanKind.SWAP_IN, urgent=True))
        assert back.wait()
        for g, b in zip(gpu_ids, back_ids, strict=True):
            assert torch.equal(t["GPU"].block(b), want[g])


def compute_waits_before_copies(gpu, stream):
    """Events the copy stream waited on before its first copy, each with the stream that recorded it."""
    waits = []
    for op, detail in gpu.ops_on(stream):
        if op in COPY_OPS:
            return waits
        if op == "wait":
            waits.append(detail)
    raise AssertionError(f"no copy was issued on {stream}: {gpu.ops_on(stream)}")


@pytest.mark.parametrize("copy_api", ["runtime", "torch"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_cuda_engine_logic(monkeypatch, layout, copy_api):
    t = tiers(layout)  # real CPU tensors, made before CUDA is faked
    gpu = install_fake_cuda(monkeypatch)
    from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

    eng = TorchCudaCopyEngine(t, max_blocks_per_chunk=2, record=True, copy_api=copy_api)
    assert eng.copy_api == copy_api
    round_trip(eng, t)
    ops = {op for s in gpu.streams.values() for op, _ in gpu.ops_on(s)}
    if copy_api == "runtime":  # one raw call per run: a 2-D copy for a layer-first run
        assert ("memcpy2d" in ops) == (layout == "layer_first") and ("memcpy" in ops) == (layout != "layer_first")
    else:
        assert not ops & {"memcpy", "memcpy2d"}
    # D2H waits on the compute stream's event; swap-ins use the urgent stream.
    d2h = eng.streams["d2h"]
    assert d2h.waited_on and all(isinstance(e, FakeEvent) for e in d2h.waited_on)
    assert {lane for _, lane, _, _ in eng.trace} == {"d2h", "h2d_urgent"}
    assert eng.streams["h2d_urgent"].priority < eng.streams["d2h"].priority
    # wait_for becomes a device-side stream wait on the earlier plan's event.
    first = eng.submit(TransferPlan(10, "GPU", "CPU", (1,), (1,), PlanKind.OFFLOAD))
    eng.submit(TransferPlan(11, "CPU", "GPU", (2,), (1,), PlanKind.SWAP_IN, urgent=True, wait_for=(10,)))
    assert first.event in eng.streams["h2d_urgent"].waited_on
    eng.make_compute_wait(first)
    assert eng.cancel(first) is False


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel_min_runs", [1, 1000])
def test_cupy_engine_pointer_arithmetic_is_byte_exact(monkeypatch, layout, kernel_min_runs):
    t = tiers(layout)  # real CPU tensors, made before CUDA is faked
    gpu = install_fake_cupy(monkeypatch)
    from tiered_kv.transfer.cuda_engine import CupyCopyEngine

    eng = CupyCopyEngine(t, kernel_min_runs=kernel_min_runs)
    round_trip(eng, t)
    if kernel_min_runs == 1:  # gather/scatter kernel: one thread block per segment
        assert gpu.launches and all(n % (2 * SPEC.num_layers) == 0 for n in gpu.launches)
    else:
        assert gpu.launches == []


@pytest.mark.parametrize(("kind", "kernel_min_runs"), DEVICE_ENGINES)
def test_gpu_to_cpu_plan_waits_for_the_compute_stream_before_any_copy(monkeypatch, kind, kernel_min_runs):
    """A swap-out must not read KV that a kernel on the compute stream is still writing."""
    t = tiers("layer_first")
    gpu, eng = fake_engine(monkeypatch, kind, t, kernel_min_runs)
    d2h = eng.streams["d2h"]

    eng.submit(swap_out(1, (3, 4, 9), (2, 3, 7)))  # default: the current stream computes
    waits = compute_waits_before_copies(gpu, d2h)
    assert [ev.recorded_on for ev in waits] == [gpu.null]
    assert gpu.log.index(("record", gpu.null, waits[0])) < gpu.log.index(("wait", d2h, waits[0]))

    gpu.log.clear()
    compute = torch.cuda.Stream()  # a caller computing on a stream of its own passes it
    eng.submit(swap_out(2, (5,), (5,)), compute_stream=compute)
    assert [ev.recorded_on for ev in compute_waits_before_copies(gpu, d2h)] == [compute]

    gpu.log.clear()
    eng.submit(swap_in(3, (5,), (6,)))  # a swap-in reads the CPU tier: no compute wait
    assert compute_waits_before_copies(gpu, eng.streams["h2d_urgent"]) == []


def test_cupy_swap_out_also_waits_for_torch_compute_on_its_own_stream(monkeypatch):
    """The KV tensors are torch's: torch's current stream is waited on as well as cupy's."""
    t = tiers("block_contiguous")
    gpu, eng = fake_engine(monkeypatch, "cupy", t)
    model_stream = torch.cuda.Stream()
    with torch.cuda.stream(model_stream):
        eng.submit(swap_out(1))
    recorded_on = {ev.recorded_on for ev in compute_waits_before_copies(gpu, eng.streams["d2h"])}
    assert recorded_on == {gpu.null, model_stream}


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_bad_compute_stream_is_refused_before_anything_is_issued(monkeypatch, kind):
    gpu, eng = fake_engine(monkeypatch, kind, tiers("block_contiguous"))
    gpu.log.clear()
    with pytest.raises(InvalidArgumentError, match="compute_stream must be a"):
        eng.submit(swap_out(1), compute_stream="stream 0")
    assert gpu.log == [] and eng.tracked_plans == 0


@pytest.mark.parametrize(("kind", "kernel_min_runs"), DEVICE_ENGINES)
def test_event_table_stays_bounded_over_thousands_of_plans(monkeypatch, kind, kernel_min_runs):
    t = tiers("block_contiguous")
    gpu, eng = fake_engine(monkeypatch, kind, t, kernel_min_runs)
    gpu.keep_log = False  # the fake holds no event: what stays alive, the engine keeps
    for pid in range(3 * DEFAULT_MAX_TRACKED):
        h = eng.submit(swap_out(pid) if pid % 2 else swap_in(pid))
        assert h.wait()
    del h
    assert gpu.live_events() <= DEFAULT_MAX_TRACKED
    assert eng.max_tracked_plans == DEFAULT_MAX_TRACKED and eng.tracked_plans <= DEFAULT_MAX_TRACKED


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_plans_in_flight_are_never_forgotten(monkeypatch, kind):
    """Past the bound, events of running plans stay: wait_for and duplicate-id checks still see them."""
    t = tiers("block_contiguous", 32, 32)
    gpu, eng = fake_engine(monkeypatch, kind, t, max_tracked_plans=4)
    gpu.hold()
    handles = [eng.submit(swap_out(pid, (pid,), (pid,))) for pid in range(1, 11)]
    assert eng.tracked_plans == 10 and not any(h.done() for h in handles)
    with pytest.raises(PlanError, match="plan 1 is already in flight"):
        eng.submit(swap_out(1, (20,), (20,)))
    eng.submit(swap_in(11, (1,), (21,), wait_for=(1,)))
    assert handles[0].event in eng.streams["h2d_urgent"].waited_on
    gpu.release()
    eng.submit(swap_out(1, (20,), (20,)))  # the id is free once its plan completed
    assert all(h.wait() for h in handles)
    # The next sweep (due once the table doubles) forgets all of them: back within the bound.
    for pid in range(12, 40):
        eng.submit(swap_out(pid, (pid % 30 + 1,), (pid % 30 + 1,)))
    assert eng.tracked_plans <= eng.max_tracked_plans == 4


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_max_tracked_plans_must_be_a_positive_int(monkeypatch, kind):
    with pytest.raises(InvalidArgumentError, match="max_tracked_plans must be an int > 0"):
        fake_engine(monkeypatch, kind, tiers("block_contiguous"), max_tracked_plans=0)


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_wait_with_a_timeout_returns_false_for_an_event_that_never_completes(monkeypatch, kind):
    t = tiers("block_contiguous")
    gpu, eng = fake_engine(monkeypatch, kind, t)
    gpu.hold()  # the device never finishes this plan while held
    h = eng.submit(swap_out(1))
    assert h.wait(0.01) is False and h.wait(0) is False
    assert not h.done() and h.status is TransferStatus.RUNNING
    with pytest.raises(TransferError, match=r"plan 1: not finished after 0\.01 s"):
        h.result(0.01)
    with pytest.raises(InvalidArgumentError, match="timeout must be None or a number"):
        h.wait(-1)
    gpu.release()
    assert h.wait(0.01) and h.done() and h.status is TransferStatus.DONE
    assert h.elapsed_s == gpu.elapsed_ms / 1000  # device time between the plan's two events
    h.result(0)


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
@pytest.mark.parametrize("how", ["done", "wait", "wait_timeout"])
def test_a_device_error_fails_the_plan(monkeypatch, kind, how):
    gpu, eng = fake_engine(monkeypatch, kind, tiers("block_contiguous"))
    gpu.hold()
    h = eng.submit(swap_out(1))
    gpu.fail_with(RuntimeError("CUDA error: an illegal memory access was encountered"))
    {"done": h.done, "wait": h.wait, "wait_timeout": lambda: h.wait(1.0)}[how]()
    assert h.done() and h.status is TransferStatus.FAILED and not h.wait()
    with pytest.raises(TransferError, match="plan 1 failed: plan 1: CUDA error: an illegal memory access"):
        h.result()


def test_cupy_make_compute_wait_orders_compute_after_a_swap_in(monkeypatch):
    t = tiers("block_contiguous")
    gpu, eng = fake_engine(monkeypatch, "cupy", t)
    h = eng.submit(swap_in(1))
    eng.make_compute_wait(h)  # default: the current stream (cupy's and torch's are both the null stream)
    assert gpu.null.waited_on == [h.event]
    model_stream = torch.cuda.Stream()
    eng.make_compute_wait(h, stream=model_stream)
    assert model_stream.waited_on == [h.event]
    with torch.cuda.stream(model_stream):
        eng.make_compute_wait(h)
    assert gpu.null.waited_on == [h.event] * 2 and model_stream.waited_on == [h.event] * 2


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_make_compute_wait_refuses_what_has_no_event(monkeypatch, kind):
    t = tiers("block_contiguous")
    _, eng = fake_engine(monkeypatch, kind, t)
    with CpuCopyEngine(t) as cpu:
        cpu_handle = cpu.submit(swap_in(1))
        cpu_handle.wait(10)
    with pytest.raises(PlanError, match="make_compute_wait\\(\\) takes a handle from a CUDA copy engine"):
        eng.make_compute_wait(cpu_handle)
    with pytest.raises(InvalidArgumentError, match="stream must be a"):
        eng.make_compute_wait(eng.submit(swap_in(2)), stream=3)


def test_run_byte_ranges():
    t = tiers("block_contiguous")
    b = SPEC.bytes_per_block
    assert run_byte_ranges(t["GPU"], t["CPU"], CopyRun(3, 7, 2)) == [(3 * b, 7 * b, 2 * b)]
    lf = tiers("layer_first", 16, 8)
    ranges = run_byte_ranges(lf["GPU"], lf["CPU"], CopyRun(3, 5, 2))
    seg = SPEC.segment_bytes
    assert len(ranges) == 2 * SPEC.num_layers
    assert ranges[1] == ((16 + 3) * seg, (8 + 5) * seg, 2 * seg)  # layer 0 V


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("kind", "copy_api"), [("cuda", "runtime"), ("cuda", "torch"), ("cupy", None)])
def test_layer_wise_swap_in_is_byte_exact_with_an_event_per_layer(monkeypatch, layout, kind, copy_api):
    """Each layer's copies are issued, then its event; compute can wait on one layer on the device."""
    t = tiers(layout)
    kw = {"copy_api": copy_api} if copy_api else {}
    gpu, eng = fake_engine(monkeypatch, kind, t, **kw)
    for _gpu_ids, cpu_ids, back_ids in IDS:
        want = fill_random(t["CPU"], cpu_ids, seed=sum(cpu_ids))
        h = eng.submit(swap_in(3, cpu_ids, back_ids, num_layers=SPEC.num_layers))
        assert h.wait()
        for c, b in zip(cpu_ids, back_ids, strict=True):
            assert torch.equal(t["GPU"].block(b), want[c])
    events = [h.layer_event(i) for i in range(SPEC.num_layers)]
    assert len(set(map(id, events))) == SPEC.num_layers and all(h.layer_done(i) for i in range(SPEC.num_layers))
    stream = eng.streams["h2d_urgent"]
    ops = [op for op, _ in gpu.ops_on(stream)]
    records = [i for i, op in enumerate(ops) if op == "record"]
    assert len(records) >= SPEC.num_layers + 2  # start, a record after each layer, end
    compute = gpu.torch_current
    eng.make_compute_wait(h, layer=0)
    assert compute.waited_on[-1] is events[0]  # only layer 0: the device overlaps the rest


@pytest.mark.parametrize("num_layers", [0, SPEC.num_layers])
@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_a_plan_failing_after_some_copies_were_issued_fails_only_once_they_have_ended(monkeypatch, kind, num_layers):
    """Copies already on the stream still write the destination: its blocks must not be reused before they end."""
    t = tiers("block_contiguous")
    gpu, eng = fake_engine(monkeypatch, kind, t)
    issued = []

    def second_run_fails(plan, run):
        issued.append(run)
        if len(issued) == 2:
            raise RuntimeError("injected fault on the second run")

    eng.copy_hook = second_run_fails
    gpu.hold()  # the run issued first is still being copied
    h = eng.submit(swap_in(1, (2, 5), (3, 9), num_layers=num_layers))  # two runs: (2->3) and (5->9)
    assert len(issued) == 2
    assert not h.done() and h.status is TransferStatus.RUNNING and h.error is None
    if num_layers:
        assert not h.layer_done(1)
    gpu.release()
    assert h.done() and h.status is TransferStatus.FAILED and not h.wait()
    assert "injected fault on the second run" in str(h.error)
    if num_layers:
        assert not h.wait_layer(num_layers - 1)


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_a_gated_store_issues_each_layer_only_when_compute_opens_it(monkeypatch, kind):
    """A prefill's layer is copied after the kernels that wrote it; nothing is issued before it is opened."""
    t = tiers("layer_first")
    want = fill_random(t["GPU"], [3, 4], seed=11)
    gpu, eng = fake_engine(monkeypatch, kind, t)
    d2h = eng.streams["d2h"]
    plan = TransferPlan(1, "GPU", "CPU", (3, 4), (2, 5), PlanKind.OFFLOAD, num_layers=SPEC.num_layers, gated=True)
    h = eng.submit(plan)
    assert not [op for op, _ in gpu.ops_on(d2h) if op in COPY_OPS] and not h.done()
    with pytest.raises(PlanError, match="the next is 0, not 1"):
        eng.open_layer(h, 1)
    for layer in range(SPEC.num_layers):
        gpu.log.clear()
        eng.open_layer(h, layer)
        waits = compute_waits_before_copies(gpu, d2h)
        assert [ev.recorded_on for ev in waits] == [gpu.null]  # ordered after the compute stream, on the device
        assert h.done() == (layer == SPEC.num_layers - 1)  # an ordinary event handle once the last is issued
    assert h.wait() and h.num_opened == SPEC.num_layers
    for g, c in ((3, 2), (4, 5)):
        assert torch.equal(t["CPU"].block(c), want[g])
    with pytest.raises(PlanError, match="not gated"):
        eng.open_layer(eng.submit(swap_out(2, (6,), (6,))), 0)


@pytest.mark.parametrize("kind", ["cuda", "cupy"])
def test_a_gated_store_never_opened_is_cancelled_or_ended_at_close(monkeypatch, kind):
    t = tiers("block_contiguous")
    _gpu, eng = fake_engine(monkeypatch, kind, t)
    gated = {"num_layers": SPEC.num_layers, "gated": True}
    a = eng.submit(TransferPlan(1, "GPU", "CPU", (3,), (2,), PlanKind.OFFLOAD, **gated))
    b = eng.submit(TransferPlan(2, "GPU", "CPU", (4,), (5,), PlanKind.OFFLOAD, **gated))
    c = eng.submit(TransferPlan(3, "GPU", "CPU", (6,), (7,), PlanKind.OFFLOAD, **gated))
    with pytest.raises(PlanError, match="already in flight"):
        eng.submit(TransferPlan(1, "GPU", "CPU", (8,), (8,), PlanKind.OFFLOAD, **gated))
    assert eng.cancel(a) and a.status is TransferStatus.CANCELLED
    eng.open_layer(b, 0)
    assert eng.cancel(b) is False  # a layer is on the stream: it cannot be recalled
    eng.close()
    assert c.status is TransferStatus.CANCELLED
    assert b.done() and b.status is TransferStatus.FAILED and "closed before every layer" in str(b.error)
