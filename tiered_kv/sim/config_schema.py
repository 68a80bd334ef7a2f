"""The schema of a simulator config: its sections, the keys of a run and of a regime, and the default runs.

:mod:`tiered_kv.sim.config` validates a config against these and resolves each
run; a run's tiers below the CPU have their own schema in
:mod:`tiered_kv.sim.tier_config`.
"""

from __future__ import annotations

from typing import Any

from tiered_kv.manager.victim_policy import (
    RENAMED_VICTIM_POLICIES,
    VICTIM_POLICIES,
    renamed_victim_policy_hint,
    victim_policy_class,
)
from tiered_kv.sim import shared_prefix
from tiered_kv.sim.engine_version import DEFAULT_ENGINE, engine_check
from tiered_kv.sim.link import LAYOUTS, MODES
from tiered_kv.sim.schema import (
    REQUIRED,
    Field,
    Retired,
    choice,
    fraction,
    integer,
    non_negative,
    num,
    positive,
    power_of_two,
    probability,
)
from tiered_kv.sim.tier_config import RUN_TIERS_SCHEMA
from tiered_kv.tiers.write_policy import RENAMED as RENAMED_WRITE_POLICIES
from tiered_kv.tiers.write_policy import WRITE_POLICIES


def _run_policy(value: Any) -> str:
    new = RENAMED_VICTIM_POLICIES.get(value, value) if isinstance(value, str) else value
    if new in VICTIM_POLICIES:
        return (
            f"{value!r} is not a scheduling order (policy means the scheduling order, fcfs or priority, as in "
            f"vLLM; the simulator serves in arrival order); the victim policy is now victim_policy: {new}"
        )
    return "the victim policy of a run is now victim_policy (the simulator serves in arrival order: fcfs)"


def _victim_policy(value: str) -> str | None:
    found = victim_policy_class(value)  # a registered name, or a qualified class name (imported here)
    if not isinstance(found, str):
        return None
    if value in RENAMED_VICTIM_POLICIES:
        return f"{value!r} was renamed: {renamed_victim_policy_hint(value)}"
    if "." in value:
        return found  # why the qualified name names no policy
    return (
        f"must be one of {sorted(VICTIM_POLICIES)} (or a policy of your own: registered with "
        f"register_victim_policy, or its class's qualified name package.module.ClassName), got {value!r}"
    )


def _offload(value: str) -> str | None:
    if value in WRITE_POLICIES:
        return None
    if value in RENAMED_WRITE_POLICIES:
        return f"must be one of {list(WRITE_POLICIES)}: {value!r} is now {RENAMED_WRITE_POLICIES[value]!r}"
    return f"must be one of {list(WRITE_POLICIES)}, got {value!r}"


def _scheduling(value: Any) -> str:
    return (
        "the scheduling order is now called policy (SchedulerConfig.policy: fcfs or priority, as in vLLM); "
        "the simulator serves in arrival order (fcfs) and takes no such key"
    )


def _watermark(v: Any) -> str | None:
    return None if 0 <= v < 1 else f"must be in [0, 1) (a fraction of the GPU KV blocks, vLLM's range), got {v}"


def _length(default_dist: str, value: int) -> dict[str, Any]:
    return {
        "dist": choice(default_dist, "fixed", "uniform", "lognormal"),
        "value": integer(value, positive),
        "low": integer(1, positive),
        "high": integer(max(value, 1), positive),
        "mean": num(float(value), positive),
        "sigma": num(0.5, positive),
        "min": integer(1, positive),
        "max": integer(1 << 20, positive),
    }


RUN_SCHEMA = {
    "name": Field((str,)),
    "note": Field((str,), ""),
    "vs": Field((str,), None, nullable=True),
    "victim_policy": Field((str,), "last_admitted", None, (_victim_policy,)),
    "policy": Retired(_run_policy),
    "scheduling": Retired(_scheduling),
    "mode": choice("auto", "swap", "recompute", "auto"),
    "offload": Field((str,), "none", None, (_offload,)),
    "cpu_kv_gib": num(None, non_negative, nullable=True),
    # The CPU tier in tokens of KV (wins over cpu_kv_gib): a size that means the same for every model.
    "cpu_kv_tokens": Field((int,), None, None, (non_negative,), nullable=True),
    "gpu_kv_gib": num(None, positive, nullable=True),
    "copies": choice("async", *MODES),
    "kv_layout": choice("block_contiguous", *LAYOUTS),
    "coalesce": Field((bool,), True),
    # Tiers below the CPU (disk, remote): none unless the run names one.
    "tiers": RUN_TIERS_SCHEMA,
}
REGIME_SCHEMA = {
    "name": Field((str,)),
    "rate": num(REQUIRED, positive),
    "num_requests": Field((int,), None, None, (positive,), nullable=True),
    # what the regime is meant to show; the report checks it against the measurements
    "expect": Field((str,), None, ("below", "over"), nullable=True),
}

SCHEMA: dict[str, Any] = {
    "name": Field((str,), "experiment"),
    "seed": integer(0, non_negative),
    "hardware": Field((str, dict), "h200"),
    "model": Field((str, dict), "llama3-8b"),
    # The serving engine simulated, vllm-X.Y.Z: which step model of the hardware profile, and what
    # the version changes (tiered_kv.sim.engine_version).
    "engine": Field((str,), DEFAULT_ENGINE, None, (engine_check,)),
    "hash": choice("fast", "fast", "sha256"),
    "memory": {
        "block_size": integer(16, power_of_two),
        "gpu_memory_utilization": num(0.9, fraction),
        "gpu_kv_gib": num(None, positive, nullable=True),
        "cpu_kv_gib": num(64.0, non_negative),
        "cpu_kv_tokens": Field((int,), None, None, (non_negative,), nullable=True),
        "host_memory_gib": num(1024.0, positive),
        # None: what vLLM's memory profile takes besides the weights (tiered_kv.sim.kv_pool); a number
        # replaces all of it (activations, sampler, memory outside torch, CUDA graphs) with that many GiB.
        "activation_reserve_gib": num(None, non_negative, nullable=True),
        # vLLM 0.21.0 and later: the CUDA graphs' memory its profile takes from the KV cache (None: kv_pool's).
        "cudagraph_gib": num(None, non_negative, nullable=True),
        "gpu_blocks": Field((int,), None, None, (positive,), nullable=True),
        "cpu_blocks": Field((int,), None, None, (non_negative,), nullable=True),
        # vLLM's enable_prefix_caching (--no-enable-prefix-caching: false): off, nothing is cached
        # on the GPU, so a preempted request cannot find its own freed blocks again.
        "prefix_caching": Field((bool,), True),
    },
    "scheduler": {
        # None: vLLM v1's defaults for the hardware (HardwareProfile.vllm_default_limits).
        "max_num_batched_tokens": Field((int,), None, None, (positive,), nullable=True),
        "max_num_seqs": Field((int,), None, None, (positive,), nullable=True),
        "chunked_prefill": Field((bool,), True),
        "scheduling": Retired(_scheduling),
        # vLLM's --async-scheduling (None: the engine version's default, on from 0.14.0).
        "async_scheduling": Field((bool,), None, nullable=True),
        # vLLM 0.33's admission gate, its name and default: admit a request only when its whole
        # prompt fits the GPU pool, not only its first chunk.
        "scheduler_reserve_full_isl": Field((bool,), True),
        # vLLM 0.33's KV-cache watermark: the fraction of the GPU pool an admission leaves free
        # while requests run.
        "watermark": num(0.0, _watermark),
    },
    # Overrides of the hardware profile's fitted step model (None: the profile's).
    "compute": {
        "mfu": num(None, fraction, nullable=True),
        "prefill_mfu": num(None, fraction, nullable=True),
        "hbm_efficiency": num(None, fraction, nullable=True),
        "step_overhead_s": num(None, non_negative, nullable=True),
        "per_step_s": Retired(lambda v: f"renamed: give compute.step_overhead_s: {v!r}"),
        "per_seq_s": num(None, non_negative, nullable=True),
        "per_layer_s": num(None, non_negative, nullable=True),
        "fixed_step_s": num(None, positive, nullable=True),
        # The serving front end's cost per request, before it reaches the scheduler (not a step's).
        "frontend_s": num(None, non_negative, nullable=True),
        # vLLM 0.6's --num-scheduler-steps: a decode-only batch runs this many steps per scheduling
        # decision, and a request that arrives meanwhile waits for the next decision.  vLLM v1 has
        # no such option: 1 (more is refused with an engine of the v1 era).
        "scheduler_steps": integer(1, positive),
    },
    # Overrides of the hardware profile's link (None: the profile's).
    "link": {
        # The keys of a hardware profile's link: the same names for the same quantities.
        "h2d_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "d2h_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "bidir_gbps": num(None, non_negative, nullable=True, allow_inf=True),
        "per_copy_overhead_s": num(None, non_negative, nullable=True),
        "gbps_per_direction": Retired(
            lambda v: f"renamed: give link.h2d_gbps: {v!r} (link.d2h_gbps, left out, is the same: a symmetric link)"
        ),
        "per_copy_us": Retired(lambda v: "renamed: give link.per_copy_overhead_s, in seconds"),
    },
    "workload": {
        "num_requests": integer(1000, positive),
        "arrival": {
            "process": choice("poisson", "poisson", "bursty", "fixed"),
            # .inf: every request at 0 (vllm bench serve's default --request-rate inf)
            "rate": num(10.0, positive, allow_inf=True),
            "burst_size": integer(8, positive),
        },
        "prompt_len": _length("uniform", 512),
        "output_len": _length("uniform", 256),
        "system_prompts": {
            "count": integer(0, non_negative),
            "length": integer(256, positive),
            "zipf": num(1.1, positive),
            "share": num(0.5, probability),
        },
        "multi_turn": {"prob": num(0.0, probability), "max_turns": integer(4, positive)},
        # A workload kind of its own (tiered_kv.sim.shared_prefix): shared system prompts recycled
        # at constant-rate stages; replaces the synthetic keys above.
        "shared_prefix": Field((dict,), None, None, (shared_prefix.check,), nullable=True),
        "trace": Field((str,), None, nullable=True),
        # The trace's layout (tiered_kv.sim.trace_formats.FORMATS); sharegpt's conversations
        # start arrival.rate per second.
        "trace_format": choice("jsonl", "jsonl", "mooncake", "azure", "burstgpt", "sharegpt"),
        # Replay part of the trace: the requests arriving in [window_s[0], window_s[1]) seconds,
        # of every k-th conversation (kept or dropped whole).
        "trace_sample": {
            "window_s": Field((list,), None, nullable=True),
            "every": integer(1, positive),
        },
        # Then replay it faster or slower: every time divided by speedup, or scaled to a mean rate
        # (requests/s); one of the two; .inf: every request at 0.
        "trace_scale": {
            "speedup": num(None, positive, nullable=True, allow_inf=True),
            "rate": num(None, positive, nullable=True, allow_inf=True),
        },
        # The client (tiered_kv.sim.client), null: an open loop.  concurrency: at most N requests in
        # flight (vllm bench serve --max-concurrency); think_s: a conversation's next turn is sent this
        # many seconds after its previous answer.
        "concurrency": Field((int,), None, None, (positive,), nullable=True),
        "think_s": num(None, non_negative, nullable=True),
    },
    "runs": Field((list,), None, nullable=True),
    "regimes": Field((list,), None, nullable=True),
    "sweep": {
        "gpu_kv_gib": Field((list,), None, nullable=True),
        "rate": Field((list,), None, nullable=True),
    },
}

# The runs of an experiment that names none: each effect on its own, each compared with the run it adds to.
DEFAULT_RUNS = [
    {
        "name": "recompute-only",
        "note": "vLLM v1",
        "victim_policy": "last_admitted",
        "mode": "recompute",
        "offload": "none",
        "cpu_kv_gib": 0,
    },
    {
        "name": "recompute+cpu-tier",
        "note": "vLLM v1 + CPU offloading connector",
        "vs": "recompute-only",
        "victim_policy": "last_admitted",
        "mode": "recompute",
        "offload": "write_through",
    },
    {
        "name": "always-swap",
        "note": "vLLM v0, blocking swaps",
        "vs": "recompute-only",
        "victim_policy": "last_admitted",
        "mode": "swap",
        "offload": "none",
        "copies": "blocking",
        "kv_layout": "layer_first",
        "coalesce": False,
    },
    {
        "name": "cost-aware",
        "note": "swap or recompute per victim, no CPU tier",
        "vs": "recompute-only",
        "victim_policy": "cost_aware",
        "mode": "auto",
        "offload": "none",
    },
    {
        "name": "cost-aware+cpu-tier",
        "note": "swap or recompute per victim + CPU prefix tier",
        "vs": "recompute+cpu-tier",
        "victim_policy": "cost_aware",
        "mode": "auto",
        "offload": "write_through",
    },
]
