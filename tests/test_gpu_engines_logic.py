"""The CUDA and cupy engines' own code, run on the CPU through stand-ins of their APIs."""

import pytest
import torch
from engineutil import SPEC, fill_random, tiers
from fakecuda import FakeEvent, install_fake_cuda, install_fake_cupy

from tiered_kv.transfer import CopyRun, PlanKind, TransferPlan
from tiered_kv.transfer.cupy_engine import run_byte_ranges

LAYOUTS = ["block_contiguous", "layer_first"]
IDS = [([3, 4, 5, 6], [2, 3, 4, 5], [9, 10, 11, 12]), ([7, 2, 13, 5], [11, 3, 8, 1], [4, 15, 6, 10])]


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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_cuda_engine_logic(monkeypatch, layout):
    t = tiers(layout)  # real CPU tensors, made before CUDA is faked
    install_fake_cuda(monkeypatch)
    from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

    eng = TorchCudaCopyEngine(t, max_blocks_per_chunk=2, record=True)
    round_trip(eng, t)
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
    cupy = install_fake_cupy(monkeypatch)
    from tiered_kv.transfer.cupy_engine import CupyCopyEngine

    t = tiers(layout)
    eng = CupyCopyEngine(t, kernel_min_runs=kernel_min_runs)
    round_trip(eng, t)
    if kernel_min_runs == 1:  # gather/scatter kernel: one thread block per segment
        assert cupy.launches and all(n % (2 * SPEC.num_layers) == 0 for n in cupy.launches)
    else:
        assert cupy.launches == []


def test_run_byte_ranges():
    t = tiers("block_contiguous")
    b = SPEC.bytes_per_block
    assert run_byte_ranges(t["GPU"], t["CPU"], CopyRun(3, 7, 2)) == [(3 * b, 7 * b, 2 * b)]
    lf = tiers("layer_first", 16, 8)
    ranges = run_byte_ranges(lf["GPU"], lf["CPU"], CopyRun(3, 5, 2))
    seg = SPEC.segment_bytes
    assert len(ranges) == 2 * SPEC.num_layers
    assert ranges[1] == ((16 + 3) * seg, (8 + 5) * seg, 2 * seg)  # layer 0 V
