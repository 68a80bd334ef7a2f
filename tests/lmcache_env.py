"""What the LMCache integration tests need: LMCache 0.5.6 installed, and its storage manager built on the CPU.

The integration tests run in their own environment (``bash scripts/setup-venv.sh lmcache``
makes ``.venv-lmcache``; ``.ci/run`` runs them there).  In the default environment
LMCache is absent and they skip with that reason, unless ``TIERED_KV_REQUIRE_LMCACHE``
is set (``.ci/run`` sets it), where a missing LMCache fails instead.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

LMCACHE_VERSION = "0.5.6"
PLUGIN = "tiered_kv"
MODULE = "tiered_kv.integrations.lmcache"


def lmcache_problem() -> str | None:
    """Why LMCache 0.5.6 cannot be used here, or ``None`` when its storage code imports."""
    try:
        import lmcache
        from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
    except ImportError as exc:
        return f"LMCache {LMCACHE_VERSION} is not installed ({exc})"
    version = getattr(lmcache, "__version__", "unknown")
    return (
        None if version == LMCACHE_VERSION else f"LMCache {version} is installed, the tests are for {LMCACHE_VERSION}"
    )


PROBLEM = lmcache_problem()


def lmcache_mark() -> pytest.MarkDecorator:
    """The calling module's ``pytestmark``: skip its tests, naming why, unless LMCache 0.5.6 imports.

    Where ``TIERED_KV_REQUIRE_LMCACHE`` is set (``.ci/run`` sets it) a missing LMCache fails instead.
    """
    if PROBLEM is not None and os.environ.get("TIERED_KV_REQUIRE_LMCACHE"):
        pytest.fail(f"TIERED_KV_REQUIRE_LMCACHE is set but {PROBLEM}", pytrace=False)
    return pytest.mark.skipif(
        PROBLEM is not None,
        reason=f"{PROBLEM}: the LMCache integration tests run in .venv-lmcache "
        "(bash scripts/setup-venv.sh lmcache; .ci/run runs them)",
    )


def engine_config(tiers: list[dict] | None, chunk_size: int = 16, **ours: Any) -> Any:
    """LMCache's engine config with our plug-in in ``storage_plugins`` and its keys in ``extra_config``.

    The local CPU backend is LMCache's own, used only as the allocator (``local_cpu`` off), so
    every get reaches the plug-in.
    """
    from lmcache.v1.config import LMCacheEngineConfig

    extra = {f"storage_plugin.{PLUGIN}.module_path": MODULE, f"storage_plugin.{PLUGIN}.class_name": "TieredKVStorage"}
    if tiers is not None:
        extra[f"storage_plugin.{PLUGIN}.tiers"] = tiers
    extra.update({f"storage_plugin.{PLUGIN}.{k}": v for k, v in ours.items()})
    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=False,
        max_local_cpu_size=0.01,
        storage_plugins=[PLUGIN],
        extra_config=extra,
    )


def engine_metadata(kv_dtype: Any = None, chunk_size: int = 16, model: str = "tiny-llama") -> Any:
    """LMCache's metadata of a 2-layer model with 2 KV heads of 8 dims: a full chunk is 2 x 2 x 16 x 16 values."""
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=kv_dtype or torch.float16,
        kv_shape=(2, 2, chunk_size, 2, 8),
        chunk_size=chunk_size,
    )
