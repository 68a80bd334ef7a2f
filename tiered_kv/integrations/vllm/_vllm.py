"""The one place the adapters import vLLM, so a missing vLLM is one clear error."""

from __future__ import annotations

from tiered_kv.errors import MissingDependencyError

try:
    import vllm as _vllm_package
except ImportError as exc:  # pragma: no cover - exercised where vLLM is absent
    raise MissingDependencyError(
        "tiered_kv.integrations.vllm needs vLLM 0.33: pip install 'tiered-kv[vllm]' "
        f"(on a CPU machine: bash scripts/setup-venv.sh vllm) ({exc})"
    ) from exc

VLLM_VERSION = getattr(_vllm_package, "__version__", "unknown")
TESTED_VERSIONS = ("0.33.0",)
