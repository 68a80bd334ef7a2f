"""A request's scheduling status, owned by the scheduler alone."""

from __future__ import annotations

import enum


class RequestStatus(str, enum.Enum):
    """Where a request is in its life, as the scheduler sees it.

    ``WAITING`` (new, or preempted to recompute: no computed tokens) ->
    ``LOADING`` (prefix arriving from the CPU tier) -> ``RUNNING`` ->
    ``SWAPPING_OUT`` -> ``SWAPPED`` -> ``SWAPPING_IN`` -> ``RUNNING`` -> ``FINISHED``.
    The manager's :class:`~tiered_kv.manager.states.Residency` says where the
    KV is; this says what the scheduler will do with the request next.
    """

    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    SWAPPING_OUT = "swapping_out"
    SWAPPED = "swapped"
    SWAPPING_IN = "swapping_in"
    FINISHED = "finished"


MOVING = frozenset({RequestStatus.LOADING, RequestStatus.SWAPPING_OUT, RequestStatus.SWAPPING_IN})
