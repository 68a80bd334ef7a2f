"""Where a request's KV lives (the manager's fact), and the preemption modes.

A request's *scheduling* status (waiting, running, preempted, ...) belongs to
the scheduler; the manager only knows where the KV it holds for a request is,
and whether a copy is moving it.  A request the manager holds nothing for
(new, finished, or preempted to recompute) has no residency at all.
"""

from __future__ import annotations

import enum


class Residency(str, enum.Enum):
    """Where the KV of a request the manager holds lives.

    ``GPU`` -> ``SWAPPING_OUT`` -> ``CPU`` -> ``SWAPPING_IN`` -> ``GPU``; a new
    request with prefix hits on the CPU tier starts ``LOADING`` and becomes
    ``GPU`` when they land.  The three moving states are in flight: the request
    can be neither computed, preempted, resumed nor freed until its copy settles.
    """

    GPU = "gpu"
    LOADING = "loading"
    SWAPPING_OUT = "swapping_out"
    CPU = "cpu"
    SWAPPING_IN = "swapping_in"


IN_FLIGHT = frozenset({Residency.LOADING, Residency.SWAPPING_OUT, Residency.SWAPPING_IN})


class PreemptMode(str, enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


MODES = ("swap", "recompute", "auto")
