"""Victim policies: which running requests to preempt first.

Each policy is a small class with a sort key over :class:`Candidate` records;
one shared contract test runs against all of them (tests/test_victim_policy.py).
Keys end with the candidate's ``rank``, which is unique, so the order is total
and ties break deterministically.

``rank`` is the scheduler's own preemption order, vLLM v1's rule: with FCFS
scheduling the last request of the running queue goes first (the latest
admitted), with priority scheduling the request with the largest
``(priority, arrival_time)``.  A higher rank is preempted first.  The
``last_admitted`` policy is exactly that order; the others re-rank by size, prefill progress or
cost and fall back to it on ties.

Policies choose *who*; the mode (swap or recompute) of each victim is chosen
from its :class:`~tiered_kv.manager.pricing.Quote` when it is preempted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.pricing import Quote
from tiered_kv.manager.states import MODES

Bounds = Callable[[Sequence[Hashable], str, bool], list[float]]
"""``bounds(request_ids, mode, lookups)``: lower bounds of each request's cost-aware key."""

Key = tuple[Any, ...]
"""A policy's ranking key: compared as tuples, smallest preempted first (entries differ by policy)."""


@dataclass(slots=True, eq=False, repr=False)
class Candidate:
    """What a policy may know about a running request.  The quote is priced lazily, once.

    Attributes:
        request_id: Identity.
        rank: The scheduler's preemption order (higher = preempted first; unique).
        num_gpu_blocks: Blocks in its GPU table (an upper bound of what it frees).
        num_computed_tokens / num_prompt_tokens: Progress (a snapshot the
            policies read; the request's own count belongs to the scheduler).
        price: Prices the request (called once, by :attr:`quote`, when a policy first needs it).
        bounds: The pricing manager's ``preemption_bounds``, where it offers
            them: cheap lower bounds of the cost-aware key that let the
            ranking price a few candidates instead of all (``None``: a bound
            from the table size is used).
    """

    request_id: Hashable
    rank: int
    num_gpu_blocks: int
    num_computed_tokens: int
    num_prompt_tokens: int
    price: Callable[[Hashable], Quote]
    bounds: Bounds | None = None
    _quote: Quote | None = field(default=None, init=False)

    @property
    def quote(self) -> Quote:
        if self._quote is None:
            self._quote = self.price(self.request_id)
        return self._quote

    @property
    def is_prefilling(self) -> bool:
        """In the middle of its prefill: part of the prompt computed, not all of it."""
        return self.num_computed_tokens < self.num_prompt_tokens

    def __repr__(self) -> str:
        return f"Candidate({self.request_id!r}, rank={self.rank}, blocks={self.num_gpu_blocks})"


class VictimPolicy:
    """Base class: rank candidates by :meth:`key` (smallest first = preempted first)."""

    name: ClassVar[str] = "base"

    def key(self, c: Candidate, mode: str) -> Key:
        raise NotImplementedError

    def lower_key(self, c: Candidate, mode: str) -> Key | None:
        """Optional cheap bound with ``lower_key(c) <= key(c)``; enables best-first ranking."""
        return None

    def bound_keys(
        self, candidates: Sequence[Candidate], mode: str
    ) -> tuple[list[Key], Callable[[int], Key] | None] | None:
        """Bounds for best-first ranking, or ``None`` (no bound: every candidate is keyed).

        Returns the :meth:`lower_key` of every candidate, and optionally a
        tighter bound of candidate ``i`` (at most its key, dearer than the
        first), which a policy may offer where the first is loose.
        """
        if self.lower_key(candidates[0], mode) is None:
            return None
        bounds = [self.lower_key(c, mode) for c in candidates]
        assert None not in bounds, "a policy's bound exists for every candidate or for none"
        return bounds, None  # type: ignore[return-value]

    def iter_rank(self, candidates: Sequence[Candidate], mode: str) -> Iterator[Candidate]:
        """Candidates in preemption order, pricing only as many as the caller consumes (where the key allows)."""
        checks.choice("mode", mode, MODES)
        bounded = self.bound_keys(candidates, mode) if candidates else None
        if bounded is None:
            yield from sorted(candidates, key=lambda c: self.key(c, mode))
            return
        lower, tighter = bounded
        # Best first over levels: a candidate enters the heap with its cheap bound, which is replaced by
        # its tighter bound (where the policy has one), then by its exact key, each time it comes to the
        # top.  Every value is at most the candidate's exact key, so an exact key on top is no larger than
        # any other candidate's: it is final.  Exact keys are unique (they end with the rank).
        last = 1 if tighter is None else 2
        heap = [(b, 0, i) for i, b in enumerate(lower)]
        heapq.heapify(heap)
        while heap:
            _, level, i = heap[0]
            if level == last:
                heapq.heappop(heap)
                yield candidates[i]
            elif level + 1 == last:
                heapq.heapreplace(heap, (self.key(candidates[i], mode), last, i))
            else:
                heapq.heapreplace(heap, (tighter(i), level + 1, i))  # type: ignore[misc]

    def rank(self, candidates: Sequence[Candidate], mode: str) -> list[Candidate]:
        return list(self.iter_rank(candidates, mode))


class LastAdmittedPolicy(VictimPolicy):
    """vLLM v1's order: the last request of the running queue (or the lowest priority) first.

    Not least-recently-used: every running request is used every step, so the
    order is by admission (or priority), the latest admitted first.
    """

    name: ClassVar[str] = "last_admitted"

    def key(self, c: Candidate, mode: str) -> Key:
        return (-c.rank,)


class LargestPolicy(VictimPolicy):
    """Most GPU blocks first: frees the most memory per preemption."""

    name: ClassVar[str] = "largest"

    def key(self, c: Candidate, mode: str) -> Key:
        return (-c.num_gpu_blocks, -c.rank)


class PrefillAwarePolicy(VictimPolicy):
    """Avoid requests mid-prefill; among the rest, put the least work at risk.

    A request in the middle of a chunked prefill has paid for part of its
    prompt and produced no token yet, so it goes last.  Within each group the
    request with the least computed work goes first.
    """

    name: ClassVar[str] = "prefill_aware"

    def key(self, c: Candidate, mode: str) -> Key:
        return (c.is_prefilling, c.num_computed_tokens, -c.rank)


class CostAwarePolicy(VictimPolicy):
    """Least time lost per GPU block freed, with the mode its quote chooses."""

    name: ClassVar[str] = "cost_aware"

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost_model = cost_model  # enables the cheap lower bound

    def key(self, c: Candidate, mode: str) -> Key:
        q = c.quote
        per_block = q.cost(mode) / q.blocks_freed if q.blocks_freed else math.inf
        return (per_block, -c.rank)

    def lower_key(self, c: Candidate, mode: str) -> Key | None:
        """Per-block cost bound without pricing the candidate.

        It frees at most ``num_gpu_blocks`` blocks, and every block a swap
        frees comes back in at full bandwidth at best, so per block: swap >=
        one block's bytes in (not out: blocks the CPU tier holds already are
        not copied out again); recompute >= its whole recompute time / table
        size.  A 1-tuple sorts before any longer tuple with the same first
        element.
        """
        cm = self.cost_model
        if cm is None:
            return None
        n_max = c.num_gpu_blocks
        if n_max == 0:
            return (math.inf,)
        swap = cm.swap_in_time(1, 0)
        rec = cm.recompute_time(c.num_computed_tokens) / n_max
        bound = swap if mode == "swap" else rec if mode == "recompute" else min(swap, rec)
        return (bound * _ROUNDING,)

    def bound_keys(
        self, candidates: Sequence[Candidate], mode: str
    ) -> tuple[list[Key], Callable[[int], Key] | None] | None:
        """Bounds from the tier manager that prices the candidates, where it offers them; else :meth:`lower_key`.

        A manager keeps each request's freeable blocks and their runs as its
        tables change (:meth:`~tiered_kv.manager.TierManager.preemption_bounds`),
        so its bound is far tighter than one from the table size, for a
        fraction of a quote.  Its first bound looks nothing up in the CPU tier;
        the tighter one looks up a few of the request's latest blocks.
        """
        if self.cost_model is None:
            return None
        bounds = _bounds_of(candidates)
        if bounds is None:
            return super().bound_keys(candidates, mode)
        lower = [(b * _ROUNDING,) for b in bounds([c.request_id for c in candidates], mode, False)]
        return lower, lambda i: (bounds([candidates[i].request_id], mode, True)[0] * _ROUNDING,)


_ROUNDING = 1 - 1e-9  # a bound computed another way round must never exceed the exact key by a rounding


def _bounds_of(candidates: Sequence[Candidate]) -> Bounds | None:
    """The ``preemption_bounds`` that every candidate names, if they all name the same one."""
    bounds = candidates[0].bounds
    return bounds if bounds is not None and all(c.bounds == bounds for c in candidates) else None


VICTIM_POLICIES: dict[str, type[VictimPolicy]] = {
    cls.name: cls for cls in (LastAdmittedPolicy, LargestPolicy, PrefillAwarePolicy, CostAwarePolicy)
}


def get_victim_policy(policy: str | VictimPolicy, cost_model: CostModel | None = None) -> VictimPolicy:
    """A policy by name (``cost_aware`` gets ``cost_model`` for its bound) or the instance itself."""
    if isinstance(policy, VictimPolicy):
        return policy
    if policy.__class__ is not str:
        raise InvalidArgumentError(
            f"victim_policy must be a policy name or a VictimPolicy, got {checks.describe(policy)}"
        )
    cls = VICTIM_POLICIES.get(policy)
    if cls is None:
        raise InvalidArgumentError(f"unknown victim policy {policy!r}; {renamed_victim_policy_hint(policy)}")
    return CostAwarePolicy(cost_model) if cls is CostAwarePolicy else cls()


RENAMED_VICTIM_POLICIES = {"lru": "last_admitted"}
"""Victim policy names that were renamed, old -> new: refused with the new name, never aliased."""


def renamed_victim_policy_hint(name: object) -> str:
    """What to write instead of an unknown victim policy ``name``: its new name, or the choices."""
    new = RENAMED_VICTIM_POLICIES.get(name) if isinstance(name, str) else None
    if new is not None:
        return f"it is now called {new!r} (the last admitted goes first, vLLM's order; it is not LRU)"
    return f"the victim policies are {sorted(VICTIM_POLICIES)}"


def select_victims(
    policy: VictimPolicy,
    candidates: Sequence[Candidate],
    blocks_needed: int,
    mode: str,
    cpu_room: int,
) -> list[Candidate] | None:
    """Victims in policy order until they free ``blocks_needed`` GPU blocks; ``None`` if they cannot.

    All-or-nothing: nothing is preempted here; the caller preempts the returned
    victims in order (``TierManager.preempt``), and changes nothing on ``None``.
    A candidate that frees no block is never chosen.  Under ``mode="swap"`` a
    candidate that cannot be swapped is passed over, and the CPU blocks that
    earlier victims will take count against ``cpu_room``.
    """
    checks.count("blocks_needed", blocks_needed, 1)
    checks.count("cpu_room", cpu_room)
    chosen: list[Candidate] = []
    freed = 0
    for c in policy.iter_rank(candidates, mode):
        if freed >= blocks_needed:
            break
        q = c.quote
        if q.blocks_freed == 0:
            continue
        if mode == "swap":
            if not q.can_swap or q.cpu_blocks_needed > cpu_room:
                continue
            cpu_room -= q.cpu_blocks_needed
        chosen.append(c)
        freed += q.blocks_freed
    return chosen if freed >= blocks_needed else None
