"""Request states under the tier manager, and preemption modes."""

from __future__ import annotations

import enum


class RequestState(str, enum.Enum):
    """Where a request's KV lives.

    ``RUNNING`` (GPU) -> ``SWAPPING_OUT`` -> ``SWAPPED`` (CPU) -> ``SWAPPING_IN`` -> ``RUNNING``;
    ``RUNNING`` -> ``PREEMPTED`` (to recompute; re-admitted with ``admit``);
    any settled state -> ``FINISHED``.  ``SWAPPING_IN`` also covers onboarding CPU
    prefix hits of a newly admitted request.  The two ``SWAPPING_*`` states are
    in flight: nothing may free or preempt the request until the plan settles.
    """

    RUNNING = "running"
    SWAPPING_OUT = "swapping_out"
    SWAPPED = "swapped"
    SWAPPING_IN = "swapping_in"
    PREEMPTED = "preempted"
    FINISHED = "finished"


IN_FLIGHT = frozenset({RequestState.SWAPPING_OUT, RequestState.SWAPPING_IN})


class PreemptMode(str, enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


MODES = ("swap", "recompute", "auto")
