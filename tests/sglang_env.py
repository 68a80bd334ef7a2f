"""What the SGLang integration tests need: SGLang 0.5.23 installed, its storage config, and a host pool.

The integration tests run in their own environment (``bash scripts/setup-venv.sh sglang``
makes ``.venv-sglang``; ``.ci/run`` runs them there).  In the default environment
SGLang is absent and they skip with that reason, unless ``TIERED_KV_REQUIRE_SGLANG``
is set (``.ci/run`` sets it), where a missing SGLang fails instead.

SGLang's real host memory pools (``sglang.srt.mem_cache.pool_host``) import its model
configs, which need transformers and a torchvision built for the installed torch, so
they cannot be built on the pinned CPU wheel; :class:`HostPoolDouble` stands in for
them.  It follows the contract SGLang's ``MHATokenToKVPoolHost`` and
``MLATokenToKVPoolHost`` (0.5.23) keep for storage backends: a ``kv_buffer`` in the
pool's layout, ``page_size`` token slots per page, and ``get_data_page`` /
``get_dummy_flat_data_page`` / ``set_from_flat_data_page`` slicing and reshaping it as
those classes do for the ``layer_first`` and ``page_first`` layouts.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

import pytest
import torch

SGLANG_VERSION = "0.5.23"


def sglang_problem() -> str | None:
    """Why SGLang 0.5.23's storage interface cannot be used here, or ``None`` when it imports."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return f"SGLang {SGLANG_VERSION} is not installed"
    if version != SGLANG_VERSION:
        return f"SGLang {version} is installed, the tests are for {SGLANG_VERSION}"
    try:
        import sglang.srt.mem_cache.hicache_storage
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except ImportError as exc:
        return f"SGLang {SGLANG_VERSION}'s storage interface does not import ({exc})"
    return None


PROBLEM = sglang_problem()


def sglang_mark() -> pytest.MarkDecorator:
    """The calling module's ``pytestmark``: skip its tests, naming why, unless SGLang 0.5.23 imports.

    Where ``TIERED_KV_REQUIRE_SGLANG`` is set (``.ci/run`` sets it) a missing SGLang fails instead.
    """
    if PROBLEM is not None and os.environ.get("TIERED_KV_REQUIRE_SGLANG"):
        pytest.fail(f"TIERED_KV_REQUIRE_SGLANG is set but {PROBLEM}", pytrace=False)
    return pytest.mark.skipif(
        PROBLEM is not None,
        reason=f"{PROBLEM}: the SGLang integration tests run in .venv-sglang "
        "(bash scripts/setup-venv.sh sglang; .ci/run runs them)",
    )


def storage_config(extra_config: dict[str, Any] | None, **overrides: Any) -> Any:
    """SGLang's ``HiCacheStorageConfig`` for one rank of a tensor-parallel group of one (overridable)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "meta-llama/Llama-3.1-8B-Instruct",
        "extra_config": extra_config,
    }
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


class HostPoolDouble:
    """A host KV pool with SGLang's page accessors, for an MHA model (K and V) or an MLA one (one latent).

    Shapes as SGLang 0.5.23 allocates them (``size`` token slots):

    * MHA ``layer_first``: ``(2, layers, size, heads, head_dim)``;
      ``page_first``: ``(2, size, layers, heads, head_dim)``.
    * MLA ``layer_first``: ``(layers, size, 1, dim)``; ``page_first``: ``(size, layers, 1, dim)``.

    A page is ``page_size`` consecutive slots; its flat form is the slice flattened.
    """

    def __init__(
        self,
        kind: str = "mha",
        layout: str = "layer_first",
        dtype: torch.dtype = torch.bfloat16,
        layers: int = 2,
        heads: int = 2,
        head_dim: int = 16,
        page_size: int = 16,
        num_pages: int = 8,
    ) -> None:
        assert kind in ("mha", "mla") and layout in ("layer_first", "page_first")
        self.kind, self.layout, self.dtype, self.page_size = kind, layout, dtype, page_size
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.size = page_size * num_pages
        first = layout == "layer_first"
        if kind == "mha":
            dims = (2, layers, self.size, heads, head_dim) if first else (2, self.size, layers, heads, head_dim)
            ps = page_size
            self.page_dims = (2, layers, ps, heads, head_dim) if first else (2, ps, layers, heads, head_dim)
        else:
            dims = (layers, self.size, 1, head_dim) if first else (self.size, layers, 1, head_dim)
            self.page_dims = (layers, page_size, 1, head_dim) if first else (page_size, layers, 1, head_dim)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def _page(self, index: int) -> torch.Tensor:
        s = slice(index, index + self.page_size)
        if self.kind == "mha":
            return self.kv_buffer[:, :, s] if self.layout == "layer_first" else self.kv_buffer[:, s]
        return self.kv_buffer[:, s] if self.layout == "layer_first" else self.kv_buffer[s]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_dims, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._page(int(index))[...] = data_page.reshape(self._page(int(index)).shape)

    # --- for the tests
    def fill(self, seed: int) -> None:
        """Random bytes in every slot (any dtype: the bytes are drawn, not the values)."""
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(
            0, 256, (self.kv_buffer.numel() * self.kv_buffer.element_size(),), generator=g, dtype=torch.uint8
        )
        self.kv_buffer.view(torch.uint8).view(-1).copy_(raw)

    def page_bytes_at(self, index: int) -> bytes:
        return bytes(self.get_data_page(index).contiguous().view(torch.uint8).numpy())

    def slots(self, *pages: int) -> torch.Tensor:
        """``host_indices`` of the given page numbers, as SGLang's controller passes them."""
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
