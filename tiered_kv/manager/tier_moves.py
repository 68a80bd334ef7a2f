"""The manager's bookkeeping of moves through the tiers below the CPU: prefix loads, demotions, counters.

With tiers attached (:meth:`TierManager.attach_tiers`, a list of
:class:`~tiered_kv.tiers.lower_tier.LowerTier`), the manager orders their
stores under its CPU store into a :class:`~tiered_kv.tiers.chain.TierChain`
and admitting a request goes like this:

1. :meth:`TierMoves.find` asks the chain, for the blocks of the prefix not
   cached on the GPU, which is the highest tier holding each (the cheapest to
   load from), and :func:`~tiered_kv.manager.pricing.price_load` decides how
   many leading blocks are worth loading rather than recomputing.
2. :meth:`TierMoves.reserve` pins the blocks already on the CPU tier (so that
   staging cannot evict them) and reserves one move of the chain per run of
   blocks in one tier below it: their source is pinned there and their CPU
   slots pending.  A run the CPU tier has no room for ends the prefix.
3. :meth:`TierMoves.start` submits the moves to their tiers' I/O engines.
   The request is LOADING.
4. As each move settles (:meth:`TierMoves.settle`), what landed is pinned on
   the CPU tier; a block that did not land (missing, corrupt, an I/O error)
   ends the prefix there.  When the last one settles, the prefix up to the
   first block that did not land is copied to the GPU by the usual ONBOARD
   copy, whose completion reports the tokens loaded; the rest of the request is
   recomputed.  Nothing that was found is lost: blocks that landed beyond a
   failure stay cached on the CPU tier.

So the scheduler sees what it sees without the chain: an admission that is not
runnable, then one ONBOARD completion.  Between the two, no block is lost or
reused: the chain's moves pin their sources and keep their destinations
pending in every tier, and the load keeps its CPU blocks pinned until its GPU
copy pins them itself.  Demotions (:class:`Demoter`) run at every poll.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.core.request import Request
from tiered_kv.manager.bounded_log import DEFAULT_LOG_SIZE, BoundedLog
from tiered_kv.manager.metrics import LowerTierCounters
from tiered_kv.manager.offload import Offloader
from tiered_kv.manager.outcomes import LoadDecision
from tiered_kv.manager.pricing import CostModel, LoadQuote, price_load
from tiered_kv.manager.tier_checks import chain_of
from tiered_kv.manager.transfers import PrivateKey, Transfer, Transfers
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
    job: Any = None  # a Job (mypyc's dataclasses cannot annotate a field with `object`)
    offset: int = 0
    origin: int = 0
    then: int | None = None
    transit: bool = False


Submit = Callable[[Hop, PlanKind, Hashable | None, bool], Transfer]


class Demoter:
    """Decides what goes down the chain (write-through after a store, write-back ahead of eviction), and starts it.

    Every I/O engine moves bytes between the CPU tier and its own medium, so a
    block goes down from the CPU tier in one move, and from a tier below it in two:
    staged into the CPU tier, then demoted from there (:meth:`settled` takes that
    second step).  A block staged only to pass through is dropped from the CPU
    tier once it is below (it was cold where it came from).  Its passage may
    still evict a block from the CPU tier (one held below: write-back keeps the
    CPU tier's oldest blocks held there), which costs hit rate, not data; that
    is the price of I/O engines that all stage through the CPU tier.

    A demotion that fails (a full disk, a server that is down) is not tried again
    for :data:`RETRY_POLLS` polls, so a broken tier costs one failed attempt per
    block now and then, not one per poll, and a drain at the end of a run ends.
    Nothing is lost by a failed demotion: the block stays where it was.
    """

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


@dataclass(slots=True)
class Found:
    """What admission found below the GPU (nothing reserved yet).

    Attributes:
        keys / tiers: The leading blocks worth loading, and the tier each comes from.
        found: The tier of every block of the prefix the chain holds.
        quote: The load quote (``None`` when nothing could be loaded).
    """

    request: Request
    keys: list[Key]
    tiers: list[int]
    found: tuple[int, ...]
    quote: LoadQuote | None


@dataclass(slots=True)
class Reserved:
    """A load reserved at admission: its blocks, their CPU pins, and a staging move per run below the CPU."""

    found: Found
    keys: list[Key]
    pinned: list[Key]
    moves: list[tuple[int, Move]]  # (position of the run's first block, its move)


@dataclass(slots=True, eq=False)
class Job:
    """One request's load while its blocks are staged into the CPU tier.

    Attributes:
        keys: The prefix to load; ``dst`` the request's GPU blocks for it.
        context_tokens: Tokens before it (cached on the GPU).
        good: Leading blocks of ``keys`` that are (or may still be) on the CPU tier.
        pinned: Keys this load pins on the CPU tier.
        waiting: Staging moves not settled yet.
    """

    request: Request
    keys: list[Key]
    dst: list[KVCacheBlock]
    context_tokens: int
    good: int
    waiting: int
    pinned: list[Key] = field(default_factory=list)


class TierMoves:
    """The chain of stores below the CPU tier, wired to the manager's CPU store, copies and counters.

    Args:
        tiers: As :meth:`TierManager.attach_tiers` (checked here, before anything changes).
        store: The manager's CPU store (the chain's tier 0).
        transfers: The manager's copies in flight (moves of the chain go there too).
        offloader: Starts the CPU -> GPU copy of a staged prefix.
        cost_model: Prices loads.
    """

    def __init__(
        self,
        tiers: object,
        store: CPUStore,
        transfers: Transfers,
        offloader: Offloader,
        cost_model: CostModel,
        log_size: int | None = DEFAULT_LOG_SIZE,
    ) -> None:
        self.chain, self.engines, self.links = chain_of(tiers, store)
        self.store = store
        self.transfers = transfers
        self.offloader = offloader
        self.cost_model = cost_model
        self.block_size = cost_model.block_size
        self.media = tuple(s.medium for s in self.chain.stores)
        self.counters = {m: LowerTierCounters() for m in self.media[1:]}
        self.lost_blocks = 0
        self.decisions: BoundedLog[LoadDecision] = BoundedLog(log_size)  # the latest; the rest are counted
        self.demoter = Demoter(self.chain, store, self._submit)
        self._jobs: dict[Hashable, Job] = {}
        store.enable_events = True  # its stores feed write-through, its evictions the count of blocks lost

    # ------------------------------------------------------------ admission
    def find(self, request: Request, start_block: int, context_tokens: int) -> Found:
        """The prefix after the GPU hits that the tiers hold, and how much of it is worth loading."""
        last = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        keys: list[Hashable] = list(request.block_hashes[start_block:last])
        found = tuple(self.chain.lookup(keys).tiers) if keys else ()
        n = len(found)
        for i, tier in enumerate(found):
            if tier and self.store.contains(keys[i]):  # pending on the CPU tier: its bytes are still arriving
                n = i
                break
        if not n:
            return Found(request, [], [], found, None)
        media = [self.media[t] for t in found[:n]]
        links = [self.links[m] if t else None for m, t in zip(media, found[:n], strict=True)]
        quote = price_load(self.cost_model, request.request_id, media, links, context_tokens, request.num_tokens)
        k = quote.num_blocks
        return Found(request, keys[:k], list(found[:k]), found, quote)

    def reserve(self, found: Found) -> Reserved:
        """Pin the CPU-tier blocks of the load and reserve a staging move per run below; count the lookup.

        Call it once admission is sure to fit on the GPU: the pins and moves
        are taken now.  The load may come out shorter than ``found.keys``.
        """
        keys, tiers = found.keys, found.tiers
        on_cpu = [k for k, t in zip(keys, tiers, strict=True) if t == 0]
        if on_cpu:
            self.store.prepare_load(on_cpu)  # before any staging, which could otherwise evict them
        moves: list[tuple[int, Move]] = []
        n, i = len(keys), 0
        while i < n:
            j = i
            while j < n and tiers[j] == tiers[i]:
                j += 1
            if tiers[i]:
                move = self.chain.stage(keys[i:j], tiers[i])
                if move is None:  # the CPU tier has no room for them: load what comes before
                    n = j = i
                    break
                assert list(move.keys) == keys[i:j], "a staged block was already on the CPU tier"
                moves.append((i, move))
            i = j
        beyond = [k for k, t in zip(keys[n:], tiers[n:], strict=True) if t == 0]
        if beyond:
            self.store.complete_load(beyond)
        out = Reserved(found, keys[:n], [k for k, t in zip(keys[:n], tiers[:n], strict=True) if t == 0], moves)
        self._count_admission(out)
        return out

    def _count_admission(self, r: Reserved) -> None:
        f = r.found
        for pos, tier in enumerate(f.found):
            if tier:
                c = self.counters[self.media[tier]]
                c.hit_blocks += 1
                c.declined_blocks += pos >= len(r.keys)
        if f.quote is not None and (f.quote.num_declined or any(f.found)):
            reason = f.quote.reason
            if len(r.keys) < len(f.keys):
                reason += f"; only {len(r.keys)} set to load: the CPU tier had no room to stage the rest"
            self.decisions.append(LoadDecision(f.request.request_id, f.quote, len(r.keys), reason))

    def start(self, r: Reserved, dst: list[KVCacheBlock], context_tokens: int) -> tuple[Transfer, bool]:
        """Start a reserved load into ``dst``: its first copy, and whether that one stages (not the GPU copy)."""
        req = r.found.request
        job = Job(req, r.keys, dst, context_tokens, len(r.keys), len(r.moves), list(r.pinned))
        if not r.moves:
            t = self._copy_to_gpu(job)
            assert t is not None, "a load of blocks all on the CPU tier copies them"
            return t, False
        self._jobs[req.request_id] = job
        first = [self._submit(Hop(m, job, offset=pos), PlanKind.ONBOARD, req.request_id, True) for pos, m in r.moves]
        return first[0], True

    def _submit(self, hop: Hop, kind: PlanKind, request_id: Hashable | None, urgent: bool) -> Transfer:
        move = hop.move
        medium = self.media[max(move.src, move.dst)]  # every move is between the CPU tier and one medium
        src, dst = move.src_spec, move.dst_spec
        plan = self.transfers.plan(src.medium, dst.medium, src.block_ids, dst.block_ids, kind, request_id, urgent)
        return self.transfers.start(plan, payload=hop, engine=self.engines[medium])

    # ------------------------------------------------------------ settling
    @staticmethod
    def owns(t: Transfer) -> bool:
        """Whether a copy in flight is a move of the chain."""
        return isinstance(t.payload, Hop)

    def settle(self, t: Transfer) -> tuple[Hashable, Transfer | None] | None:
        """Finish a move of the chain.

        Returns:
            ``(request id, its GPU copy or None)`` when this was the last staging
            move of a request's load (``None``: nothing landed, nothing to copy);
            else ``None``.
        """
        hop: Hop = t.payload
        landed = self.chain.finish_handle(hop.move, t.handle)
        self._count_move(hop.move, landed)
        job = hop.job
        if not isinstance(job, Job):
            self.demoter.settled(hop, landed)
            return None
        if landed:
            self.store.prepare_load(landed)  # held until the GPU copy pins them itself
            job.pinned.extend(landed)
        ok = set(landed)
        failed = next((i for i, k in enumerate(hop.move.keys) if k not in ok), None)
        if failed is not None:
            job.good = min(job.good, hop.offset + failed)
        job.waiting -= 1
        if job.waiting:
            return None
        del self._jobs[job.request.request_id]
        return job.request.request_id, self._copy_to_gpu(job)

    def _copy_to_gpu(self, job: Job) -> Transfer | None:
        keys = job.keys[: job.good]
        t = None
        if keys:
            upto = job.context_tokens + len(keys) * self.block_size
            t = self.offloader.start_load(job.request, keys, job.dst[: len(keys)], upto)
        if job.pinned:
            self.store.complete_load(job.pinned)  # the GPU copy pins what it reads; the rest stays cached
        return t

    def _count_move(self, move: Move, landed: list[Key]) -> None:
        failed = len(move.keys) - len(landed)
        c = self.counters[self.media[max(move.src, move.dst)]]  # every move is between the CPU tier and one medium
        if move.dst == 0:
            c.loaded_blocks += len(landed)
            c.load_failed_blocks += failed
        else:
            c.stored_blocks += len(landed)
            c.store_failed_blocks += failed

    # ------------------------------------------------------------ every poll
    def tick(self) -> None:
        """Count what the CPU tier lost, then start the demotions that are due."""
        stored: list[Key] = []
        evicted: list[Key] = []
        for ev in self.store.take_events():
            if ev.removed:
                # Per key, so `.__class__ is`, not type(): 109 against 160 ns per check (timeit, CPython 3.11).
                evicted.extend(k for k in ev.keys if k.__class__ is not PrivateKey)
            else:
                stored.extend(ev.keys)
        if evicted:
            # A key can be evicted, stored again and evicted again between two polls: each eviction counts.
            lost = set(self.chain.only_copies(0, list(dict.fromkeys(evicted))))
            self.lost_blocks += sum(k in lost for k in evicted)
        self.demoter.tick(stored)

    # ------------------------------------------------------------ audit
    def cpu_pins(self) -> dict[Key, int]:
        """Pins this layer holds on the CPU store, per key (loads being staged, moves out of the CPU tier)."""
        pins = Counter(k for job in self._jobs.values() for k in job.pinned)
        for t in self.transfers:
            if isinstance(t.payload, Hop) and t.payload.move.src == 0:
                pins.update(t.payload.move.keys)
        return pins

    def check_invariants(self) -> None:
        """The chain's invariants, and every staged load's moves and pins."""
        self.chain.check_invariants()
        hops = [t.payload for t in self.transfers if isinstance(t.payload, Hop)]
        for rid, job in self._jobs.items():
            assert job.waiting == sum(1 for h in hops if h.job is job), f"request {rid!r}: staging moves lost"
            assert all(self.store.is_ready(k) for k in job.pinned), f"request {rid!r}: a pinned block is not ready"
            assert len(job.dst) == len(job.keys) and job.good <= len(job.keys), f"request {rid!r}: load out of shape"
