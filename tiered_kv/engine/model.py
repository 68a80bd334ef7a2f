"""A small Llama-style decoder whose attention reads and writes KV only through block tables.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP,
with seeded random weights (nothing is downloaded).  The KV cache is the
storage layer's tensor: for every layer, ``KVStorage.layer_kv(layer)`` gives
``[num_blocks, block_size, kv_heads, head_dim]`` views in either layout; new K/V
are scattered into the request's blocks at ``(table[p // bs], p % bs)`` and the
context is gathered back through the same table.

Every sequence is computed on its own (no cross-request matmuls), so a
request's numbers never depend on what else is in the batch.  Only how a
request's own tokens are chunked changes the floating-point grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tiered_kv.storage.kv_storage import TORCH_DTYPES, KVStorage
from tiered_kv.storage.spec import KVSpec


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (grouped-query attention)")

    def kv_spec(self, block_size: int) -> KVSpec:
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, block_size)

    @property
    def num_params(self) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        attn = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        return 2 * self.vocab_size * h + L * (attn + 3 * h * i + 2 * h) + h


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A list of ints as a device tensor, without a host wait on CUDA.

    ``torch.tensor(list, device="cuda")`` copies from pageable memory and makes
    the host wait for the stream; staging through pinned memory lets the copy
    queue behind the compute already issued (a layer-wise load keeps streaming).
    """
    t = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim by position-dependent angles."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [n, d/2]
    cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Layer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.wq = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.w_gate = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.w_up = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.w_down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        ctx_len: int,
    ) -> torch.Tensor:
        c = self.c
        n = x.shape[0]
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(n, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rope(self.wk(h).view(n, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.wv(h).view(n, c.num_kv_heads, c.head_dim)
        # Write the new K/V into the request's blocks, then read the whole context back through its table.
        k_cache[slot_blocks, slot_offsets] = k
        v_cache[slot_blocks, slot_offsets] = v
        keys = k_cache[table].reshape(-1, c.num_kv_heads, c.head_dim)[:ctx_len]
        vals = v_cache[table].reshape(-1, c.num_kv_heads, c.head_dim)[:ctx_len]
        group = c.num_heads // c.num_kv_heads
        keys = keys.repeat_interleave(group, dim=1)  # [ctx, heads, d]
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q, keys) / (c.head_dim**0.5)
        causal = positions[:, None] >= torch.arange(ctx_len, device=x.device)[None, :]  # [n, ctx]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        attn = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vals).reshape(n, -1)
        x = x + self.wo(attn)
        h = self.mlp_norm(x)
        return x + self.w_down(nn.functional.silu(self.w_gate(h)) * self.w_up(h))


class TinyLlama(nn.Module):
    """The decoder.  ``forward_chunk`` computes a chunk of one request and returns its logits."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[1] ** 0.5))
            self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=g))
        self.to(device=device, dtype=TORCH_DTYPES[config.dtype])
        self.device = torch.device(device)

    @torch.no_grad()
    def forward_chunk(
        self,
        token_ids: list[int],
        start: int,
        block_table: list[int],
        kv: KVStorage,
        before_layer: Callable[[int], bool] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        """Compute tokens ``[start, start + len(token_ids))`` of one request.

        Args:
            token_ids: The chunk's tokens.
            start: Tokens already in the cache (their KV is read, not recomputed).
            block_table: The request's GPU block ids, covering ``start + len(token_ids)`` tokens.
            kv: The GPU tier.
            before_layer: Called with ``i`` before layer ``i`` touches its KV
                (a layer-wise load: wait for that layer).  If it returns False
                the KV will never arrive: the pass stops and returns ``None``.
            after_layer: Called with ``i`` once layer ``i`` has written its KV
                (a layer-wise store may copy that layer now).

        Returns:
            Logits ``[len(token_ids), vocab]`` (float32), or ``None`` (see ``before_layer``).
        """
        dev = self.device
        n = len(token_ids)
        bs = kv.spec.block_size
        positions = torch.arange(start, start + n, device=dev)
        table = _on_device(block_table, dev)
        slot_blocks = table[positions // bs]
        slot_offsets = positions % bs
        x = self.embed(_on_device(token_ids, dev))
        for i, layer in enumerate(self.layers):
            if before_layer is not None and not before_layer(i):
                return None
            k_cache, v_cache = kv.layer_kv(i)
            x = layer(x, positions, k_cache, v_cache, table, slot_blocks, slot_offsets, start + n)
            if after_layer is not None:
                after_layer(i)
        return self.lm_head(self.norm(x)).float()
