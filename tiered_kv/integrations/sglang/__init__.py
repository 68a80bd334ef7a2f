"""tiered_kv's disk and Redis stores as an SGLang HiCache storage backend (the ``[sglang]`` extra).

SGLang's hierarchical cache loads an out-of-tree storage backend named in its
configuration, with no fork: ``--hicache-storage-backend dynamic`` and
``backend_name``, ``module_path``, ``class_name`` in
``--hicache-storage-backend-extra-config``.  SGLang's ``StorageBackendFactory``
imports the class and builds it as ``cls(storage_config, kwargs)``:

* :class:`~tiered_kv.integrations.sglang.backend.TieredKVHiCacheStorage`: tiered_kv's
  disk store, Redis store, or the two chained, behind SGLang's ``HiCacheStorage`` calls.

Names resolve lazily, so importing this package does not import SGLang until a
name is asked for.  ``docs/integrations.md`` has the configuration line.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TieredKVHiCacheStorage": "tiered_kv.integrations.sglang.backend",
    "BackendConfig": "tiered_kv.integrations.sglang.backend_config",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
