"""What the vLLM integration tests need: vLLM 0.33.0 installed, and an offloading config built without a model hub.

The integration tests run in their own environment (``bash scripts/setup-venv.sh vllm``
makes ``.venv-vllm``; ``.ci/run`` runs them there).  In the default environment
vLLM is absent and they skip with that reason, unless ``TIERED_KV_REQUIRE_VLLM``
is set (``.ci/run`` sets it), where a missing vLLM fails instead.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

VLLM_VERSION = "0.33.0"


def vllm_problem() -> str | None:
    """Why vLLM 0.33.0 cannot be used here, or ``None`` when it imports.

    On a machine without a GPU, vLLM's platform is set to its CPU platform before vLLM is first
    imported (vLLM resolves its platform once per process, and cannot infer it from a CUDA wheel
    on a CPU-only machine); no model hub is used (``HF_HUB_OFFLINE``).
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm
    except ImportError as exc:
        return f"vLLM {VLLM_VERSION} is not installed ({exc})"
    version = getattr(vllm, "__version__", "unknown")
    return None if version == VLLM_VERSION else f"vLLM {version} is installed, the tests are for {VLLM_VERSION}"


PROBLEM = vllm_problem()


def vllm_mark() -> pytest.MarkDecorator:
    """The calling module's ``pytestmark``: skip its tests, naming why, unless vLLM 0.33.0 imports.

    Where ``TIERED_KV_REQUIRE_VLLM`` is set (``.ci/run`` sets it) a missing vLLM fails instead.
    A mark, not a skip at collection, so that a run selecting other markers (``-m gpu``)
    deselects these tests instead of counting them.
    """
    if PROBLEM is not None and os.environ.get("TIERED_KV_REQUIRE_VLLM"):
        pytest.fail(f"TIERED_KV_REQUIRE_VLLM is set but {PROBLEM}", pytrace=False)
    return pytest.mark.skipif(
        PROBLEM is not None,
        reason=f"{PROBLEM}: the vLLM integration tests run in .venv-vllm "
        "(bash scripts/setup-venv.sh vllm; .ci/run runs them)",
    )


def offloading_config(extra_config: dict[str, Any], kv_bytes_per_block: int = 4096, tokens_per_block: int = 16) -> Any:
    """vLLM's ``OffloadingConfig`` for one attention group, with a unique engine id (its shared-memory name)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block, ("layer",), 0),),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=dict(extra_config),
        engine_id=f"tkv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name="tiny-llama", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
