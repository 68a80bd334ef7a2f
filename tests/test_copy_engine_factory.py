"""make_copy_engine: which engine each kind gives, and the clear error when it cannot run here."""

import subprocess
import sys
import textwrap

import pytest
import torch
from engineutil import HAS_CUDA, tiers
from fakecuda import install_fake_cuda, install_fake_cupy

from tiered_kv.errors import ConfigError, InvalidArgumentError, TieredKVError, TransferError
from tiered_kv.transfer import EngineUnavailableError, PlanKind, TransferPlan, available_kinds, make_copy_engine
from tiered_kv.transfer.cpu_engine import CpuCopyEngine


def no_cuda(monkeypatch):
    """This machine as one without CUDA or cupy, whatever it really has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError


def on_fake_device(t):
    """Tiers whose GPU tier the fake device holds (its memory is host memory, so only the label changes)."""
    t["GPU"].device = torch.device("cuda", 0)
    return t


def test_without_cuda_auto_and_cpu_give_the_cpu_engine_and_device_kinds_raise(monkeypatch):
    t = tiers("block_contiguous")
    no_cuda(monkeypatch)
    for kind in ("auto", "cpu"):
        eng = make_copy_engine(t, kind)
        assert type(eng) is CpuCopyEngine
        h = eng.submit(TransferPlan(1, "GPU", "CPU", (1,), (1,), PlanKind.SWAP_OUT))
        assert h.wait(10)
        eng.close()
    with pytest.raises(EngineUnavailableError, match=r"TorchCudaCopyEngine cannot run here: torch .* sees no CUDA"):
        make_copy_engine(t, "cuda")
    with pytest.raises(EngineUnavailableError, match="CupyCopyEngine cannot run here: cupy is not importable"):
        make_copy_engine(t, "cupy")
    assert available_kinds() == ["cpu"]


@pytest.mark.skipif(HAS_CUDA, reason="checks the real probes of a machine without CUDA")
def test_this_machine_without_cuda_refuses_device_engines_by_name():
    t = tiers("block_contiguous")
    for kind in ("cuda", "cupy"):
        with pytest.raises(EngineUnavailableError) as info:
            make_copy_engine(t, kind)
        assert isinstance(info.value, TieredKVError) and isinstance(info.value, TransferError)
    assert available_kinds() == ["cpu"]
    assert type(make_copy_engine(t)) is CpuCopyEngine


def test_bench_transfer_never_reports_cpu_copies_under_a_gpu_engine_name(monkeypatch):
    t = tiers("block_contiguous")
    no_cuda(monkeypatch)
    with pytest.raises(EngineUnavailableError, match="TorchCudaCopyEngine cannot run here"):
        make_copy_engine(t, "cuda")
    with pytest.raises(InvalidArgumentError, match=r"kind must be one of \['auto', 'cpu', 'cuda', 'cupy'\]"):
        make_copy_engine(t, "gpu")


def test_with_cuda_auto_gives_the_torch_engine_and_cupy_only_by_name(monkeypatch):
    t = on_fake_device(tiers("block_contiguous"))
    install_fake_cupy(monkeypatch)
    from tiered_kv.transfer.cuda_engine import CupyCopyEngine, TorchCudaCopyEngine

    assert available_kinds() == ["cpu", "cuda", "cupy"]
    assert type(make_copy_engine(t)) is TorchCudaCopyEngine
    assert type(make_copy_engine(t, "cuda")) is TorchCudaCopyEngine
    assert type(make_copy_engine(t, "cupy")) is CupyCopyEngine
    assert type(make_copy_engine(t, "cpu")) is CpuCopyEngine


def test_gpu_tier_in_host_memory_gets_the_cpu_engine_or_a_clear_error(monkeypatch):
    t = tiers("block_contiguous")  # a CPU-device engine run on a CUDA machine
    install_fake_cupy(monkeypatch)
    assert type(make_copy_engine(t)) is CpuCopyEngine
    for kind, name in (("cuda", "TorchCudaCopyEngine"), ("cupy", "CupyCopyEngine")):
        with pytest.raises(ConfigError, match=f"{name} copies device memory, but the GPU tier is on cpu"):
            make_copy_engine(t, kind)
    with pytest.raises(ConfigError, match="the GPU tier is missing"):
        make_copy_engine({"CPU": t["CPU"]}, "cuda")


def test_cupy_needs_a_device_and_torch_cuda(monkeypatch):
    t = on_fake_device(tiers("block_contiguous"))
    install_fake_cupy(monkeypatch)
    cupy = sys.modules["cupy"]

    def no_driver():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    with pytest.raises(EngineUnavailableError, match=r"cupy sees no CUDA device \(cudaErrorNoDevice"):
        make_copy_engine(t, "cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailableError, match=r"CupyCopyEngine cannot run here: torch .* sees no CUDA"):
        make_copy_engine(t, "cupy")


@pytest.mark.parametrize("kind", ["gpu", "CUDA", "", None, 1, True])
def test_unknown_kinds_are_refused(kind):
    with pytest.raises(InvalidArgumentError, match="kind must be one of"):
        make_copy_engine(tiers("block_contiguous"), kind)


def test_options_reach_the_engine_and_foreign_options_are_refused(monkeypatch):
    t = tiers("block_contiguous")
    eng = make_copy_engine(t, "cpu", max_blocks_per_chunk=3, record=True)
    assert eng.max_blocks_per_chunk == 3 and eng.trace == []
    eng.close()
    with pytest.raises(InvalidArgumentError, match=r"CpuCopyEngine does not take these options \['kernel_min_runs'\]"):
        make_copy_engine(t, "cpu", kernel_min_runs=4)
    install_fake_cuda(monkeypatch)
    on_fake_device(t)
    assert make_copy_engine(t, "cuda", max_tracked_plans=16).max_tracked_plans == 16
    with pytest.raises(InvalidArgumentError, match="TorchCudaCopyEngine does not take these options"):
        make_copy_engine(t, "cuda", copy_hook=print)
    with pytest.raises(InvalidArgumentError, match="tiers must be a Mapping"):
        make_copy_engine([t["GPU"], t["CPU"]], "cpu")


def test_importing_the_transfer_package_and_its_factory_imports_neither_torch_nor_cupy():
    """The transfer package and the factory are standard library only until an engine is built."""
    code = textwrap.dedent(
        """
        import sys
        import tiered_kv.transfer
        from tiered_kv.transfer import EngineUnavailableError, make_copy_engine
        from tiered_kv.transfer import event_handle, factory
        assert not {"torch", "cupy", "numpy"} & set(sys.modules), sorted(sys.modules)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_on_a_cuda_machine_auto_gives_the_torch_engine():
    from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

    t = tiers("block_contiguous")
    assert t["GPU"].device.type == "cuda"
    assert type(make_copy_engine(t)) is TorchCudaCopyEngine
    assert "cuda" in available_kinds()
