"""Why a preemption took its mode, as one label from a small fixed set.

A :class:`~tiered_kv.manager.outcomes.Decision` explains itself in words for
people (costs included); a metric needs a label with few values.  The label is
derived from the decision's structured fields (the instruction, the mode taken
and the quote), not parsed from its words, so rewording a reason cannot move a
count.  The branches follow :meth:`~tiered_kv.manager.pricing.Quote.choose` and
the manager's "nothing computed yet" override; the tests drive a real manager
into every branch and check label and words agree.
"""

from __future__ import annotations

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.outcomes import Decision
from tiered_kv.manager.states import PreemptMode

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
