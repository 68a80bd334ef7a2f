"""The one state machine of a request's KV: where it is, and what may happen to it next.

The manager keeps each request's :class:`Residency` and moves it only by the
transitions of :data:`TRANSITIONS`, one table: for each verb, the states it
may start from and the states it may leave (``TierManager``'s ``move`` checks
every move against it).  The scheduler keeps no copy: it
reads the residency that each outcome carries (``Admission``, ``Preemption``,
``Resumption``, ``Completion``) or asks the manager (``TierManager.state``),
and its own status says only which of its queues a request is in.

``None`` stands for "no KV held": a request never admitted, freed, or open
with its KV gone (a recompute victim, a failed or cancelled onboarding, a
dropped swap), which is admitted again from scratch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Residency(str, enum.Enum):
    """Where the KV of a request the manager holds lives.

    ``GPU`` -> ``SWAPPING_OUT`` -> ``CPU`` -> ``SWAPPING_IN`` -> ``GPU``; a new
    request with prefix hits on the CPU tier starts ``LOADING`` and becomes
    ``GPU`` when they land.  The three moving states are in flight: the request
    can be neither computed, preempted, resumed nor freed until its copy settles
    (a layer-wise swap-in computes while it lands).
    """

    GPU = "gpu"
    LOADING = "loading"
    SWAPPING_OUT = "swapping_out"
    CPU = "cpu"
    SWAPPING_IN = "swapping_in"


R = Residency  # the table below reads as the diagram
IN_FLIGHT = frozenset({R.LOADING, R.SWAPPING_OUT, R.SWAPPING_IN})

TRANSITIONS: Mapping[str, Mapping[Residency | None, tuple[Residency | None, ...]]] = {
    # verb: {state it starts from: states it may leave}
    "admit": {None: (R.GPU, R.LOADING)},  # LOADING: a prefix found below the GPU is copied in
    "allocate": {R.GPU: (R.GPU,), R.SWAPPING_IN: (R.SWAPPING_IN,)},  # SWAPPING_IN: a layer-wise swap-in only
    "preempt": {R.GPU: (R.SWAPPING_OUT, R.CPU, None)},  # swap with a copy; swap with nothing to copy; recompute
    "resume": {R.CPU: (R.SWAPPING_IN, R.GPU)},  # GPU: every block still cached there
    "drop_swapped": {R.CPU: (None,)},
    # A copy settles (landed, or failed or cancelled: then the KV is where it was, or gone for a load).
    "settle": {R.LOADING: (R.GPU, None), R.SWAPPING_OUT: (R.CPU, R.GPU), R.SWAPPING_IN: (R.GPU, R.CPU)},
    "free": {None: (None,), R.GPU: (None,), R.CPU: (None,)},  # never while a copy is in flight
}
"""Every transition of a request's KV, by verb: ``TRANSITIONS[verb][state]`` are the states it may leave."""

FROM: Mapping[str, tuple[Residency, ...]] = {
    verb: tuple(s for s in table if s is not None) for verb, table in TRANSITIONS.items()
}
"""The residencies each verb starts from (a request the manager holds)."""


@dataclass(frozen=True, slots=True)
class KVState:
    """A request's state in the manager, for a scheduler: whether it is open, and where its KV is.

    Attributes:
        open: Admitted and not freed yet (``TierManager.free`` ends it once).
        residency: Where its KV is; ``None``: it holds none (never admitted,
            freed, or open with its KV gone: it is admitted again from scratch).
    """

    open: bool
    residency: Residency | None

    @property
    def in_flight(self) -> bool:
        """A copy of its KV is moving: it can be neither preempted, resumed nor freed until it settles."""
        return self.residency in IN_FLIGHT


class PreemptMode(str, enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


MODES = ("swap", "recompute", "auto")
