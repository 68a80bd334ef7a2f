"""Per-request records of a simulation, and their JSONL rows (``tiered-kv simulate --requests``).

One row per request, in arrival order::

    {"id": ..., "rid": 0, "arrival": 0.0, "client_queue": 0.0, "admitted": 0.0, "first_token": 1.0,
     "finish": 2.0, "token_times": [1.0, 2.0], "prompt_tokens": 4, "output_tokens": 2,
     "preemptions_swap": 0, "preemptions_recompute": 0, "swap_out_bytes": 0, "swap_in_bytes": 0,
     "onboard_bytes": 0, "recomputed_tokens": 0}

``id`` is the request's id in a replayed trace (its ``id`` field, else its
line number), or the generated request's index: rows join back to the trace
by it.  Times are simulated seconds; a request that never got that far has
``null``.  ``arrival`` is when the client sent the request (its time to first
token counts from there); ``client_queue`` is how long the client held it,
ready, before that (the wait for a slot under ``workload.concurrency``, 0
without).  ``token_times`` holds the time of every output token, first to
last: the first is ``first_token``, the last ``finish``, and the differences
between neighbours are the request's inter-token latencies (vLLM's client
writes the same gaps as ``itls``).  One number per output token: a long run's
file is large (about 16 bytes per output token; docs/traces.md).
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in simulated seconds, ``-1`` until it happens)."""

    rid: int
    id: Hashable
    arrival: float
    prompt_tokens: int
    admitted: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    output_tokens: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    onboard_bytes: int = 0
    recomputed_tokens: int = 0
    client_queue: float = 0.0
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled, in order
    # The simulator's own: the most tokens of the request ever computed (what is computed again
    # below it is recomputed, counted in recomputed_tokens).  Not a row's field.
    most_computed: int = 0

    def row(self) -> dict[str, Any]:
        def t(x: float) -> float | None:
            return round(x, 9) if x >= 0 else None

        return {
            "id": self.id,
            "rid": self.rid,
            "arrival": round(self.arrival, 9),
            "client_queue": round(self.client_queue, 9),
            "admitted": t(self.admitted),
            "first_token": t(self.first_token),
            "finish": t(self.finish),
            "token_times": [round(x, 9) for x in self.token_times],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "preemptions_swap": self.preemptions_swap,
            "preemptions_recompute": self.preemptions_recompute,
            "swap_out_bytes": self.swap_out_bytes,
            "swap_in_bytes": self.swap_in_bytes,
            "onboard_bytes": self.onboard_bytes,
            "recomputed_tokens": self.recomputed_tokens,
        }


def jsonl(records: Iterable[RequestRecord], extra: dict[str, Any] | None = None) -> str:
    """The rows, one JSON object per line, in arrival order (ties by request index), each with ``extra`` fields."""
    rows = sorted(records, key=lambda r: (r.arrival, r.rid))
    more = extra or {}
    return "".join(json.dumps({**r.row(), **more}, sort_keys=True) + "\n" for r in rows)
