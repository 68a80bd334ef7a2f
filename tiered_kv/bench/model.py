"""A Llama-shaped decoder at any size, with random weights drawn on the device, for timing.

The engine's :class:`~tiered_kv.engine.model.TinyLlama` proves exactness on a
small model; its attention materialises every score, so it cannot prefill
32k tokens of an 8B model.  This model exists to *time* real shapes:

* weights are drawn directly on the device in the model's dtype (an 8B model
  in bf16 is 16 GB, drawn in about a second on a GPU; nothing is downloaded);
* attention is ``scaled_dot_product_attention`` (flash attention on a GPU),
  the new K/V are written into the paged cache through the block table, and a
  chunk after cached context reads the context back through the same table;
* index tensors are built by :meth:`RandomLlama.prepare` *before* a measured
  region, because building a device tensor from a Python list is a host
  synchronisation;
* ``before_layer(i)`` runs before layer ``i`` reads the cache, which is where a
  layer-wise swap-in makes the compute stream wait for layer ``i``'s copy.

Logits are computed for the last token only, as a serving engine does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tiered_kv.storage.kv_storage import TORCH_DTYPES, KVStorage
from tiered_kv.storage.spec import KVSpec


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The dimensions of a Llama-style decoder (everything a forward pass's cost depends on)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    dtype: str = "bfloat16"
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads must be a multiple of num_kv_heads")

    @property
    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        return 2 * self.vocab_size * h + self.num_layers * (attn + 3 * h * i + 2 * h) + h

    def kv_spec(self, block_size: int) -> KVSpec:
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, block_size)

    def with_layers(self, num_layers: int) -> LlamaShape:
        return dataclasses.replace(self, num_layers=num_layers, name=f"{self.name}, {num_layers} layers")

    def to_dict(self) -> dict[str, Any]:
        """The calibration file's ``model`` entry (the keys ``tiered_kv.sim.calibration`` checks, and more)."""
        return {**dataclasses.asdict(self), "num_params": self.num_params}


# meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, 32 heads, 8 KV heads (head dim 128),
# intermediate 14336, vocab 128256, rope_theta 500000, rms_norm_eps 1e-5.  8.03e9 parameters.
LLAMA3_8B_SHAPE = LlamaShape("Llama-3-8B", 128256, 4096, 32, 32, 8, 128, 14336)
# The CPU form of gpu-check: the same code on a model small enough for seconds on two cores.
SMALL_SHAPE = LlamaShape("small", 512, 128, 2, 4, 2, 32, 256, "float32", 10000.0, 1e-6)


@dataclass(frozen=True, slots=True)
class Batch:
    """Device tensors for one forward call, built before the measured region."""

    tokens: torch.Tensor  # [B, n]
    positions: torch.Tensor  # [n]
    slot_blocks: torch.Tensor  # [B, n]
    slot_offsets: torch.Tensor  # [n]
    tables: torch.Tensor  # [B, blocks]
    start: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None  # [n, start + n] when a chunk of several tokens follows cached context


class RandomLlama:
    """Seeded random weights on ``device``; see the module docstring.

    Args:
        shape: The model's dimensions.
        device: Where the weights live and compute runs.
        seed: Seed of the device generator.
    """

    def __init__(self, shape: LlamaShape, device: str | torch.device, seed: int = 0) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[shape.dtype]
        g = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.randn(rows, cols, generator=g, device=self.device, dtype=self.dtype)
            return t.mul_(1.0 / math.sqrt(rows))

        self.embed = torch.randn(s.vocab_size, s.hidden_size, generator=g, device=self.device, dtype=self.dtype)
        # Fused projections as serving engines keep them: one matmul for Q, K and V, one for gate and up.
        self.layers = [
            {
                "qkv": w(s.hidden_size, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim),
                "o": w(s.num_heads * s.head_dim, s.hidden_size),
                "gate_up": w(s.hidden_size, 2 * s.intermediate_size),
                "down": w(s.intermediate_size, s.hidden_size),
            }
            for _ in range(s.num_layers)
        ]
        self.lm_head = w(s.hidden_size, s.vocab_size)
        half = s.head_dim // 2
        # Kept on the host: angles are computed in prepare(), outside any measured region.
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / s.head_dim))

    # ------------------------------------------------------------------ inputs
    def prepare(self, tables: list[list[int]], start: int, n: int, block_size: int, seed: int = 0) -> Batch:
        """Tensors for ``len(tables)`` requests each computing tokens ``[start, start + n)`` (random token ids).

        Every request has the same context length; ``tables[b]`` must cover ``start + n`` tokens.
        """
        dev = self.device
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.shape.vocab_size, (len(tables), n), generator=g).to(dev)
        positions = torch.arange(start, start + n)
        tab = torch.tensor(tables, dtype=torch.long)
        slot_blocks = tab[:, positions // block_size]
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        mask = None
        if start > 0 and n > 1:
            mask = (positions[:, None] >= torch.arange(start + n)[None, :]).to(dev)
        return Batch(
            tokens=tokens,
            positions=positions.to(dev),
            slot_blocks=slot_blocks.to(dev),
            slot_offsets=(positions % block_size).to(dev),
            tables=tab.to(dev),
            start=start,
            cos=ang.cos().to(dev, self.dtype),
            sin=ang.sin().to(dev, self.dtype),
            mask=mask,
        )

    # ----------------------------------------------------------------- compute
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_eps)).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, n, heads, d]; cos/sin: [n, d/2]
        d = x.shape[-1] // 2
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        x1, x2 = x[..., :d], x[..., d:]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    @torch.no_grad()
    def forward(self, batch: Batch, kv: KVStorage, before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute the batch's tokens through every layer; return the last token's logits ``[B, vocab]``.

        New K/V are written into ``kv`` at the batch's slots.  A chunk starting
        at 0 attends to itself (causal); one after cached context reads the
        context back through the block tables.
        """
        s = self.shape
        B, n = batch.tokens.shape
        ctx = batch.start + n
        group = s.num_heads // s.num_kv_heads
        hq, hk = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        x = self.embed[batch.tokens]  # [B, n, hidden]
        for i, lw in enumerate(self.layers):
            h = self._norm(x)
            q, k, v = (h @ lw["qkv"]).split([hq, hk, hk], dim=-1)
            q = self._rope(q.view(B, n, s.num_heads, s.head_dim), batch.cos, batch.sin)
            k = self._rope(k.view(B, n, s.num_kv_heads, s.head_dim), batch.cos, batch.sin)
            v = v.view(B, n, s.num_kv_heads, s.head_dim)
            if before_layer is not None:
                before_layer(i)
            k_cache, v_cache = kv.layer_kv(i)
            k_cache[batch.slot_blocks, batch.slot_offsets] = k
            v_cache[batch.slot_blocks, batch.slot_offsets] = v
            if batch.start == 0:
                keys, vals = k, v
            else:  # read the whole context back through the tables
                bs = kv.spec.block_size
                keys = k_cache[batch.tables].reshape(B, -1, s.num_kv_heads, s.head_dim)[:, :ctx]
                vals = v_cache[batch.tables].reshape(B, -1, s.num_kv_heads, s.head_dim)[:, :ctx]
                assert keys.shape[1] == ctx, f"tables cover {batch.tables.shape[1] * bs} tokens, need {ctx}"
            # [B, heads, tokens, d]; grouped KV heads expanded so the flash kernel applies.
            qh = q.transpose(1, 2)
            kh = keys.transpose(1, 2).repeat_interleave(group, dim=1)
            vh = vals.transpose(1, 2).repeat_interleave(group, dim=1)
            if batch.start == 0:
                attn = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1)
            else:
                attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=batch.mask)
            x = x + attn.transpose(1, 2).reshape(B, n, hq) @ lw["o"]
            gate, up = (self._norm(x) @ lw["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ lw["down"]
        return (self._norm(x[:, -1]) @ self.lm_head).float()
