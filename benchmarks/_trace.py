"""A seeded synthetic serving trace for the block-pool benchmarks.

Shared system prompts with Zipf popularity, multi-turn follow-ups that resend
their whole history, unique user suffixes, and decoded outputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
