"""A seeded synthetic serving trace for the block-pool benchmarks, and the loop that serves it.

Shared system prompts with Zipf popularity, multi-turn follow-ups that resend
their whole history, unique user suffixes, and decoded outputs.  Served by
:func:`drive` with more KV demand over time than the pool holds, so that
cached blocks are evicted at hand-out all along (the benchmarks report how many).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

from tiered_kv.core import BlockHasher, Request

BLOCK_SIZE = 16


@dataclass(slots=True)
class TraceRequest:
    rid: int
    prompt: list[int]
    output: list[int]


def make_trace(
    num_requests: int = 2000,
    num_system_prompts: int = 16,
    zipf_s: float = 1.1,
    followup_prob: float = 0.3,
    seed: int = 0,
) -> list[TraceRequest]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32000) for _ in range(rng.randrange(256, 1024))] for _ in range(num_system_prompts)]
    weights = [1 / (k + 1) ** zipf_s for k in range(num_system_prompts)]
    history: list[list[int]] = []
    out: list[TraceRequest] = []
    for rid in range(num_requests):
        if history and rng.random() < followup_prob:
            base = history[rng.randrange(len(history))]
        else:
            base = systems[rng.choices(range(num_system_prompts), weights)[0]]
        prompt = base + [rng.randrange(1, 32000) for _ in range(rng.randrange(32, 256))]
        output = [rng.randrange(1, 32000) for _ in range(rng.randrange(32, 256))]
        history.append(prompt + output)
        if len(history) > 200:
            history.pop(rng.randrange(len(history)))
        out.append(TraceRequest(rid, prompt, output))
    return out


def precompute_hashes(trace: list[TraceRequest], hash_fn: str) -> tuple[dict[int, list], float, int]:
    """Every full block's hash of every request (prompt and output): (by request id, seconds, blocks)."""
    hasher = BlockHasher.create(BLOCK_SIZE, hash_fn)
    t0 = time.perf_counter()
    out = {}
    for tr in trace:
        req = Request(tr.rid, tr.prompt + tr.output)
        out[tr.rid] = hasher.update(req)
    dt = time.perf_counter() - t0
    return out, dt, sum(len(h) for h in out.values())


def drive(mgr, trace: list[TraceRequest], hashes: dict[int, list], concurrency: int) -> dict[str, int]:
    """Continuous batching: admit whole prompts FCFS, decode one token per step.

    ``mgr`` offers ``get_computed_blocks``, ``allocate_slots``, ``free`` and
    ``req_to_blocks``.  A decode that does not fit preempts that request (freed,
    re-queued at the front, restarted), so every implementation makes the same
    calls as long as its pool makes the same decisions.
    """
    pending = deque(trace)
    running: list[list] = []  # [request, trace request, output position]
    ops = {"requests": 0, "allocated": 0, "touched": 0, "freed": 0, "preempted": 0, "lookups": 0}
    while pending or running:
        while pending and len(running) < concurrency:
            tr = pending[0]
            req = Request(tr.rid, tr.prompt)
            req.block_hashes = hashes[tr.rid]
            hits, n = mgr.get_computed_blocks(req)
            ops["lookups"] += 1
            new = mgr.allocate_slots(req, req.num_tokens - n, n, hits)
            if new is None:
                if not running:
                    pending.popleft()  # larger than the whole pool: drop
                break
            pending.popleft()
            ops["allocated"] += len(new)
            ops["touched"] += len(hits)
            req.num_computed_tokens = req.num_tokens
            running.append([req, tr, 0])
        still: list[list] = []
        for item in running:
            req, tr, pos = item
            req.append_output_token_ids(tr.output[pos])
            new = mgr.allocate_slots(req, 1)
            if new is None:
                ops["freed"] += len(mgr.req_to_blocks.get(req.request_id, ()))
                mgr.free(req)
                ops["preempted"] += 1
                pending.appendleft(tr)
                continue
            ops["allocated"] += len(new)
            req.num_computed_tokens += 1
            item[2] = pos + 1
            if pos + 1 == len(tr.output):
                ops["freed"] += len(mgr.req_to_blocks.get(req.request_id, ()))
                mgr.free(req)
                ops["requests"] += 1
            else:
                still.append(item)
        running = still
    return ops
