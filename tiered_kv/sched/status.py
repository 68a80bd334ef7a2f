"""A request's scheduling status, owned by the scheduler alone: which of its queues the request is in."""

from __future__ import annotations

import enum


class RequestStatus(str, enum.Enum):
    """Which queue a request is in, as the scheduler sees it; never where its KV is.

    ``WAITING`` (new, or preempted to recompute: no computed tokens) ->
    ``RUNNING`` -> ``SWAPPED`` (preempted by swap) -> ``RUNNING`` ->
    ``FINISHED``; ``ARRIVING`` is admitted or resumed with its KV still
    landing (it holds a seat, and is in no queue).  Where the KV is, and
    whether a copy moves it, is the manager's one state machine
    (:mod:`tiered_kv.manager.states`): a SWAPPED request's KV is leaving or on
    the CPU tier, an ARRIVING one's is loading or swapping in, and
    ``TierManager.state`` says which.
    """

    WAITING = "waiting"
    ARRIVING = "arriving"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
