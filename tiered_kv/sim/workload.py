"""Synthetic and replayed workloads.

* Arrivals: Poisson, bursty (bursts arriving as a Poisson process) or fixed spacing.
* Prompt and output lengths: fixed, uniform or lognormal (clipped).
* Shared system prompts picked with Zipf popularity.
* Multi-turn conversations: a follow-up resends the whole previous turn
  (prompt + answer) plus a new user message, arriving a think time after
  the previous turn's arrival.
* Replay of a JSONL trace: one object per line with ``arrival`` (seconds),
  ``prompt_tokens`` (a list) or ``prompt_len``, ``output_len``, and an
  optional ``id`` (a string or an integer; default: the line number) that the
  per-request output carries, so its rows join back to the trace; every
  field is checked (types, finite arrival times) with its line number.

Token ids are built from ranges: each piece of text (a system prompt, a user
message, an answer) gets a disjoint id range, so prefixes are shared exactly
where the workload says and nowhere else, and generation costs no per-token
random draws.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.files import read_text


@dataclass(slots=True)
class SimRequest:
    rid: int
    arrival: float
    prompt: list[int]
    output: list[int]  # the tokens the model "samples", in order
    conversation: int = -1
    turn: int = 0
    id: Hashable = None  # the trace's id of a replayed request (None: a generated one, known by rid)


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
        return _from_rows(read_trace(Path(spec["trace"])))
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


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One validated line of a trace; ``prompt_tokens`` is None when the line gave only ``prompt_len``."""

    line: int
    arrival: float
    prompt_len: int
    output_len: int
    prompt_tokens: list[int] | None
    id: Hashable = None


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list"}


def _describe(v: Any) -> str:
    """A JSON value as a trace's author wrote it: ``string "12"``, ``number 5``, ``null``."""
    kind = _JSON_TYPES.get(type(v), "object")
    if v is None:
        return kind
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return f"{kind} {text[:40]}"


def _count(v: Any, where: str, key: str) -> int:
    """A token count: a JSON integer (or an integral number such as ``1e3``) >= 1."""
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{where}: '{key}' must be an integer >= 1, got {_describe(v)}")
    if v < 1:
        raise ConfigError(f"{where}: '{key}' must be an integer >= 1, got {v}")
    return int(v)


def _arrival(v: Any, where: str) -> float:
    """An arrival time in seconds: a finite number >= 0 (a NaN would stall the simulated clock)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{where}: 'arrival' must be a number of seconds >= 0, got {_describe(v)}")
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: 'arrival' must be a finite number of seconds >= 0, got {v}")
    return float(v)


def _tokens(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise ConfigError(f"{where}: 'prompt_tokens' must be a non-empty list of token ids, got {_describe(v)}")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ConfigError(f"{where}: 'prompt_tokens' must hold integers >= 0, got {_describe(t)}")
    return v


def read_trace(path: Path) -> list[TraceRow]:
    """Read and validate a JSONL trace without building its requests (cheap to size up first).

    Each line is an object with ``arrival`` (seconds, finite, >= 0),
    ``output_len`` (>= 1) and either ``prompt_tokens`` (a list of ids) or
    ``prompt_len`` (>= 1).  Anything else is reported with its line number.
    """
    text = read_text(path, "workload.trace")
    rows: list[TraceRow] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"workload.trace line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"workload.trace: line {lineno} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {_describe(row)}")
        unknown = set(row) - {"arrival", "prompt_tokens", "prompt_len", "output_len", "id"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        if "arrival" not in row or "output_len" not in row:
            raise ConfigError(f"{where}: needs numeric 'arrival' and 'output_len'")
        arrival = _arrival(row["arrival"], where)
        n_out = _count(row["output_len"], where, "output_len")
        tokens = None
        if "prompt_tokens" in row:
            tokens = _tokens(row["prompt_tokens"], where)
            n_prompt = len(tokens)
            if "prompt_len" in row and _count(row["prompt_len"], where, "prompt_len") != n_prompt:
                raise ConfigError(f"{where}: 'prompt_len' ({row['prompt_len']}) differs from len(prompt_tokens)")
        elif "prompt_len" in row:
            n_prompt = _count(row["prompt_len"], where, "prompt_len")
        else:
            raise ConfigError(f"{where}: needs 'prompt_tokens' or 'prompt_len'")
        rid = row.get("id", lineno)
        if isinstance(rid, bool) or not isinstance(rid, int | str):
            raise ConfigError(f"{where}: 'id' must be a string or an integer, got {_describe(rid)}")
        rows.append(TraceRow(lineno, arrival, n_prompt, n_out, tokens, rid))
    if not rows:
        raise ConfigError(f"workload.trace: '{path}' has no requests")
    seen: dict[Hashable, int] = {}
    for r in rows:
        if r.id in seen:
            raise ConfigError(f"workload.trace line {r.line}: 'id' {r.id!r} was already used on line {seen[r.id]}")
        seen[r.id] = r.line
    return rows


def load_trace(path: Path, seed: int = 0) -> list[SimRequest]:
    """Replay a JSONL trace (``arrival``, ``prompt_tokens`` or ``prompt_len``, ``output_len``)."""
    return _from_rows(read_trace(Path(path)))


def _from_rows(rows: list[TraceRow]) -> list[SimRequest]:
    ids = _Ids()
    out: list[SimRequest] = []
    for r in rows:
        prompt = list(r.prompt_tokens) if r.prompt_tokens is not None else ids.take(r.prompt_len)
        out.append(SimRequest(len(out), r.arrival, prompt, ids.take(r.output_len), id=r.id))
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
    return max(spec["min"], min(spec["max"], m))


def max_length(spec: dict[str, Any]) -> int:
    """The longest length a validated length spec can produce."""
    top = {"fixed": spec["value"], "uniform": spec["high"], "lognormal": spec["max"]}[spec["dist"]]
    return min(top, spec["max"])


def longest_synthetic(spec: dict[str, Any]) -> int:
    """Tokens of the longest request a synthetic ``workload`` section can produce.

    A conversation resends every earlier turn; the system prompt is sent once.
    """
    turns = spec["multi_turn"]["max_turns"] if spec["multi_turn"]["prob"] > 0 else 1
    longest = turns * (max_length(spec["prompt_len"]) + max_length(spec["output_len"]))
    return longest + (spec["system_prompts"]["length"] if spec["system_prompts"]["count"] else 0)


def size(spec: dict[str, Any]) -> WorkloadSize:
    """The size of a validated ``workload`` section without generating it (a trace is read, not built)."""
    if spec["trace"]:
        rows = read_trace(Path(spec["trace"]))
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
