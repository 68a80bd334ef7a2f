"""Per-request records of a simulation, and their JSONL rows (``tiered-kv simulate --requests``).

One row per request, in arrival order::

    {"id": ..., "rid": 0, "arrival": 0.0, "admitted": 0.0, "first_token": 1.0, "finish": 2.0,
     "prompt_tokens": 4, "output_tokens": 2, "preemptions_swap": 0, "preemptions_recompute": 0,
     "swap_out_bytes": 0, "swap_in_bytes": 0, "onboard_bytes": 0, "recomputed_tokens": 0}

``id`` is the request's id in a replayed trace (its ``id`` field, else its
line number), or the generated request's index: rows join back to the trace
by it.  Times are simulated seconds; a request that never got that far has
``null``.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
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

    def row(self) -> dict[str, Any]:
        def t(x: float) -> float | None:
            return round(x, 9) if x >= 0 else None

        return {
            "id": self.id,
            "rid": self.rid,
            "arrival": round(self.arrival, 9),
            "admitted": t(self.admitted),
            "first_token": t(self.first_token),
            "finish": t(self.finish),
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
