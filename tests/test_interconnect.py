"""Each GPU profile names its interconnect, and every tensor-parallel model on that GPU pays its all-reduce."""

import pytest

from tiered_kv.sim.compute import ComputeModel
from tiered_kv.sim.profiles import load_hardware, load_model, model_profile_raw
from tiered_kv.sim.shipped import shipped_names


@pytest.mark.parametrize(
    ("name", "kind"),
    [("h100-sxm", "nvlink"), ("h200", "nvlink"), ("a100-80gb-sxm", "nvlink"), ("a100-sxm4-40gb", "nvlink"),
     ("a100-80gb-pcie", "pcie"), ("l40s", "pcie")],
)  # fmt: skip
def test_every_shipped_gpu_names_its_interconnect(name, kind):
    ar = load_hardware(name).allreduce
    assert ar is not None and ar.interconnect == kind
    assert set(shipped_names("hardware")) == {
        "h100-sxm", "h200", "a100-80gb-sxm", "a100-sxm4-40gb", "a100-80gb-pcie", "l40s"
    }  # fmt: skip


def _tp2(model):
    raw = model_profile_raw(model)
    raw["tensor_parallel"] = 2
    return load_model(raw)


def test_pcie_gpus_pay_a_pcie_all_reduce_not_nvlinks():
    # Llama-3.1-8B at TP2, a decode step of 32 requests: 64 all-reduces of 32 x 4096 x 2 = 256 KiB.
    m = _tp2("llama3.1-8b")
    nbytes = 32 * m.allreduce_bytes_per_token
    h100, l40s, a100p = (load_hardware(n).allreduce for n in ("h100-sxm", "l40s", "a100-80gb-pcie"))
    assert h100 is not None and l40s is not None and a100p is not None
    # NVLink4: 9.8 us + 256 KiB at 33.7 GB/s; PCIe without peer-to-peer (L40S): 42.1 us + 256 KiB at 24 GB/s
    assert h100.seconds(nbytes, 2) == pytest.approx(9.8e-6 + nbytes / 33.7e9)
    assert l40s.seconds(nbytes, 2) == pytest.approx(42.1e-6 + nbytes / 24e9)
    assert a100p.seconds(nbytes, 2) == pytest.approx(12.0e-6 + nbytes / 24e9)
    assert l40s.seconds(nbytes, 2) > 2.5 * h100.seconds(nbytes, 2)
    # a large prefill's all-reduce (2,048 tokens, 16 MiB): the ring at PCIe's 24 GB/s, not NVLink's 370
    big = 2048 * m.allreduce_bytes_per_token
    assert l40s.seconds(big, 2) / h100.seconds(big, 2) > 8


def test_every_tp_model_on_the_gpu_pays_it_in_its_step():
    m = _tp2("llama3.1-8b")
    steps = {}
    for name in ("h100-sxm", "l40s"):
        hw = load_hardware(name)
        cm = ComputeModel(hw, m, mfu=0.5, hbm_efficiency=1.0, step_overhead_s=0.0)
        steps[name] = cm.allreduce_time(32)
        ar = hw.allreduce
        assert ar is not None
        assert steps[name] == pytest.approx(2 * 32 * ar.seconds(32 * 4096 * 2, 2))
    assert steps["l40s"] > 2.5 * steps["h100-sxm"]
