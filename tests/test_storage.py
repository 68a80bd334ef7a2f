"""KV storage: geometry, zero-copy per-layer views in both layouts, offsets, memory errors."""

import pytest
import torch

from tiered_kv.errors import ConfigError, StorageError
from tiered_kv.storage import LLAMA3_8B, KVSpec, segment_offsets
from tiered_kv.storage.kv_storage import KVStorage

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4)


def test_llama3_8b_bytes():
    assert LLAMA3_8B.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert LLAMA3_8B.bytes_per_block == 16 * 131072
    assert LLAMA3_8B.with_block_size(128).bytes_per_block == 16 * 2**20


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
def test_layer_views_are_zero_copy_and_shaped_for_attention(layout):
    st = KVStorage(SPEC, 6, "GPU", layout, device="cpu")
    st.kv.zero_()
    k, v = st.layer_kv(1)
    assert k.shape == v.shape == (6, 4, 2, 8)
    assert k.untyped_storage().data_ptr() == st.kv.untyped_storage().data_ptr()
    k[3, 2, 1, 5] = 7.0
    v[3, 0, 0, 0] = -1.0
    blk = st.block(3)  # [layers, 2, block_size, heads, dim]
    assert blk[1, 0, 2, 1, 5] == 7.0 and blk[1, 1, 0, 0, 0] == -1.0
    assert int((st.kv != 0).sum()) == 2


@pytest.mark.parametrize("layout", ["block_contiguous", "layer_first"])
def test_segment_offsets_match_the_tensor_layout(layout):
    st = KVStorage(SPEC, 5, "CPU", layout, device="cpu", pin=False)
    base = st.kv.data_ptr()
    offs = segment_offsets(SPEC, layout, 5, 3)
    assert len(offs) == 2 * SPEC.num_layers
    for i, off in enumerate(offs):
        layer, kv = divmod(i, 2)
        view = st.layer_kv(layer)[kv][3]
        assert view.data_ptr() - base == off
        assert view.is_contiguous() and view.numel() * view.element_size() == SPEC.segment_bytes
    if layout == "block_contiguous":
        assert st.run_view(2, 3).is_contiguous() and len(st.run_segments(2, 3)) == 1
    else:
        assert len(st.run_segments(2, 3)) == 2 * SPEC.num_layers
        assert all(s.is_contiguous() for s in st.run_segments(2, 3))


def test_a_tier_that_does_not_fit_is_refused_before_allocating():
    with pytest.raises(StorageError, match=r"needs [\d.]+ GiB but only [\d.]+ GiB is free on cpu"):
        KVStorage(LLAMA3_8B, 10_000_000, "CPU", device="cpu", pin=False)


def test_bad_storage_arguments():
    with pytest.raises(StorageError, match="layout must be one of"):
        KVStorage(SPEC, 4, layout="paged")
    with pytest.raises(StorageError, match="num_blocks must be an int >= 2"):
        KVStorage(SPEC, 1)
    with pytest.raises(ConfigError, match=r"KVSpec\.head_dim must be a positive int"):
        KVSpec(2, 2, 0)
    with pytest.raises(ConfigError, match=r"KVSpec\.dtype"):
        KVSpec(2, 2, 8, dtype="float64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error path")
def test_pinning_without_cuda_fails_loudly():
    with pytest.raises(StorageError, match="cannot pin the CPU tier: CUDA is not available"):
        KVStorage(SPEC, 4, "CPU", device="cpu", pin=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tier_on_device_and_cpu_tier_pinned():
    gpu = KVStorage(SPEC, 8, "GPU")
    cpu = KVStorage(SPEC, 8, "CPU")
    assert gpu.kv.is_cuda and cpu.pinned and cpu.kv.is_pinned()
    cpu.close()
    assert not cpu.pinned
