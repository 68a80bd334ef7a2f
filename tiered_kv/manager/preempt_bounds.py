"""Lower bounds of the cost-aware preemption key, kept incrementally, so a ranking prices few requests.

The cost-aware policy ranks running requests by the time a preemption loses
per GPU block it frees, ``Quote.cost(mode) / Quote.blocks_freed``.  Pricing one
request exactly scans its block table (the blocks it alone holds, those the CPU
tier lacks, their runs); at hundreds of running requests, pricing every one at
each decision costs more than the rest of a scheduler step.  Best-first ranking
(:meth:`~tiered_kv.manager.victim_policy.VictimPolicy.iter_rank`) prices only the
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

import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.kv_cache_manager import KVCacheManager
from tiered_kv.core.request import Request
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.pricing import Quote
from tiered_kv.manager.swap import Swapper


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

    def free_table(self, request: Request) -> None:
        """Free the request's GPU table (``KVCacheManager.free``) and report the release."""
        blocks = self.gpu.get_blocks(request.request_id)  # the live list: the pool's free leaves it as it is
        self.forget(request.request_id)
        self.gpu.free(request)
        if blocks:
            self.released(blocks)

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
