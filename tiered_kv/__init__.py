"""tiered_kv: a multi-tier KV-cache memory manager for LLM serving.

Layers (imports point down only): ``core`` (bookkeeping, stdlib only) <-
``storage``/``transfer`` (bytes, torch) <- ``manager``/``tiers`` <- ``sched`` <-
``sim``/``engine`` <- ``cli``; docs/architecture.md draws them.  Importing the package
imports only :mod:`tiered_kv.errors`, so ``import tiered_kv`` pulls in neither torch nor
any layer.
"""

from tiered_kv.errors import TieredKVError

__version__ = "0.1.0"
__all__ = ["TieredKVError", "__version__"]
