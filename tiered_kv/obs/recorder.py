"""Readings: everything an exporter shows, taken at one instant by the thread that drives the scheduler.

The tier manager and the scheduler are single-threaded (a second thread
entering the manager is an error), while an HTTP exporter answers on threads
of its own.  So the driver takes a :class:`Reading` at a step boundary, an
immutable value, and exporters only ever read the latest one: a scrape never
touches the manager, and every number in one scrape comes from the same
instant.  vLLM's engine does the same: its scheduler makes stats each step and
the Prometheus logger records them.

Sources of truth: ``sched.tm.metrics()`` (the manager's counters and gauges),
``Scheduler.tokens_recomputed``, the scheduler's request statuses, the
manager's decision log (preemptions by mode and reason) and the copies the
scheduler applies (latency per kind, observed through
``Scheduler.completion_observers``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.metrics import MetricsSnapshot
from tiered_kv.manager.outcomes import Completion, Decision
from tiered_kv.manager.states import PreemptMode, Residency
from tiered_kv.sched.scheduler import Scheduler
from tiered_kv.sched.status import RequestStatus
from tiered_kv.transfer.plan import PlanKind

# Upper bounds (seconds) of the copy-latency buckets, 1-2.5-5 per decade: from a few blocks over
# NVLink-class links (~10 us) to a multi-GiB swap over a slow link (seconds).
LATENCY_BUCKETS_S: tuple[float, ...] = (*(float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 2.5, 5)), 10.0)
# Kinds the manager emits (PlanKind.COPY is for benchmarks and tests only).
COPY_KINDS: tuple[str, ...] = tuple(
    k.value for k in (PlanKind.SWAP_OUT, PlanKind.SWAP_IN, PlanKind.ONBOARD, PlanKind.OFFLOAD)
)


# Every label decision_reason can return, with the mode(s) it goes with.
REASONS: dict[str, tuple[PreemptMode, ...]] = {
    "swap_cheaper": (PreemptMode.SWAP,),  # auto: swapping out and back in was estimated cheaper
    "recompute_cheaper": (PreemptMode.RECOMPUTE,),  # auto: recomputing was estimated no dearer
    "cpu_full": (PreemptMode.RECOMPUTE,),  # a swap was wanted or possible, but the CPU tier had no room
    "no_cpu_tier": (PreemptMode.RECOMPUTE,),  # there is no tier to swap to
    "nothing_computed": (PreemptMode.RECOMPUTE,),  # a swap was chosen, but no token was computed yet
    "requested": (PreemptMode.SWAP, PreemptMode.RECOMPUTE),  # the caller forced the mode
}


def decision_reason(decision: Decision) -> str:
    """The label (a key of :data:`REASONS`) of why ``decision`` took its mode.

    A :class:`~tiered_kv.manager.outcomes.Decision` explains itself in words for
    people (costs included); a metric needs a label with few values.  The label
    is derived from the decision's structured fields (the instruction, the mode
    taken and the quote), not parsed from its words, so rewording a reason
    cannot move a count.  The branches follow
    :meth:`~tiered_kv.manager.pricing.Quote.choose` and the manager's "nothing
    computed yet" override; the tests drive a real manager into every branch
    and check label and words agree.

    Raises:
        InvalidArgumentError: not a ``Decision``, or a decision the manager
            cannot make (a chosen swap turned into a recompute although tokens
            were computed, or a forced swap that recomputed); labelling it
            anyway would hide a bug.
    """
    checks.instance("decision", decision, Decision)
    q = decision.quote
    requested = decision.requested
    if decision.mode is PreemptMode.SWAP:
        return "requested" if requested == "swap" else "swap_cheaper"
    if requested == "recompute":
        return "requested"
    # A recompute under "swap" or "auto".  The manager turns a chosen swap into a
    # recompute only when nothing is computed yet; choose() picks swap when it can
    # swap and either swap was forced or it is strictly cheaper.
    if q.can_swap and (requested == "swap" or q.swap_s < q.recompute_s):
        if q.num_tokens != 0:
            raise InvalidArgumentError(f"decision for {decision.request_id!r}: recompute although a swap was chosen")
        return "nothing_computed"
    if requested == "swap":
        raise InvalidArgumentError(
            f"decision for {decision.request_id!r}: a forced swap that could not swap recomputed"
        )
    if not q.has_cpu_tier:
        return "no_cpu_tier"
    if not q.cpu_has_room:
        return "cpu_full"
    return "recompute_cheaper"


@dataclass(frozen=True, slots=True)
class LatencyHistogram:
    """Latencies of the copies of one kind that landed.

    Attributes:
        bounds: Bucket upper bounds in seconds, increasing (``+Inf`` is implied).
        cumulative: Copies at or under each bound, then the total (one more entry than ``bounds``).
        sum_s: Sum of all latencies.
    """

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


@dataclass(frozen=True, slots=True)
class Reading:
    """Every exported number, from one instant.

    Attributes:
        snapshot: The manager's counters and gauges.
        tokens_recomputed: ``Scheduler.tokens_recomputed``.
        requests_running: Requests with status RUNNING.
        requests_waiting: WAITING plus LOADING (vLLM counts requests whose KV
            is still arriving from a connector as waiting).
        requests_swapped: SWAPPING_OUT, SWAPPED and SWAPPING_IN.
        preemptions: ``(mode, reason label) -> count``, every possible pair present.
        copy_latency: Copy kind -> latencies of the copies of that kind that landed.
    """

    snapshot: MetricsSnapshot
    tokens_recomputed: int
    requests_running: int
    requests_waiting: int
    requests_swapped: int
    preemptions: Mapping[tuple[str, str], int]
    copy_latency: Mapping[str, LatencyHistogram]


class MetricsRecorder:
    """Observes one scheduler and takes :class:`Reading` s of it.

    It subscribes to the scheduler's completions when built (latencies of
    copies applied earlier are not known to it) and reads the decision log
    incrementally.  Call :meth:`read` and :meth:`observe` from the thread that
    drives the scheduler; a :class:`Reading` may then go to any thread.

    Args:
        scheduler: The scheduler to observe.
        buckets: Latency bucket upper bounds in seconds, increasing.
    """

    def __init__(self, scheduler: Scheduler, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        checks.instance("scheduler", scheduler, Scheduler)
        if (
            not isinstance(buckets, tuple)
            or not buckets
            or any(b.__class__ not in (int, float) or not 0 < b < float("inf") for b in buckets)
            or any(a >= b for a, b in itertools.pairwise(buckets))
        ):
            raise InvalidArgumentError(
                f"buckets must be a non-empty tuple of increasing finite seconds > 0, got {checks.describe(buckets)}"
            )
        self.scheduler = scheduler
        self.buckets = buckets
        self._counts = {k: [0] * (len(buckets) + 1) for k in COPY_KINDS}
        self._sums = dict.fromkeys(COPY_KINDS, 0.0)
        self._preemptions = {(m.value, r): 0 for r, modes in REASONS.items() for m in modes}
        self._decisions_read = 0
        #: Preemption decisions that left the manager's bounded log before a read could label them.
        self.decisions_missed = 0
        scheduler.completion_observers.append(self.observe)

    def close(self) -> None:
        """Stop observing the scheduler (idempotent)."""
        observers = self.scheduler.completion_observers
        if self.observe in observers:
            observers.remove(self.observe)

    def observe(self, completion: Completion) -> None:
        """Count one applied copy: its latency, if it landed."""
        counts = self._counts.get(completion.kind.value)
        if not completion.ok or counts is None:
            return
        counts[bisect.bisect_left(self.buckets, completion.elapsed_s)] += 1
        self._sums[completion.kind.value] += completion.elapsed_s

    def read(self) -> Reading:
        """Everything, now."""
        sched = self.scheduler
        log = sched.tm.decision_log
        new, missed = log.since(self._decisions_read)
        for d in new:
            key = (d.mode.value, decision_reason(d))
            self._preemptions[key] += 1
        self.decisions_missed += missed  # fell off the log before a read: read more often, or keep more
        self._decisions_read = log.total
        running = waiting = swapped = 0
        for rid, st in sched.status.items():
            if st is RequestStatus.RUNNING:
                running += 1
            elif st is RequestStatus.WAITING:
                waiting += 1
            elif st is RequestStatus.SWAPPED:
                swapped += 1
            elif st is RequestStatus.ARRIVING:  # its prefix loading counts as waiting, its swap-in as swapped
                if sched.tm.state(rid).residency is Residency.LOADING:
                    waiting += 1
                else:
                    swapped += 1
        latency = {
            kind: LatencyHistogram(self.buckets, tuple(itertools.accumulate(counts)), self._sums[kind])
            for kind, counts in self._counts.items()
        }
        return Reading(
            snapshot=sched.tm.metrics(),
            tokens_recomputed=sched.tokens_recomputed,
            requests_running=running,
            requests_waiting=waiting,
            requests_swapped=swapped,
            preemptions=MappingProxyType(dict(self._preemptions)),
            copy_latency=MappingProxyType(latency),
        )
