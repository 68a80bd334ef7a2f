"""KVSpec: the shape of a model's KV cache, and its byte arithmetic (standard library only)."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1}
LAYOUTS = ("block_contiguous", "layer_first")


@dataclass(frozen=True, slots=True)
class KVSpec:
    """KV cache geometry.

    Attributes:
        num_layers: Attention layers.
        num_kv_heads: KV heads per layer (after GQA; per tensor-parallel rank).
        head_dim: Dimension of one head.
        dtype: One of :data:`DTYPE_BYTES`.
        block_size: Tokens per block.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"KVSpec.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def segment_bytes(self) -> int:
        """One block's K (or V) in one layer: the unit a layer-first layout stores contiguously."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def with_block_size(self, block_size: int) -> KVSpec:
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, block_size)


# Llama-3-8B: 32 layers, 8 KV heads (GQA), head dim 128, bf16 -> 128 KiB per token.
LLAMA3_8B = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)


def segment_offsets(spec: KVSpec, layout: str, num_blocks: int, block_id: int) -> list[int]:
    """Byte offsets (from the tier's base) of the ``2 * num_layers`` segments of one block.

    Order: layer 0 K, layer 0 V, layer 1 K, ...  In the block-contiguous layout the
    segments are adjacent (the block is one region); in the layer-first layout
    they are ``num_blocks * segment_bytes`` apart.  Used by the cupy gather kernel
    and checked against the torch views in the tests.
    """
    seg = spec.segment_bytes
    if layout == "block_contiguous":
        base = block_id * spec.bytes_per_block
        return [base + i * seg for i in range(2 * spec.num_layers)]
    if layout == "layer_first":
        return [(i * num_blocks + block_id) * seg for i in range(2 * spec.num_layers)]
    raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
