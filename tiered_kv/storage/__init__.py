"""Layer 1: KV bytes per tier.  ``spec`` is stdlib; ``kv_storage`` needs torch."""

from tiered_kv.storage.spec import DTYPE_BYTES, LAYOUTS, LLAMA3_8B, KVSpec, segment_offsets

__all__ = ["DTYPE_BYTES", "LAYOUTS", "LLAMA3_8B", "KVSpec", "segment_offsets"]
