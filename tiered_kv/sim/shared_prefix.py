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
"""

from __future__ import annotations

import math
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.schema import REQUIRED, Field, integer, non_negative, positive, validate

SCHEMA: dict[str, Any] = {
    "systems": integer(REQUIRED, positive),
    "users_per_system": integer(REQUIRED, positive),
    "system_len": integer(REQUIRED, non_negative),
    "question_len": integer(REQUIRED, positive),
    "output_len": integer(REQUIRED, positive),
    "stages": Field((list,)),
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


def stage_of(t: float, stages: list[tuple[float, float]]) -> int:
    """The index of the stage a request sent at ``t`` belongs to (the last one for ``t`` past the end)."""
    start = 0.0
    for i, (_, seconds) in enumerate(stages):
        start += seconds
        if t < start - 1e-9:
            return i
    return len(stages) - 1


def prompt_len(spec: dict[str, Any]) -> int:
    return int(spec["system_len"] + spec["question_len"])


def generate(raw: Any) -> list[Any]:
    """The requests of a ``shared_prefix`` section (deterministic: it draws nothing at random)."""
    from tiered_kv.sim.workload import SimRequest

    spec = parse(raw)
    n_prompts = spec["systems"] * spec["users_per_system"]
    next_id = 1

    def span(n: int) -> range:
        nonlocal next_id
        out = range(next_id, next_id + n)
        next_id += n
        return out

    systems = [list(span(spec["system_len"])) for _ in range(spec["systems"])]
    prompts = [systems[p // spec["users_per_system"]] + list(span(spec["question_len"])) for p in range(n_prompts)]
    out_len = spec["output_len"]
    return [
        SimRequest(j, t, prompts[j % n_prompts], span(out_len), conversation=j % n_prompts)
        for j, t in enumerate(arrivals(spec["stages"]))
    ]


def num_requests(raw: Any) -> int:
    return sum(round(rate * seconds) for rate, seconds in parse(raw)["stages"])
