"""Preemption inside vLLM 0.33's real scheduler on a slice of the Mooncake trace, beside the simulator's prediction.

One oversubscribed request stream (the Mooncake sample of ``configs/traces/mooncake/``,
sampled as the config says, within a window) replays through vLLM 0.33.0's own
``Scheduler`` on the CPU with a stand-in model runner:

* each step takes the time the simulator's step model gives for that batch
  (``tiered_kv.sim.compute.ComputeModel``: Llama-3-8B on an H200, the profiles
  of ``configs/hardware/h200.yaml`` and ``configs/models/llama3-8b.yaml``, read
  when the script runs, so a refit shows up in the next run);
* the connector's worker side is modelled, as vLLM 0.33's
  ``OffloadingConnectorWorker`` behaves: a step's stores are submitted at the
  start of the next step; stores in the flush set (a preempted request's) are
  submitted then too and waited for before the forward pass; loads start with
  the step; one FIFO copy queue per direction at the profile's host link
  bandwidth and per-copy cost; a job is reported at the end of the first step
  after it lands;
* a request enters the scheduler after the profile's front-end cost, and its
  time to first token is the end of the step that sampled it, from its arrival.

Rows: vLLM's default (vLLM's scheduler, recompute; without and with
tiered_kv's connector as a CPU prefix tier), then tiered_kv's scheduler class
with each victim policy and ``mode: auto`` (swap or recompute per victim by its
quote), and beside each the simulator's own run of the same stream and settings
(``tiered_kv.sim.simulator.Simulator``).  The recompute tax is RFC 54644's:
tokens computed again over all tokens computed.

Deterministic: the stream, the step times and the copy times are functions of
the config; no wall-clock time enters a decision.

Usage (vLLM's environment)::

    .venv-vllm/bin/python benchmarks/bench_vllm_preemption.py [--window 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("last_admitted", "largest", "prefill_aware", "cost_aware")


def _vllm_environment() -> None:
    """vLLM resolves its platform once per process: the CPU one where there is no GPU; no model hub."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONHASHSEED"] = "0"  # vLLM's block hasher seeds its root hash from it: runs are repeatable


# ---------------------------------------------------------------------------------- the stream
RUNS = [
    {"name": "vllm default", "victim_policy": "last_admitted", "mode": "recompute", "offload": "none",
     "cpu_kv_tokens": 0},
    {"name": "vllm default + CPU tier", "victim_policy": "last_admitted", "mode": "recompute",
     "offload": "write_through"},
    *({"name": f"{p} + swap", "victim_policy": p, "mode": "auto", "offload": "write_through"} for p in POLICIES),
]  # fmt: skip
"""The rows, as the simulator's ``runs`` entries (the vLLM replay reads the same settings)."""


def load_stream(
    config: str, window: float, every: int | None = None, reserve_full_isl: bool = True
) -> tuple[dict[str, Any], list[Any]]:
    """The validated config, its runs replaced by :data:`RUNS` and its trace cut to ``window`` s; its requests.

    ``reserve_full_isl`` sets the simulator's admission to the one the vLLM replay runs with, so
    that each row's two lines compare the same scheduler settings.
    """
    from tiered_kv.sim.config import config_from_raw, read_config
    from tiered_kv.sim.workload import generate

    raw, stem = read_config(config)
    overrides: dict[str, Any] = {
        "workload.trace_sample.window_s": [0, window],
        "runs": RUNS,
        "scheduler.scheduler_reserve_full_isl": reserve_full_isl,
    }
    if every is not None:
        overrides["workload.trace_sample.every"] = every
    cfg = config_from_raw(raw, stem, overrides)
    return cfg, generate(cfg["workload"], cfg["seed"])


def setups(cfg: dict[str, Any]) -> list[Any]:
    """One ``RunSetup`` per row of :data:`RUNS`, as the simulator derives it."""
    from tiered_kv.sim.config import setup

    return [setup(cfg, i) for i in range(len(RUNS))]


# ---------------------------------------------------------------------------------- vLLM's side
LLAMA3_8B = {
    # Llama-3.1-8B's shape (a 128k context, as the trace's longest prompts need): only the scheduler
    # runs, so no weights; vLLM's config still inspects the architecture.
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def build_scheduler(
    st: Any, model_dir: str, max_model_len: int, ours: bool, connector: bool, reserve_full_isl: bool
) -> Any:
    """vLLM's ``Scheduler`` or tiered_kv's ``TieredKVScheduler`` over the run's GPU pool (and CPU tier)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    from tiered_kv.integrations.vllm import TieredKVScheduler

    bs, n = st.manager.block_size, st.manager.num_gpu_blocks
    model = ModelConfig(
        model=model_dir, dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len
    )
    sched = SchedulerConfig(
        max_num_seqs=st.scheduler.max_num_seqs,
        max_num_batched_tokens=st.scheduler.max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=st.scheduler.chunked_prefill,
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    cache = CacheConfig(block_size=bs, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True)
    kv = None
    if connector:
        cm = st.cost_model
        preemption = {
            "mode": st.scheduler.mode,
            "victim_policy": st.scheduler.victim_policy,
            "cost_model": {  # the simulator's own cost model: the same quotes
                "prefill_tokens_per_s": cm.prefill_tokens_per_s,
                "prefill_quadratic_s_per_token2": cm.prefill_quadratic_s_per_token2,
                "prefill_overhead_s": cm.prefill_overhead_s,
                "d2h_bytes_per_s": cm.d2h_bytes_per_s,
                "h2d_bytes_per_s": cm.h2d_bytes_per_s,
                "per_copy_overhead_s": cm.per_copy_overhead_s,
            },
        }
        extra = {
            "spec_name": "TieredKVOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm",
            "cpu_bytes_to_use": st.manager.num_cpu_blocks * bs * st.model.kv_bytes_per_token,
            **({"preemption": preemption} if ours else {}),
        }
        kv = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    config = VllmConfig(
        scheduler_config=sched, model_config=model, cache_config=cache, parallel_config=ParallelConfig(),
        kv_transfer_config=kv,
    )  # fmt: skip
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(st.model.num_layers)]
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes * len(layers) == bs * st.model.kv_bytes_per_token, "Llama-3-8B's KV per block"
    block_bytes = spec.page_size_bytes * len(layers)
    kv_cache = KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[KVCacheTensor(size=block_bytes * n, layers=layers, layer_stride=spec.page_size_bytes,
                                        block_stride=block_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )  # fmt: skip
    cache.num_gpu_blocks = n
    register_all_kvcache_specs(config)
    cls = TieredKVScheduler if ours else Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=bs,
        log_stats=False,
    )


class CopyQueue:
    """One direction of the host link: FIFO copies at ``bytes_per_s`` plus a cost per copy."""

    def __init__(self, bytes_per_s: float, per_copy_s: float) -> None:
        self.bytes_per_s, self.per_copy_s = bytes_per_s, per_copy_s
        self.free_at = 0.0

    def submit(self, now: float, nbytes: int, runs: int) -> float:
        self.free_at = max(self.free_at, now) + nbytes / self.bytes_per_s + runs * self.per_copy_s
        return self.free_at


def _runs(ids: Sequence[int]) -> int:
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


@dataclass
class Replay:
    """One row: the stream through vLLM's scheduler, timed by the step model and the link model."""

    st: Any
    workload: list[Any]
    ours: bool
    connector: bool
    reserve_full_isl: bool = True
    clock: float = 0.0
    ttft: dict[int, float] = field(default_factory=dict)
    preempted: int = 0
    steps: int = 0
    tokens_computed: int = 0
    tokens_recomputed: int = 0
    _high: dict[str, int] = field(default_factory=dict)  # tokens a request had computed before it was preempted
    _last_computed: dict[str, int] = field(default_factory=dict)  # its progress after its latest step
    _tokens: dict[int, list[int]] = field(default_factory=dict)  # hash block -> its tokens (shared int objects)

    def tokens_of(self, r: Any) -> list[int]:
        """The prompt's token ids: each 512-token hash block of the trace becomes its own range of ids.

        Requests that share a trace block share its tokens, so vLLM's block hashes
        share exactly where the simulator's keys do.
        """
        if r.hashes is None:
            return list(r.prompt)
        size, out = r.hash_block_size, []
        for h in r.hashes:
            block = self._tokens.get(h)
            if block is None:
                block = self._tokens[h] = list(range(h * size, (h + 1) * size))
            out.extend(block)
        return out[: r.prompt_len]

    def run(self, model_dir: str) -> dict[str, Any]:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request

        st, wl = self.st, self.workload
        longest = max(r.prompt_len + len(r.output) for r in wl)
        sched = build_scheduler(
            st, model_dir, longest + st.manager.block_size, self.ours, self.connector, self.reserve_full_isl
        )
        init_none_hash(sha256)
        hasher = get_request_block_hasher(st.manager.block_size, sha256)
        compute, link = st.compute, st.link
        d2h = CopyQueue(link.d2h_bytes_per_s, link.per_copy_overhead_s)
        h2d = CopyQueue(link.h2d_bytes_per_s, link.per_copy_overhead_s)
        block_bytes = st.manager.block_size * st.model.kv_bytes_per_token
        front = compute.frontend_s
        by_id = {str(r.rid): r for r in wl}
        arrivals = sorted((r.arrival + front, r.rid) for r in wl)
        next_arrival = 0
        deferred: list[tuple[int, list[int]]] = []  # stores of the previous step, submitted at this one's start
        done_at: dict[int, float] = {}  # job -> when it lands
        landed: list[tuple[float, int]] = []  # (time, job) heap of jobs not reported yet
        loads: dict[int, str] = {}  # load job -> request
        outputs: dict[str, Sequence[int]] = {}
        while True:
            while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= self.clock:
                r = by_id[str(arrivals[next_arrival][1])]
                params = SamplingParams(max_tokens=max(1, len(r.output)), ignore_eos=True)
                params.update_from_generation_config({}, LLAMA3_8B["eos_token_id"])
                sched.add_request(Request(str(r.rid), self.tokens_of(r), params, None, block_hasher=hasher,
                                          arrival_time=r.arrival))  # fmt: skip
                outputs[str(r.rid)] = r.output
                next_arrival += 1
            if not sched.has_requests() and not landed and not deferred:
                if next_arrival == len(arrivals):
                    break
                self.clock = max(self.clock, arrivals[next_arrival][0])
                continue
            out = sched.schedule()
            meta = out.kv_connector_metadata
            start = self.clock
            if meta is not None:
                # handle_preemptions: the previous step's stores, then the flush set's new ones; wait for the flush set
                flush = set(meta.jobs_to_flush or ())
                submit = deferred + [(j, list(map(int, t.src_spec.block_ids))) for j, t in meta.store_jobs.items()
                                     if j in flush]  # fmt: skip
                for job_id, blocks in submit:
                    done_at[job_id] = d2h.submit(start, len(blocks) * block_bytes, _runs(blocks))
                    heapq.heappush(landed, (done_at[job_id], job_id))
                if flush:
                    start = max([start, *(done_at[j] for j in flush if j in done_at)])
                for job_id, t in meta.load_jobs.items():
                    blocks = list(map(int, t.dst_spec.block_ids))
                    done_at[job_id] = h2d.submit(start, len(blocks) * block_bytes, _runs(blocks))
                    heapq.heappush(landed, (done_at[job_id], job_id))
                    loads[job_id] = t.req_id
                deferred = [(j, list(map(int, t.src_spec.block_ids))) for j, t in meta.store_jobs.items()
                            if j not in flush]  # fmt: skip
            self.preempted += len(out.preempted_req_ids or ())
            self.steps += 1
            end, sampled = self._compute(sched, out, start, compute, outputs)
            if not out.total_num_scheduled_tokens:
                # Nothing ran: the engine waits for the next copy to land or the next request to arrive.
                waits = [t for t, _ in landed[:1]] + (
                    [arrivals[next_arrival][0]] if next_arrival < len(arrivals) else []
                )
                end = max(end, min(waits)) if waits else end
            self.clock = end
            worker_meta, recving = OffloadingWorkerMetadata(), set()
            while landed and landed[0][0] <= end:
                _, job_id = heapq.heappop(landed)
                worker_meta.mark_completed(job_id)
                if job_id in loads:
                    recving.add(loads.pop(job_id))
            ids = list(out.num_scheduled_tokens)
            kv_out = KVConnectorOutput(finished_recving=recving, kv_connector_worker_meta=worker_meta) if meta else None
            sched.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                    sampled_token_ids=[sampled.get(r, []) for r in ids], logprobs=None, prompt_logprobs_dict={},
                    pooler_output=[], kv_connector_output=kv_out,
                ),
            )  # fmt: skip
        return self._results(sched)

    def _compute(self, sched: Any, out: Any, start: float, compute: Any, outputs: dict) -> tuple[float, dict]:
        """The step's time by the step model; which requests sample (and their first-token times)."""
        tokens = attn = kv = prefill_tokens = prefill_attn = num_sampled = 0
        sampled: dict[str, list[int]] = {}
        high = self._high
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            c = req.num_computed_tokens - n  # vLLM advanced it when it scheduled the step
            units = (c + n) * (c + n) - c * c
            tokens, attn, kv = tokens + n, attn + units, kv + c + n
            if n > 1:
                prefill_tokens, prefill_attn = prefill_tokens + n, prefill_attn + units
            mark = high.get(rid, 0)
            if mark > c:
                self.tokens_recomputed += min(c + n, mark) - c
            if c + n >= req.num_tokens:
                out_tokens = outputs[rid]
                k = req.num_output_tokens
                sampled[rid] = [int(out_tokens[k]) if k < len(out_tokens) else 0]
                num_sampled += 1
        for rid in out.preempted_req_ids or ():
            high[rid] = max(high.get(rid, 0), self._last_computed.get(rid, 0))
        self.tokens_computed += tokens
        if not tokens:
            return start, sampled
        step = compute.step_time(tokens, attn, kv, len(out.num_scheduled_tokens), num_sampled, prefill_tokens,
                                 prefill_attn)  # fmt: skip
        end = start + step
        for rid in sampled:
            self.ttft.setdefault(int(rid), end)
        for rid, _ in out.num_scheduled_tokens.items():
            self._last_computed[rid] = sched.requests[rid].num_computed_tokens
        return end, sampled

    def _results(self, sched: Any) -> dict[str, Any]:
        from tiered_kv.sim.simulator import percentiles

        ttft = [self.ttft[r.rid] - r.arrival for r in self.workload]
        out: dict[str, Any] = {
            "steps": self.steps,
            "makespan_s": self.clock,
            "ttft_s": percentiles(ttft),
            "preemptions": self.preempted,
            "tokens_computed": self.tokens_computed,
            "tokens_recomputed": self.tokens_recomputed,
            "recompute_tax": self.tokens_recomputed / self.tokens_computed if self.tokens_computed else 0.0,
        }
        counters = getattr(sched, "counters", None)
        if counters is not None:
            out["preemptions_swap"] = counters.preemptions_swap
            out["preemptions_recompute"] = counters.preemptions_recompute
            out["blocks_stored_at_preemption"] = counters.blocks_stored
            out["blocks_loaded_at_resume"] = counters.blocks_loaded
            # The scheduler counts what this driver counts, from vLLM's own progress: they must agree.
            assert counters.tokens_recomputed == self.tokens_recomputed, (
                counters.tokens_recomputed,
                self.tokens_recomputed,
            )
            assert counters.tokens_computed == self.tokens_computed
            assert sched.victim_mismatches == 0
        else:
            out["preemptions_swap"], out["preemptions_recompute"] = 0, self.preempted
        return out


def simulate(st: Any, workload: list[Any]) -> dict[str, Any]:
    from tiered_kv.sim.simulator import Simulator

    res = Simulator(st, workload).run()
    tax = res["tokens_recomputed"] / res["tokens_computed"] if res["tokens_computed"] else 0.0
    return {
        "ttft_s": res["ttft_s"],
        "preemptions_swap": res["preemptions_swap"],
        "preemptions_recompute": res["preemptions_recompute"],
        "tokens_computed": res["tokens_computed"],
        "tokens_recomputed": res["tokens_recomputed"],
        "recompute_tax": tax,
        "makespan_s": res["makespan_s"],
    }


def table(rows: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> str:
    head = (
        "| run | where | TTFT p50 s | TTFT p90 s | preemptions swap / recompute | recompute tax | "
        "blocks stored at preemption / loaded at resume |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, vllm, sim in rows:
        for where, r in (("vLLM 0.33 scheduler", vllm), ("simulator", sim)):
            blocks = (
                f"{r['blocks_stored_at_preemption']} / {r['blocks_loaded_at_resume']}"
                if "blocks_stored_at_preemption" in r
                else "-"
            )
            lines.append(
                f"| {name} | {where} | {r['ttft_s']['p50']:.3f} | {r['ttft_s']['p90']:.3f} | "
                f"{r['preemptions_swap']} / {r['preemptions_recompute']} | {100 * r['recompute_tax']:.2f}% | {blocks} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "mooncake-llama3-8b-h200.yaml"))
    ap.add_argument("--window", type=float, default=300.0, help="seconds of the trace (from its start) to replay")
    ap.add_argument("--every", type=int, default=None, help="replay every k-th conversation (default: the config's)")
    ap.add_argument(
        "--no-reserve-full-isl",
        dest="reserve_full_isl",
        action="store_false",
        help="admit a request when its first chunk fits (scheduler_reserve_full_isl=False), in vLLM and in the "
        "simulator; by default vLLM 0.33 admits one only when its whole prompt fits",
    )
    ap.add_argument("--json", default=None, help="also write every number to this file")
    args = ap.parse_args(argv)
    _vllm_environment()
    cfg, workload = load_stream(args.config, args.window, args.every, args.reserve_full_isl)
    sts = setups(cfg)
    st0 = sts[0]
    prompt = sum(r.prompt_len for r in workload)
    print(
        f"{len(workload)} requests of the Mooncake trace ({args.window:.0f} s window, every "
        f"{cfg['workload']['trace_sample']['every']} conversation(s)), {prompt} prompt tokens; "
        f"{st0.hardware.name} / {st0.model.name}: {st0.manager.num_gpu_blocks} GPU blocks of "
        f"{st0.manager.block_size} tokens, "
        f"CPU tier {sts[1].manager.num_cpu_blocks} blocks; vLLM's scheduler_reserve_full_isl={args.reserve_full_isl}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(LLAMA3_8B))
        for run, st in zip(RUNS, sts, strict=True):
            t0 = time.perf_counter()
            ours = not run["name"].startswith("vllm default")
            connector = run["offload"] != "none"
            vllm = Replay(st, workload, ours, connector, args.reserve_full_isl).run(model_dir)
            t1 = time.perf_counter()
            sim = simulate(st, workload)
            t2 = time.perf_counter()
            print(f"  {run['name']}: vLLM replay {t1 - t0:.0f} s, simulator {t2 - t1:.0f} s (wall)", flush=True)
            rows.append((run["name"], vllm, sim))
    print(table(rows))
    if args.json:
        doc = {"window_s": args.window, "reserve_full_isl": args.reserve_full_isl, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
