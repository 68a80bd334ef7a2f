"""tiered_kv's disk and Redis stores inside LMCache 0.5.6 as a storage plug-in (the ``[lmcache]`` extra).

LMCache builds each entry of ``storage_plugins`` from
``extra_config["storage_plugin.<name>.module_path"]`` and ``".class_name"``; with
``module_path: tiered_kv.integrations.lmcache`` and ``class_name: TieredKVStorage``
it builds :class:`~tiered_kv.integrations.lmcache.storage.TieredKVStorage` over a
disk store, a Redis store or both chained.  ``docs/integrations.md`` has the
configuration lines.

The name resolves lazily, so importing this package does not import LMCache until
it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "TieredKVStorage": "tiered_kv.integrations.lmcache.storage",
    "PluginStats": "tiered_kv.integrations.lmcache.storage",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
