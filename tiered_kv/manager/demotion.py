"""Moving blocks down the chain of tiers: write-through after a store, write-back ahead of eviction.

Every I/O engine moves bytes between the CPU tier and its own medium, so a
block goes down from the CPU tier in one move, and from a tier below it in two:
staged into the CPU tier, then demoted from there.  A block staged only to pass
through is dropped from the CPU tier once it is below (it was cold where it
came from).  Its passage may still evict a block from the CPU tier (one held
below: write-back keeps the CPU tier's oldest blocks held there), which costs
hit rate, not data; that is the price of I/O engines that all stage through
the CPU tier.

A demotion that fails (a full disk, a server that is down) is not tried again
for :data:`RETRY_POLLS` polls, so a broken tier costs one failed attempt per
block now and then, not one per poll, and a drain at the end of a run ends.
Nothing is lost by a failed demotion: the block stays where it was.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from tiered_kv.manager.transfers import Transfer
from tiered_kv.tiers.chain import Move, TierChain
from tiered_kv.tiers.cpu_store import CPUStore
from tiered_kv.tiers.store import Key
from tiered_kv.transfer.plan import PlanKind

RETRY_POLLS = 64


@dataclass(slots=True, eq=False)
class Hop:
    """The payload of one move of the chain in flight.

    Attributes:
        move: The chain's reservation.
        job: The request load it stages for (``None`` for a demotion).
        offset: Position of the move's first block in that load's prefix.
        origin: The tier the blocks are being demoted from (for a demotion).
        then: For a block passing through the CPU tier: the tier to demote it to once staged.
        transit: The blocks were staged only to pass through the CPU tier (drop them there after).
    """

    move: Move
    job: Any = None  # a tier_moves.Job (mypyc's dataclasses cannot annotate a field with `object`)
    offset: int = 0
    origin: int = 0
    then: int | None = None
    transit: bool = False


Submit = Callable[[Hop, PlanKind, Hashable | None, bool], Transfer]


class Demoter:
    """Decides what goes down the chain, and starts it; :meth:`settled` continues two-step demotions."""

    def __init__(self, chain: TierChain, store: CPUStore, submit: Submit) -> None:
        self.chain = chain
        self.store = store
        self.submit = submit
        self.polls = 0
        self._retry_at: list[dict[Key, int]] = [{} for _ in chain.stores]  # per origin tier: key -> poll
        self._passing: set[Key] = set()  # staged into the CPU tier on their way down, not demoted yet

    def tick(self, stored_on_cpu: Sequence[Key]) -> None:
        """One poll: write-through of what the CPU tier just stored, then every write-back tier's due blocks."""
        self.polls += 1
        if stored_on_cpu:
            self._down(0, self.chain.after_store(0, stored_on_cpu))
        for tier, policy in enumerate(self.chain.policies):
            if policy.demote == "write_through":  # write-back finds its failures again by itself
                again = self._backed_off(tier)
                if again:
                    self._down(tier, self.chain.after_store(tier, again))
            elif policy.demote == "write_back" and policy.writeback_reserve:
                self._down(tier, self.chain.writeback_due(tier))

    def _backed_off(self, tier: int) -> list[Key]:
        """Keys whose demotion from ``tier`` failed and whose back-off has run out, still held there."""
        retry, store = self._retry_at[tier], self.chain.stores[tier]
        due = [k for k, at in retry.items() if at <= self.polls]
        for key in due:
            del retry[key]
        return [k for k in due if store.is_ready(k)]

    def _eligible(self, tier: int, keys: Sequence[Key]) -> list[Key]:
        retry = self._retry_at[tier]
        if retry:
            store = self.chain.stores[tier]
            for key in [k for k, at in retry.items() if at <= self.polls or not store.contains(k)]:
                del retry[key]
        return [k for k in keys if k not in retry and k not in self._passing]

    def _down(self, tier: int, keys: Sequence[Key]) -> None:
        keys = self._eligible(tier, keys)
        if not keys:
            return
        if tier == 0:
            self._start(self.chain.demote(0, self._fit(keys, tier + 1)), 0)
            return
        # From below the CPU: what the CPU tier still holds goes down from there; the rest is staged first.
        on_cpu = [k for k in keys if self.store.is_ready(k)]
        if on_cpu:
            self._start(self.chain.demote(0, self._fit(on_cpu, tier + 1), dst=tier + 1), tier)
        rest = [k for k in keys if not self.store.contains(k)]
        if rest:
            self._start(self.chain.stage(self._fit(rest, 0), tier), tier, then=tier + 1)

    def _fit(self, keys: list[Key], tier: int) -> list[Key]:
        """The first (oldest) ``keys`` that ``tier`` has room for now: a store is all or nothing."""
        return keys[: max(self.chain.stores[tier].room_for(keys), 0)]

    def _start(self, move: Move | None, origin: int, then: int | None = None, transit: bool = False) -> None:
        if move is None:  # no room now (or nothing fitted): write-back asks again next poll
            return
        if not move.keys:
            self.chain.finish(move, [])
            return
        if then is not None:
            self._passing.update(move.keys)
        self.submit(Hop(move, origin=origin, then=then, transit=transit), PlanKind.OFFLOAD, None, False)

    def settled(self, hop: Hop, landed: list[Key]) -> None:
        """A demotion's move was finished: note failures, take the next step of a two-step demotion."""
        move = hop.move
        ok = set(landed)
        for key in move.keys:
            if key not in ok:
                self._retry_at[hop.origin][key] = self.polls + RETRY_POLLS
        if hop.then is not None:  # staged on the way down: now demote from the CPU tier
            self._passing.difference_update(move.keys)
            demote = self.chain.demote(0, self._fit(landed, hop.then), dst=hop.then) if landed else None
            if demote is None:
                self._drop_passing(landed)
            self._start(demote, hop.origin, transit=True)
            return
        if hop.transit:
            self._drop_passing(list(move.keys))
        below = move.dst + 1
        if landed and below < len(self.chain.stores) and self.chain.policies[move.dst].demote == "write_through":
            on_cpu = [k for k in self.chain.after_store(move.dst, landed) if self.store.is_ready(k)]
            if on_cpu:
                self._start(self.chain.demote(0, self._fit(on_cpu, below), dst=below), move.dst)

    def _drop_passing(self, keys: list[Key]) -> None:
        """Drop blocks that only passed through the CPU tier, unless something reads them now."""
        store = self.store
        idle = [k for k in keys if store.is_ready(k) and store.num_loads(k) == 0]
        if idle:
            store.remove(idle)
