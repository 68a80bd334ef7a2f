"""The one place the adapter imports SGLang, so a missing SGLang is one clear error."""

from __future__ import annotations

from tiered_kv.errors import MissingDependencyError

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
except ImportError as exc:  # pragma: no cover - exercised where SGLang is absent
    raise MissingDependencyError(
        "tiered_kv.integrations.sglang needs SGLang 0.5.23: pip install 'tiered-kv[sglang]' "
        f"(on a CPU machine: bash scripts/setup-venv.sh sglang) ({exc})"
    ) from exc

TESTED_VERSIONS = ("0.5.23",)

__all__ = ["TESTED_VERSIONS", "HiCacheStorage", "HiCacheStorageExtraInfo"]
