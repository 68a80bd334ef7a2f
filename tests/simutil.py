"""Tiny simulator configs whose behaviour can be worked out by hand."""

from __future__ import annotations

import copy
from typing import Any

from tiered_kv.sim.config import setup, validate_config
from tiered_kv.sim.simulator import Simulator
from tiered_kv.sim.workload import generate

KIB_IN_GIB = 1024 / 2**30

TOY_STEP: dict[str, Any] = {
    "mfu": 0.5,
    "prefill_mfu": 0.5,
    "hbm_efficiency": 0.8,
    "step_overhead_s": 5e-4,
    "per_layer_s": 0.0,
    "per_seq_s": 0.0,
    "frontend_s": 0.0,
}

# One layer, one KV head of 64 fp16 values: 256 bytes of KV per token, 1 KiB per 4-token block.
TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 1,
    "hardware": {
        "name": "toy",
        "memory_gib": 1,
        "peak_bf16_flops": 1.0e12,
        "hbm_bytes_per_s": 1.0e11,
        "link": {"h2d_gbps": 4.096e-6, "per_copy_overhead_s": 0.0},
        # The same step model for both engine eras (a run of either era is priced alike).
        "step_model": {"vllm-v1": dict(TOY_STEP), "vllm-v0": dict(TOY_STEP)},
        # A toy: a link of 4 KB/s makes a 1 KiB block's copy take a quarter of a second.
        "skip_range_checks": True,
    },
    "model": {
        "name": "toy",
        "num_params": 1.0e6,
        "num_layers": 1,
        "hidden_size": 64,
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 64,
        "vocab_size": 0,
        "dtype": "float16",
    },
    "hash": "sha256",
    "memory": {
        "block_size": 4,
        "gpu_kv_gib": 8 * KIB_IN_GIB,
        "cpu_kv_gib": 8 * KIB_IN_GIB,
        "activation_reserve_gib": 0,
    },
    "compute": {"fixed_step_s": 1.0},
    # Synchronous scheduling (vLLM before 0.14), so that every step's arrivals are decided on at its end.
    "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 4, "async_scheduling": False},
    "workload": {
        "num_requests": 2,
        "arrival": {"process": "fixed", "rate": 0.5},
        "prompt_len": {"dist": "fixed", "value": 4},
        "output_len": {"dist": "fixed", "value": 2},
    },
    "runs": [
        {"name": "only", "victim_policy": "last_admitted", "mode": "recompute", "offload": "none", "cpu_kv_gib": 0}
    ],
}


def config(**changes: Any) -> dict[str, Any]:
    """TINY with dotted-key changes, validated."""
    raw = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    return validate_config(raw)


def run(
    cfg: dict[str, Any], index: int = 0, trace: bool = False, keep_timeline: bool = False
) -> tuple[dict[str, Any], Simulator]:
    sim = Simulator(
        setup(cfg, index), generate(cfg["workload"], cfg["seed"]), record_trace=trace, keep_timeline=keep_timeline
    )
    return sim.run(), sim
