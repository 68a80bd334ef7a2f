"""A workload kind: shared system prompts recycled at constant rates (inference-perf's ``shared_prefix``).

The load of the measured vLLM runs in ``configs/validation/`` (inference-perf's
shared-prefix data with constant-rate stages)::

    workload:
      shared_prefix:
        systems: 9              # n_sys system prompts ...
        users_per_system: 5     # ... each shared by n_users prompts: 45 distinct prompts
        system_len: 100         # tokens of a system prompt
        question_len: 447       # tokens of each prompt's own question, after its system prompt
        output_len: 248         # every request generates exactly this many tokens (ignore_eos)
        stages: [[2.5, 600], [6.0, 600]]   # [requests/s, seconds], back to back

Prompt ``p`` (``0 <= p < systems x users_per_system``) is system prompt ``p //
users_per_system`` followed by question ``p`` of its own; request ``j`` sends
prompt ``j mod (systems x users_per_system)``, so every prompt recurs and,
once it has been computed, the prefix cache holds all of it but its last
partial block.  Within a stage of rate ``r`` the arrivals are exactly ``1 /
r`` apart, from the stage's start; the next stage starts when the previous
one's duration is over.  ``workload.num_requests`` does not apply: the stages
say how many requests there are (``round(rate x duration)`` each).

Token ids come from disjoint ranges (as :mod:`~tiered_kv.sim.workload` makes
them), so prompts share exactly their system prompt and nothing else; the
requests of one prompt share its token list.

That default is the simplest reading of the client.  inference-perf itself
(kubernetes-sigs/inference-perf, ``datagen/shared_prefix_datagen.py`` and
``loadgen/load_generator.py`` since its shared-prefix generator, #98, and its
multi-stage runs) sends otherwise, and which prompts come back when decides
whether a tier below the GPU finds them; five keys say so (each off by default):

* ``order: shuffled``: the generator shuffles its list of prompts once, at the
  start (``random.shuffle``), so consecutive requests rarely share a system
  prompt: request ``j`` sends entry ``j`` of a permutation drawn with ``seed``.
  With ``grouped`` (the default) the ``users_per_system`` prompts of a system
  prompt go one after the other, and a GPU prefix cache of one system prompt
  finds them all;
* ``restart_each_stage: true``: every stage asks the generator anew
  (``self.datagen.get_data()`` in each stage), so each stage sends the list from
  its start again, and a stage re-sends the prompts the stages before it sent;
* ``arrival``: ``even`` (the default) sends exactly ``1 / rate`` apart.
  inference-perf's two timers draw their times: ``constant`` is its
  ``ConstantLoadTimer`` (``int(rate x duration)`` exponential gaps of mean ``1 /
  rate``, scaled to sum to the stage's duration: as random as a Poisson process,
  with the count fixed; since #157, 2025-08-20, and unscaled exponential gaps
  before it), ``poisson`` its ``PoissonLoadTimer`` (for each second a count drawn
  from a Poisson law of mean ``rate``, spread over that second by exponential gaps
  scaled to sum to one second, until the stage's requests are placed);
* ``stage_gap_s: S``: the next stage starts ``S`` seconds after the previous
  stage's duration is over (inference-perf waits until the stage's last request
  has finished, then ``load.interval`` seconds; choose ``S`` longer than the
  slowest stage's drain: an idle server changes no cache);
* ``replicas: N`` and ``replica: k``: the client's load is spread over ``N``
  servers by a prefix-aware router that sends every prompt of system prompt
  ``s`` to server ``s mod N``; the simulation is server ``k``'s share (its
  requests at their own times; the others are not built).
"""

from __future__ import annotations

import math
import random
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.schema import REQUIRED, Field, choice, integer, non_negative, num, positive, validate

SCHEMA: dict[str, Any] = {
    "systems": integer(REQUIRED, positive),
    "users_per_system": integer(REQUIRED, positive),
    "system_len": integer(REQUIRED, non_negative),
    "question_len": integer(REQUIRED, positive),
    "output_len": integer(REQUIRED, positive),
    "stages": Field((list,)),
    "order": choice("grouped", "grouped", "shuffled"),
    "restart_each_stage": Field((bool,), False),
    "arrival": choice("even", "even", "constant", "poisson"),
    "stage_gap_s": num(0.0, non_negative),
    "replicas": integer(1, positive),
    "replica": integer(0, non_negative),
    "seed": integer(0, non_negative),
}
KEY = "workload.shared_prefix"


def parse(raw: Any, key: str = KEY) -> dict[str, Any]:
    """A validated ``shared_prefix`` section: every key checked and named; stages as ``(rate, seconds)`` floats."""
    spec = validate(raw, SCHEMA, key)
    stages = spec["stages"]
    if not stages:
        raise ConfigError(f"{key}.stages: must list at least one [rate, duration] stage")
    out = []
    for i, st in enumerate(stages):
        ok = (
            isinstance(st, list | tuple)
            and len(st) == 2
            and all(not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) for v in st)
            and st[0] > 0
            and st[1] > 0
        )
        if not ok:
            raise ConfigError(f"{key}.stages[{i}]: must be [rate in requests/s > 0, duration in s > 0], got {st!r}")
        out.append((float(st[0]), float(st[1])))
    spec["stages"] = out
    if spec["replica"] >= spec["replicas"]:
        raise ConfigError(
            f"{key}.replica: must be below replicas ({spec['replicas']}): servers are numbered 0 to "
            f"{spec['replicas'] - 1}, got {spec['replica']}"
        )
    return spec


def check(raw: Any) -> str | None:
    """The schema's check of ``workload.shared_prefix``: refuses with the key's path (raises ConfigError)."""
    parse(raw)
    return None


def arrivals(stages: list[tuple[float, float]]) -> list[float]:
    """Send times of every request: ``1 / rate`` apart within a stage, stages back to back."""
    out: list[float] = []
    start = 0.0
    for rate, seconds in stages:
        n = round(rate * seconds)
        out.extend(start + k / rate for k in range(n))
        start += seconds
    return out


def stage_starts(stages: list[tuple[float, float]], gap_s: float = 0.0) -> list[float]:
    """When each stage starts: the previous one's start, plus its duration, plus ``gap_s``."""
    out, start = [], 0.0
    for _, seconds in stages:
        out.append(start)
        start += seconds + gap_s
    return out


def stage_of(t: float, stages: list[tuple[float, float]], gap_s: float = 0.0) -> int:
    """The index of the stage a request sent at ``t`` belongs to (the last one for ``t`` past the end).

    With ``gap_s`` the stages are that far apart (``stage_gap_s``): a request belongs to the last
    stage that started at or before ``t`` (a Poisson stage's last requests may fall after its
    duration).
    """
    if gap_s == 0.0:
        start = 0.0
        for i, (_, seconds) in enumerate(stages):
            start += seconds
            if t < start - 1e-9:
                return i
        return len(stages) - 1
    starts = stage_starts(stages, gap_s)
    return max(i for i, s in enumerate(starts) if s <= t + 1e-9 or i == 0)


def _poisson_count(rate: float, rng: random.Random) -> int:
    """Events of a Poisson process of ``rate`` in one second (exponential gaps; exact for any rate)."""
    n, t = 0, rng.expovariate(rate)
    while t < 1.0:
        n += 1
        t += rng.expovariate(rate)
    return n


def poisson_times(rate: float, n: int, start: float, rng: random.Random) -> list[float]:
    """``n`` send times from ``start`` as inference-perf's ``PoissonLoadTimer`` makes them.

    Each second draws a Poisson count of mean ``rate``; an empty second is skipped; otherwise the
    count's exponential gaps are scaled to sum to exactly that second (its ``ConstantLoadTimer(count,
    1.0)``), so the second's last request falls on its end.
    """
    out: list[float] = []
    t = start
    while len(out) < n:
        count = _poisson_count(rate, rng)
        if count < 1:
            t += 1.0
            continue
        gaps = [rng.expovariate(float(count)) for _ in range(count)]
        scale = 1.0 / sum(gaps)
        for g in gaps:
            t += g * scale
            out.append(t)
    return out[:n]


def constant_times(rate: float, seconds: float, n: int, start: float, rng: random.Random) -> list[float]:
    """``n`` send times from ``start`` as inference-perf's ``ConstantLoadTimer`` makes them.

    ``n`` exponential gaps of mean ``1 / rate``, scaled so that they sum to ``seconds``: the first
    request one gap after the stage starts, the last on its end.
    """
    gaps = [rng.expovariate(rate) for _ in range(n)]
    scale = seconds / sum(gaps) if gaps else 0.0
    out, t = [], start
    for g in gaps:
        t += g * scale
        out.append(t)
    return out


def schedule(spec: dict[str, Any]) -> list[tuple[float, int]]:
    """``(send time, prompt)`` of every request this server gets, in send order (a parsed section).

    Draws (with ``spec['seed']``) the prompt order when ``order`` is ``shuffled`` and then the
    send times when ``arrival`` is ``constant`` or ``poisson``; nothing at random otherwise.
    """
    rng = random.Random(spec["seed"])
    n_prompts = spec["systems"] * spec["users_per_system"]
    order = list(range(n_prompts))
    if spec["order"] == "shuffled":
        rng.shuffle(order)
    users, replicas, mine = spec["users_per_system"], spec["replicas"], spec["replica"]
    out: list[tuple[float, int]] = []
    j = 0
    for start, (rate, seconds) in zip(stage_starts(spec["stages"], spec["stage_gap_s"]), spec["stages"], strict=True):
        n = round(rate * seconds)
        if spec["arrival"] == "poisson":
            times = poisson_times(rate, n, start, rng)
        elif spec["arrival"] == "constant":
            times = constant_times(rate, seconds, n, start, rng)
        else:
            times = [start + k / rate for k in range(n)]
        if spec["restart_each_stage"]:
            j = 0
        for t in times:
            p = order[j % n_prompts]
            j += 1
            if (p // users) % replicas == mine:
                out.append((t, p))
    return out


def prompt_len(spec: dict[str, Any]) -> int:
    return int(spec["system_len"] + spec["question_len"])


def generate(raw: Any) -> list[Any]:
    """The requests of a ``shared_prefix`` section (deterministic: its draws are seeded by its ``seed``)."""
    from tiered_kv.sim.workload import SimRequest

    spec = parse(raw)
    users, replicas, mine = spec["users_per_system"], spec["replicas"], spec["replica"]
    next_id = 1

    def span(n: int) -> range:
        nonlocal next_id
        out = range(next_id, next_id + n)
        next_id += n
        return out

    # Only this server's system prompts are built (with one server, all of them, in order).
    systems = {s: list(span(spec["system_len"])) for s in range(spec["systems"]) if s % replicas == mine}
    prompts = {
        p: systems[p // users] + list(span(spec["question_len"]))
        for p in range(spec["systems"] * users)
        if p // users in systems
    }
    out_len = spec["output_len"]
    return [SimRequest(j, t, prompts[p], span(out_len), conversation=p) for j, (t, p) in enumerate(schedule(spec))]


def num_requests(raw: Any) -> int:
    spec = parse(raw)
    defaults = spec["replicas"] == 1 and spec["arrival"] == "even"
    return sum(round(rate * seconds) for rate, seconds in spec["stages"]) if defaults else len(schedule(spec))
