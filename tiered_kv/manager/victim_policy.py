"""Victim policies: which running requests to preempt first, and the bounds that spare a ranking most prices.

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

A policy of one's own plugs in without changing the package: a
:class:`VictimPolicy` subclass, given as an instance, registered by name
(:func:`register_victim_policy`, as the CPU store's eviction policies are), or
named by its qualified class name (see :class:`VictimPolicy`).

**Bounds** (:class:`PreemptBounds`, kept by the tier manager as its tables
change).  The cost-aware policy ranks running requests by the time a preemption loses
per GPU block it frees, ``Quote.cost(mode) / Quote.blocks_freed``.  Pricing one
request exactly scans its block table (the blocks it alone holds, those the CPU
tier lacks, their runs); at hundreds of running requests, pricing every one at
each decision costs more than the rest of a scheduler step.  Best-first ranking
(:meth:`VictimPolicy.iter_rank`) prices only the
requests whose bound is below the best exact key found so far, so a bound must
be cheap and tight, and never above the exact key, or the order would change.

Per request, the counts are the ids of the blocks it alone holds (``ref_cnt
== 1``: what a preemption frees) and their runs, in table order, the same as
a quote's scan finds.  They are kept, not rescanned:

* a table only grows while it is on the GPU, so only the blocks it grew by
  are counted (another table, after a free, is scanned afresh);
* a block it held alone stops being so only when it gains a holder: a prefix
  hit at admission or resumption, or a copy's hold.  The manager reports those
  (:meth:`PreemptBounds.acquired`) and the request is scanned again when next
  asked;
* a block it shared becomes its alone only when the other holders let go: a
  freed table or a settled copy (:meth:`PreemptBounds.released`), likewise.

``check_invariants`` compares the kept counts with a fresh scan.  From them the
swap-in and recompute times of the key are exact; the swap-out is bounded from
below: the partial tail (never in the CPU tier while the request is on the
GPU), plus, at the tighter level, a few of the latest full blocks looked up,
in one run.

Exactness of the decisions is tested against pricing every request
(``tests/test_cost_aware_exact.py``).
"""

from __future__ import annotations

import heapq
import importlib
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tiered_kv import checks
from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.pricing import CostModel, Quote
from tiered_kv.manager.states import MODES
from tiered_kv.manager.transfers import Swapper

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
    """Base class: rank candidates by :meth:`key` (smallest first = preempted first).

    A policy of one's own is a subclass that defines :meth:`key` (and
    :attr:`name`).  A scheduler takes it in one of three forms, wherever a
    victim policy is named (``SchedulerConfig.victim_policy``,
    ``EngineConfig.victim_policy``, a simulator run's ``victim_policy:``):

    * an instance (``SchedulerConfig(victim_policy=MyPolicy())``; not in a
      YAML config, which holds names only);
    * a name registered with :func:`register_victim_policy`;
    * the class's qualified name, ``"package.module.ClassName"``, imported on
      first use (vLLM names its ``--scheduler-cls`` so), which also reaches
      simulator worker processes, where a registration made in the parent
      process does not exist.

    A policy built from a name gets the scheduler's cost model through
    :meth:`create`.  One instance may serve several schedulers: a policy keeps
    no state between calls (every call gets fresh candidates).
    """

    name: ClassVar[str] = "base"

    @classmethod
    def create(cls, cost_model: CostModel | None) -> VictimPolicy:
        """The policy a scheduler uses when it is named, given the tier manager's cost model.

        ``cls()`` by default; a policy that prices candidates from the cost
        model itself overrides this (as :class:`CostAwarePolicy` does).
        """
        return cls()

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

    @classmethod
    def create(cls, cost_model: CostModel | None) -> VictimPolicy:
        return cls(cost_model)

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


@dataclass(slots=True)
class _Scan:
    """A request's table as last seen: the blocks it alone holds (ids, runs) and those it shares."""

    table: list[KVCacheBlock]  # the live table: another list is another table, scanned afresh
    num_blocks: int = 0  # how much of it is counted
    freed: list[int] = field(default_factory=list)  # ids of the blocks it alone holds, in table order
    runs: int = 0  # runs of consecutive ids among them
    shared: list[int] = field(default_factory=list)  # ids of the blocks another holder has too


class PreemptBounds:
    """Per-request counts of freeable blocks, kept as tables change, and the bound of each cost-aware key."""

    def __init__(self, gpu: KVCacheManager, cost_model: CostModel) -> None:
        self.gpu = gpu
        self.cost_model = cost_model
        self._scans: dict[Hashable, _Scan] = {}
        self._solo: dict[int, Hashable] = {}  # block id -> the scanned request that alone holds it
        self._watch: dict[int, set[Hashable]] = {}  # shared block id -> scanned requests that hold it

    def stats(self, request_id: Hashable) -> _Scan:
        """The request's counts now: its table scanned once, then only what it grew by."""
        table = self.gpu.get_blocks(request_id)
        s = self._scans.get(request_id)
        if s is None or s.table is not table:
            self.forget(request_id)
            s = self._scans[request_id] = _Scan(table)
        if s.num_blocks != len(table):
            self._count(request_id, s, table)
        return s

    def _count(self, request_id: Hashable, s: _Scan, table: list[KVCacheBlock]) -> None:
        solo, watch, freed, shared = self._solo, self._watch, s.freed, s.shared
        last = freed[-1] if freed else -2
        runs = s.runs
        for b in table[s.num_blocks :]:
            bid = b.block_id
            if b.ref_cnt == 1:
                freed.append(bid)
                solo[bid] = request_id
                if bid != last + 1:
                    runs += 1
                last = bid
            else:
                shared.append(bid)
                w = watch.get(bid)
                if w is None:
                    watch[bid] = {request_id}
                else:
                    w.add(request_id)
        s.runs, s.num_blocks = runs, len(table)

    def forget(self, request_id: Hashable) -> None:
        """Drop the request's counts (its table is freed, or changed in a way that needs a new scan)."""
        s = self._scans.pop(request_id, None)
        if s is None:
            return
        solo, watch = self._solo, self._watch
        for bid in s.freed:
            if solo.get(bid) == request_id:
                del solo[bid]
        for bid in s.shared:
            w = watch.get(bid)
            if w is not None:
                w.discard(request_id)
                if not w:
                    del watch[bid]

    def acquired(self, blocks: Iterable[KVCacheBlock]) -> None:
        """GPU blocks just gained a holder: a request that held one alone no longer does."""
        solo = self._solo
        if not solo:
            return
        for b in blocks:
            rid = solo.get(b.block_id)
            if rid is not None and b.ref_cnt != 1:
                self.forget(rid)

    def released(self, blocks: Iterable[KVCacheBlock]) -> None:
        """GPU blocks just lost a holder: a request that shared one may now hold it alone."""
        watch = self._watch
        if not watch:
            return
        for b in blocks:
            if b.ref_cnt == 1 and b.block_id in watch:
                for rid in list(watch[b.block_id]):
                    self.forget(rid)

    def lower_bounds(
        self, requests: Sequence[Request], mode: str, swapper: Swapper, lookups: bool = True
    ) -> list[float]:
        """For each request on the GPU, a value never above ``quote.cost(mode) / quote.blocks_freed``.

        The blocks freed and their runs are exact, so are the swap-in and
        recompute times; only the swap-out is bounded from below (the blocks
        moved, at least what ``swapper`` finds missing among a few, or only the
        partial tail without ``lookups``; one run).  ``swapper``: the one that
        would price its swap-out (without a CPU tier nothing would move).
        """
        cm = self.cost_model
        # Per block, as the cost model prices them (a rounding apart: the policy keeps a margin).
        in_block, out_block = cm.swap_in_time(1, 0), cm.swap_out_time(1, 0)
        overhead, recompute_time = cm.per_copy_overhead_s, cm.recompute_time
        bs = self.gpu.block_size
        scans, get_blocks, stats = self._scans, self.gpu.get_blocks, self.stats
        out: list[float] = []
        for req in requests:
            rid = req.request_id
            s = scans.get(rid)
            if s is None or s.table is not (table := get_blocks(rid)) or s.num_blocks != len(table):
                s = stats(rid)
            n = len(s.freed)
            if n == 0:
                out.append(math.inf)
                continue
            n_tok = req.num_computed_tokens
            rec = recompute_time(n_tok) / n
            if mode == "recompute":
                out.append(rec)
                continue
            if not swapper.has_tier:
                moved = 0
            elif lookups:
                moved = swapper.moved_at_least(req, n_tok)
            else:
                moved = 1 if n_tok % bs else 0  # the partial tail (see Swapper.moved_at_least)
            swap = in_block + ((moved * out_block + overhead if moved else 0.0) + s.runs * overhead) / n
            out.append(swap if mode == "swap" else min(swap, rec))
        return out

    def check(self) -> None:
        """Assert that every request's counts are those a fresh scan of its table finds."""
        for rid, s in self._scans.items():
            table = self.gpu.get_blocks(rid)
            if s.table is not table:
                continue  # stale: scanned afresh when next asked
            fresh = _Scan(table)
            PreemptBounds(self.gpu, self.cost_model)._count(rid, fresh, table[: s.num_blocks])
            assert (fresh.freed, fresh.runs) == (s.freed, s.runs), (
                f"request {rid!r}: kept counts {len(s.freed)} blocks freed in {s.runs} runs, "
                f"its table has {len(fresh.freed)} in {fresh.runs}"
            )


class CandidatePrices:
    """A victim ranking's prices and bounds of requests on the GPU, by id (what ``Candidate`` calls lazily).

    The manager builds one per ranking over requests it has checked are on
    the GPU, so the policy's calls go here and on down (the swapper, these
    bounds), never back up into the manager that asked for the ranking.
    """

    __slots__ = ("_requests", "_swap", "_bounds", "_cost_model")

    def __init__(
        self, requests: dict[Hashable, Request], swap: Swapper, bounds: PreemptBounds, cost_model: CostModel
    ) -> None:
        self._requests, self._swap, self._bounds, self._cost_model = requests, swap, bounds, cost_model

    def quote(self, request_id: Hashable) -> Quote:
        """What preempting the request would cost (``TierManager.quote``)."""
        return self._swap.quote(self._requests[request_id], self._cost_model)

    def lower_bounds(self, request_ids: Sequence[Hashable], mode: str, lookups: bool) -> list[float]:
        """Lower bounds of the cost-aware key (``TierManager.preemption_bounds``)."""
        return self._bounds.lower_bounds([self._requests[r] for r in request_ids], mode, self._swap, lookups)


VICTIM_POLICIES: dict[str, type[VictimPolicy]] = {
    cls.name: cls for cls in (LastAdmittedPolicy, LargestPolicy, PrefillAwarePolicy, CostAwarePolicy)
}
"""The victim policies by name: the built-in ones and those :func:`register_victim_policy` added."""

RENAMED_VICTIM_POLICIES = {"lru": "last_admitted"}
"""Victim policy names that were renamed, old -> new: refused with the new name, never aliased."""


def register_victim_policy(name: str, cls: type[VictimPolicy]) -> None:
    """Register a policy of one's own under ``name``, so that every config can name it.

    ``SchedulerConfig(victim_policy=name)``, ``EngineConfig(victim_policy=name)``
    and a simulator run's ``victim_policy: name`` then build it with
    ``cls.create(cost_model)`` (see :class:`VictimPolicy`).  A registration
    lives in the process that made it: simulator workers (``--workers``) are
    new processes, so name the class by its qualified name there.

    Raises:
        InvalidArgumentError: ``name`` is not a non-empty str without dots
            (a dotted name is a qualified class name), is taken (or is a
            retired name), or ``cls`` is not a :class:`VictimPolicy` subclass.
            Nothing is registered then.
    """
    if type(name) is not str or not name or "." in name:
        raise InvalidArgumentError(
            f"name must be a non-empty str without dots (a dotted name is a qualified class name), "
            f"got {checks.describe(name)}"
        )
    if not (isinstance(cls, type) and issubclass(cls, VictimPolicy)) or cls is VictimPolicy:
        raise InvalidArgumentError(f"cls must be a subclass of VictimPolicy, got {checks.describe(cls)}")
    if name in VICTIM_POLICIES or name in RENAMED_VICTIM_POLICIES:
        taken = "is already registered" if name in VICTIM_POLICIES else "is a retired name, refused in configs"
        raise InvalidArgumentError(f"victim policy {name!r} {taken}; register yours under another name")
    VICTIM_POLICIES[name] = cls


def _qualified(name: str) -> type[VictimPolicy] | str:
    """The class a qualified name ``package.module.ClassName`` names, or why it names none."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        return f"cannot import module {module_name!r} for victim policy {name!r}: {e}"
    found = getattr(module, attr, None)
    if not (isinstance(found, type) and issubclass(found, VictimPolicy)) or found is VictimPolicy:
        return f"{name} is not a subclass of VictimPolicy, got {checks.describe(found)}"
    return found


def victim_policy_class(name: object) -> type[VictimPolicy] | str:
    """The policy class ``name`` stands for, or a message saying why it stands for none.

    ``name`` is a registered name or a qualified class name (see
    :class:`VictimPolicy`).  The message names the registered policies, or a
    retired name's new name.
    """
    if not isinstance(name, str):
        return f"must be a victim policy name or a VictimPolicy instance, got {checks.describe(name)}"
    cls = VICTIM_POLICIES.get(name)
    if cls is not None:
        return cls
    if "." in name:
        return _qualified(name)
    return f"unknown victim policy {name!r}; {renamed_victim_policy_hint(name)}"


def check_victim_policy(field: str, policy: object) -> None:
    """Raise :class:`InvalidArgumentError` naming ``field`` unless ``policy`` is a policy, or names one."""
    if isinstance(policy, VictimPolicy):
        return
    found = victim_policy_class(policy)
    if isinstance(found, str):
        raise InvalidArgumentError(f"{field}: {found}")


def get_victim_policy(policy: str | VictimPolicy, cost_model: CostModel | None = None) -> VictimPolicy:
    """The policy itself if it is an instance, else the one ``policy`` names, built with ``cost_model``.

    Raises:
        InvalidArgumentError: ``policy`` is neither a :class:`VictimPolicy` nor
            a name of one (see :class:`VictimPolicy`).
    """
    if isinstance(policy, VictimPolicy):
        return policy
    found = victim_policy_class(policy)
    if isinstance(found, str):
        raise InvalidArgumentError(f"victim_policy: {found}")
    return found.create(cost_model)


def renamed_victim_policy_hint(name: object) -> str:
    """What to write instead of an unknown victim policy ``name``: its new name, or the choices."""
    new = RENAMED_VICTIM_POLICIES.get(name) if isinstance(name, str) else None
    if new is not None:
        return f"it is now called {new!r} (the last admitted goes first, vLLM's order; it is not LRU)"
    return (
        f"the victim policies are {sorted(VICTIM_POLICIES)} (a policy of your own: a VictimPolicy instance, "
        "a name given to register_victim_policy, or its class's qualified name, package.module.ClassName)"
    )


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
