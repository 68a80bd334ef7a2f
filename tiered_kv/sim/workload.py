"""Synthetic and replayed workloads.

* Arrivals: Poisson, bursty (bursts arriving as a Poisson process) or fixed spacing.
* Prompt and output lengths: fixed, uniform or lognormal (clipped).
* Shared system prompts picked with Zipf popularity.
* Multi-turn conversations: a follow-up resends the whole previous turn
  (prompt + answer) plus a new user message, arriving a think time after
  the previous turn's arrival.
* Replay of a JSONL trace: one object per line with ``arrival`` (seconds),
  ``prompt_tokens`` (a list) or ``prompt_len``, and ``output_len``.

Token ids are built from ranges: each piece of text (a system prompt, a user
message, an answer) gets a disjoint id range, so prefixes are shared exactly
where the workload says and nowhere else, and generation costs no per-token
random draws.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: list[int]
    output: list[int]  # the tokens the model "samples", in order
    conversation: int = -1
    turn: int = 0


class _Ids:
    """Disjoint token-id ranges (ids grow without bound; the simulator never embeds them)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def sample_length(spec: dict[str, Any], rng: random.Random, key: str) -> int:
    dist = spec["dist"]
    if dist == "fixed":
        n = spec["value"]
    elif dist == "uniform":
        n = rng.randint(spec["low"], spec["high"])
    elif dist == "lognormal":
        # mean of the lognormal is spec["mean"]; sigma is the log-space spread
        mu = math.log(spec["mean"]) - spec["sigma"] ** 2 / 2
        n = round(rng.lognormvariate(mu, spec["sigma"]))
    else:  # pragma: no cover - the schema forbids it
        raise ConfigError(f"{key}.dist: unknown distribution {dist!r}")
    return max(spec["min"], min(spec["max"], n))


def _arrivals(spec: dict[str, Any], n: int, rng: random.Random) -> list[float]:
    rate = spec["rate"]
    out: list[float] = []
    t = 0.0
    if spec["process"] == "fixed":
        return [i / rate for i in range(n)]
    if spec["process"] == "poisson":
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(rate)
        return out
    burst = spec["burst_size"]
    while len(out) < n:
        out.extend([t] * min(burst, n - len(out)))
        t += rng.expovariate(rate / burst)
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def generate(spec: dict[str, Any], seed: int) -> list[SimRequest]:
    """Requests of a validated ``workload`` config section, deterministic in ``seed``."""
    if spec["trace"]:
        return load_trace(Path(spec["trace"]), seed)
    rng = random.Random(seed)
    ids = _Ids()
    n = spec["num_requests"]
    arrivals = _arrivals(spec["arrival"], n, rng)
    sp = spec["system_prompts"]
    systems = [ids.take(sp["length"]) for _ in range(sp["count"])]
    weights = zipf_weights(sp["count"], sp["zipf"]) if sp["count"] else []
    mt = spec["multi_turn"]
    open_convs: list[tuple[int, list[int], int]] = []  # (conversation, history, turns so far)
    out: list[SimRequest] = []
    for rid in range(n):
        user = ids.take(sample_length(spec["prompt_len"], rng, "workload.prompt_len"))
        answer = ids.take(sample_length(spec["output_len"], rng, "workload.output_len"))
        if open_convs and rng.random() < mt["prob"]:
            k = rng.randrange(len(open_convs))
            conv, history, turns = open_convs[k]
            prompt = history + user
            req = SimRequest(rid, arrivals[rid], prompt, answer, conv, turns)
            if turns + 1 >= mt["max_turns"]:
                open_convs.pop(k)
            else:
                open_convs[k] = (conv, prompt + answer, turns + 1)
        else:
            prefix = (
                systems[rng.choices(range(sp["count"]), weights)[0]] if systems and rng.random() < sp["share"] else []
            )
            prompt = prefix + user
            req = SimRequest(rid, arrivals[rid], prompt, answer, rid, 0)
            if mt["prob"] > 0 and mt["max_turns"] > 1:
                open_convs.append((rid, prompt + answer, 1))
                if len(open_convs) > 256:
                    open_convs.pop(0)
        out.append(req)
    return out


def load_trace(path: Path, seed: int = 0) -> list[SimRequest]:
    """Replay a JSONL trace (``arrival``, ``prompt_tokens`` or ``prompt_len``, ``output_len``)."""
    if not path.exists():
        raise ConfigError(f"workload.trace: file {str(path)!r} does not exist")
    ids = _Ids()
    out: list[SimRequest] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"workload.trace: line {lineno} is not JSON: {exc}") from None
        where = f"workload.trace line {lineno}"
        unknown = set(row) - {"arrival", "prompt_tokens", "prompt_len", "output_len"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        try:
            arrival = float(row["arrival"])
            n_out = int(row["output_len"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: needs numeric 'arrival' and 'output_len' ({exc})") from None
        if "prompt_tokens" in row:
            prompt = [int(t) for t in row["prompt_tokens"]]
        elif "prompt_len" in row:
            prompt = ids.take(int(row["prompt_len"]))
        else:
            raise ConfigError(f"{where}: needs 'prompt_tokens' or 'prompt_len'")
        if not prompt or n_out < 1 or arrival < 0:
            raise ConfigError(f"{where}: needs a non-empty prompt, output_len >= 1 and arrival >= 0")
        out.append(SimRequest(len(out), arrival, prompt, ids.take(n_out)))
    if not out:
        raise ConfigError(f"workload.trace: {str(path)!r} has no requests")
    out.sort(key=lambda r: (r.arrival, r.rid))
    return out
