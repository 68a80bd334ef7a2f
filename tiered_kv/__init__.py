"""tiered_kv: a multi-tier KV-cache memory manager for LLM serving.

Layers (imports point down only): ``core`` (bookkeeping, stdlib only) ->
``storage``/``transfer`` (bytes, torch) -> ``manager`` (policy) -> ``sim``/``engine``
-> ``cli``.  Importing the package imports only ``core``.
"""

from tiered_kv.errors import TieredKVError

__version__ = "0.1.0"
__all__ = ["TieredKVError", "__version__"]
