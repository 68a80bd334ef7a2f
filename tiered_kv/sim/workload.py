"""Synthetic and replayed workloads.

* Arrivals: Poisson, bursty (bursts arriving as a Poisson process) or fixed spacing;
  ``arrival.rate: .inf`` makes every request arrive at 0 (``vllm bench serve``'s default
  ``--request-rate inf``).
* Prompt and output lengths: fixed, uniform or lognormal (clipped).
* Shared system prompts picked with Zipf popularity.
* Multi-turn conversations: a follow-up resends the whole previous turn
  (prompt + answer) plus a new user message; it takes the next arrival time
  of the process, or, with ``workload.think_s``, is sent a think time after the
  previous turn's answer (:mod:`tiered_kv.sim.client`).
* Shared system prompts recycled at constant rates, stage after stage
  (``workload.shared_prefix``: a workload kind of its own, in
  :mod:`tiered_kv.sim.shared_prefix`).
* Replay of a trace in one of the public formats of
  :mod:`tiered_kv.sim.trace_formats` (``workload.trace_format``): this
  package's JSONL, Mooncake, Azure, BurstGPT, ShareGPT; optionally sampled by
  time window or every k-th conversation (``workload.trace_sample``), then
  replayed faster or slower (``workload.trace_scale``: a speed-up, or a target
  mean rate).  A request's ``id`` (the trace's, or its line number) is carried
  by the per-request output, so its rows join back to the trace.

How the requests are *sent* (an open loop, a concurrency cap, sessions) is the
client's business: :mod:`tiered_kv.sim.client`.

Token ids are built from ranges: each piece of text (a system prompt, a user
message, an answer) gets a disjoint id range, so prefixes are shared exactly
where the workload says and nowhere else, and generation costs no per-token
random draws.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim import shared_prefix, trace_formats
from tiered_kv.sim.trace_formats import TraceRow
from tiered_kv.sim.trace_stats import mean_rate


@dataclass(slots=True)
class SimRequest:
    """One request of a workload.

    The prompt is ``prompt`` (token ids), or, when ``hashes`` is set, prefix
    hashes at ``hash_block_size`` tokens each standing for ``hashed_len`` tokens
    (``prompt`` is then empty: nothing is tokenized).  :attr:`prompt_len` is the
    prompt's length either way.
    """

    rid: int
    arrival: float
    prompt: Sequence[int]
    output: Sequence[int]  # the tokens the model "samples", in order
    conversation: int = -1
    turn: int = 0
    id: Hashable = None  # the trace's id of a replayed request (None: a generated one, known by rid)
    hashes: tuple[int, ...] | None = None
    hash_block_size: int = 0
    hashed_len: int = 0
    queued: float = 0.0  # seconds the client held it, ready, before sending it (a concurrency cap)

    @property
    def prompt_len(self) -> int:
        return self.hashed_len if self.hashes is not None else len(self.prompt)


class _Ids:
    """Disjoint token-id ranges (ids grow without bound; the simulator never embeds them)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        return list(self.span(n))

    def span(self, n: int) -> range:
        """The next ``n`` ids as a range: a sequence that holds no per-token objects."""
        out = range(self.next, self.next + n)
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
    clipped: int = max(spec["min"], min(spec["max"], n))  # the schema's bounds are ints
    return clipped


def _arrivals(spec: dict[str, Any], n: int, rng: random.Random) -> list[float]:
    rate = spec["rate"]
    out: list[float] = []
    t = 0.0
    if math.isinf(rate):  # every request at once, and no random draw (the lengths stay those of any rate)
        return [0.0] * n
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


def _sampled_rows(spec: dict[str, Any]) -> list[TraceRow]:
    """The rows of a validated ``workload`` section's trace, sampled as ``trace_sample`` says, at their own times."""
    trace = trace_formats.read(Path(spec["trace"]), spec["trace_format"], spec["arrival"]["rate"])
    smp = spec["trace_sample"]
    window = None if smp["window_s"] is None else (float(smp["window_s"][0]), float(smp["window_s"][1]))
    if window is None and smp["every"] == 1:
        return trace.rows
    rows = trace_formats.sample(trace.rows, window, smp["every"])
    if not rows:
        raise ConfigError(f"workload.trace_sample: keeps no request of '{trace.path}' ({len(trace.rows)} requests)")
    return rows


def replay_speedup(spec: dict[str, Any], rows: list[TraceRow]) -> float:
    """What ``workload.trace_scale`` divides every arrival time of the sampled ``rows`` by (inf: all at 0).

    ``speedup: x`` is ``x``; ``rate: r`` is what makes the mean rate, (requests - 1)
    / (last arrival - first arrival), ``r``; neither is 1 (the trace's own times).
    """
    scale = spec["trace_scale"]
    speedup: float | None = scale["speedup"]
    rate: float | None = scale["rate"]
    if speedup is not None:
        return speedup
    if rate is None or math.isinf(rate):
        return 1.0 if rate is None else math.inf
    own = mean_rate([r.arrival for r in rows])
    if own == 0.0:
        raise ConfigError(
            f"workload.trace_scale.rate: the {len(rows)} replayed request(s) of '{spec['trace']}' arrive at one "
            "time, so they have no rate to scale; give arrival times that differ, or trace_scale.speedup"
        )
    return rate / own


def trace_rows(spec: dict[str, Any]) -> list[TraceRow]:
    """The rows of a validated ``workload`` section's trace: sampled (``trace_sample``), then scaled (``trace_scale``).

    With ``think_s``, the rows must hold a conversation of more than one turn
    (else there is no session to time).
    """
    rows = _sampled_rows(spec)
    x = replay_speedup(spec, rows)
    if x != 1.0:
        rows = [replace(r, arrival=r.arrival / x) for r in rows]
    if spec["think_s"] is not None:
        turns: dict[int, int] = {}
        for r in rows:
            if r.conversation >= 0:
                turns[r.conversation] = turns.get(r.conversation, 0) + 1
        if not any(n > 1 for n in turns.values()):
            raise ConfigError(
                f"workload.think_s: the replayed requests of '{spec['trace']}' hold no conversation of more "
                f"than one turn ({spec['trace_format']} traces say a request's conversation "
                f"{trace_formats.CONVERSATIONS[spec['trace_format']]}), so there is no next turn to time; "
                "leave think_s out"
            )
    return rows


def scale_text(spec: dict[str, Any]) -> str:
    """How the arrivals are timed when that is not the workload's own clock (for the run's first line), or ``""``."""
    if spec["trace"] is None:
        return "every request ready at 0 (arrival.rate: .inf)" if math.isinf(spec["arrival"]["rate"]) else ""
    scale = spec["trace_scale"]
    if scale["speedup"] is None and scale["rate"] is None:
        return ""
    rows = _sampled_rows(spec)
    x = replay_speedup(spec, rows)
    if math.isinf(x):
        return "every trace request ready at 0 (trace_scale: .inf)"
    own = mean_rate([r.arrival for r in rows])
    how = f"{x:.4g}x faster" if x >= 1.0 else f"{1 / x:.4g}x slower"
    return f"trace replayed {how} (mean {own:.4g} -> {own * x:.4g} requests/s)"


def check_load(spec: dict[str, Any]) -> None:
    """Refuse ``workload`` settings that contradict each other (each key alone was checked by the schema).

    Raises:
        ConfigError: naming the key.
    """
    scale = spec["trace_scale"]
    times = {
        "arrival.rate": spec["arrival"]["rate"],
        "trace_scale.speedup": scale["speedup"],
        "trace_scale.rate": scale["rate"],
    }
    at_once = [k for k, v in times.items() if v is not None and math.isinf(v)]
    if at_once and spec["concurrency"] is None:
        # Every request at 0 with nothing to hold them back is one burst, not a rate: a mistake, unless a
        # concurrency cap makes it the closed loop of vllm bench serve's default --request-rate inf.
        raise ConfigError(
            f"workload.{at_once[0]}: must be a finite number, got inf (.inf, every request ready at 0, "
            "is a load only with workload.concurrency: N, a closed loop of N requests in flight)"
        )
    given = [k for k in ("speedup", "rate") if scale[k] is not None]
    if given and spec["trace"] is None:
        raise ConfigError(
            f"workload.trace_scale.{given[0]}: scales a replayed trace's times, but workload.trace is not set "
            "(a synthetic workload's load is workload.arrival.rate)"
        )
    if len(given) == 2:
        raise ConfigError(
            "workload.trace_scale: give speedup (x times faster) or rate (a mean rate), not both: "
            "either one alone sets the time scale"
        )
    mt = spec["multi_turn"]
    if spec["think_s"] is not None and spec["trace"] is None and (mt["prob"] == 0 or mt["max_turns"] < 2):
        raise ConfigError(
            "workload.think_s: times a conversation's next turn, but this synthetic workload has no next turns "
            f"(workload.multi_turn.prob: {mt['prob']:g}, max_turns: {mt['max_turns']}); set multi_turn.prob > 0 "
            "and max_turns >= 2, or leave think_s out"
        )


def generate(spec: dict[str, Any], seed: int) -> list[SimRequest]:
    """Requests of a validated ``workload`` config section, deterministic in ``seed``."""
    if spec.get("shared_prefix") is not None:
        return shared_prefix.generate(spec["shared_prefix"])
    if spec["trace"]:
        return from_rows(trace_rows(spec))
    rng = random.Random(seed)
    ids = _Ids()
    n = spec["num_requests"]
    arrivals = _arrivals(spec["arrival"], n, rng)
    sp = spec["system_prompts"]
    systems = [ids.take(sp["length"]) for _ in range(sp["count"])]
    weights = [1.0 / (k + 1) ** sp["zipf"] for k in range(sp["count"])]  # Zipf popularity
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


def load_trace(path: Path, fmt: str = "jsonl", rate: float = 1.0) -> list[SimRequest]:
    """Replay a trace file of format ``fmt`` (default: this package's JSONL layout).

    See :mod:`tiered_kv.sim.trace_formats` for the formats and their checks.
    """
    return from_rows(trace_formats.read(Path(path), fmt, rate).rows)


def from_rows(rows: list[TraceRow]) -> list[SimRequest]:
    """The requests of validated trace rows, in arrival order.

    A row with prefix hashes keeps them as they are (its prompt is never
    expanded into tokens); a row with only a length gets fresh token ids, shared
    with no other request.  Outputs are ranges of fresh ids (no per-token objects)
    unless a later request resends them (ShareGPT), when they are the row's own.
    """
    ids = _Ids()
    out: list[SimRequest] = []
    for r in rows:
        if r.hash_ids is not None:
            prompt: Sequence[int] = []
        elif r.prompt_tokens is not None:
            prompt = list(r.prompt_tokens)
        else:
            prompt = ids.take(r.prompt_len)
        output: Sequence[int] = list(r.output_tokens) if r.output_tokens is not None else ids.span(r.output_len)
        out.append(
            SimRequest(len(out), r.arrival, prompt, output, r.conversation, r.turn, r.id, r.hash_ids,
                       r.hash_block_size, r.prompt_len)
        )  # fmt: skip
    out.sort(key=lambda r: (r.arrival, r.rid))
    return out


@dataclass(frozen=True, slots=True)
class WorkloadSize:
    """How big a workload will be, known before it is built.

    Attributes:
        requests: Number of requests.
        tokens: Prompt + output tokens over all requests (expected value for a synthetic workload).
        longest: Tokens of the longest possible request (prompt + output).
        longest_key: Where that request comes from (``workload.prompt_len`` or ``workload.trace line N``).
    """

    requests: int
    tokens: int
    longest: int
    longest_key: str


def _mean_length(spec: dict[str, Any]) -> float:
    m = {"fixed": spec["value"], "uniform": (spec["low"] + spec["high"]) / 2, "lognormal": spec["mean"]}[spec["dist"]]
    mean: float = max(spec["min"], min(spec["max"], m))
    return mean


def max_length(spec: dict[str, Any]) -> int:
    """The longest length a validated length spec can produce."""
    top = {"fixed": spec["value"], "uniform": spec["high"], "lognormal": spec["max"]}[spec["dist"]]
    longest: int = min(top, spec["max"])
    return longest


def longest_synthetic(spec: dict[str, Any]) -> int:
    """Tokens of the longest request a synthetic ``workload`` section can produce.

    A conversation resends every earlier turn; the system prompt is sent once.
    """
    if spec.get("shared_prefix") is not None:
        sp = shared_prefix.parse(spec["shared_prefix"])
        return shared_prefix.prompt_len(sp) + int(sp["output_len"])
    turns = spec["multi_turn"]["max_turns"] if spec["multi_turn"]["prob"] > 0 else 1
    longest = turns * (max_length(spec["prompt_len"]) + max_length(spec["output_len"]))
    return longest + (spec["system_prompts"]["length"] if spec["system_prompts"]["count"] else 0)


def size(spec: dict[str, Any]) -> WorkloadSize:
    """The size of a validated ``workload`` section without generating it (a trace is read, not built)."""
    if spec.get("shared_prefix") is not None:
        n, longest = shared_prefix.num_requests(spec["shared_prefix"]), longest_synthetic(spec)
        return WorkloadSize(n, n * longest, longest, "workload.shared_prefix")
    if spec["trace"]:
        rows = trace_rows(spec)
        big = max(rows, key=lambda r: r.prompt_len + r.output_len)
        return WorkloadSize(
            len(rows),
            sum(r.prompt_len + r.output_len for r in rows),
            big.prompt_len + big.output_len,
            f"workload.trace line {big.line}",
        )
    sp, mt = spec["system_prompts"], spec["multi_turn"]
    turn = _mean_length(spec["prompt_len"]) + _mean_length(spec["output_len"])
    system = sp["length"] * sp["share"] if sp["count"] else 0.0
    turns = mt["max_turns"] if mt["prob"] > 0 else 1
    # A follow-up resends the conversation so far: on average about half of the other turns.
    per_request = turn + system + mt["prob"] * (turns - 1) / 2 * turn
    n = spec["num_requests"]
    return WorkloadSize(n, math.ceil(n * per_request), longest_synthetic(spec), "workload.prompt_len")
