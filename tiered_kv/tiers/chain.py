"""The chain of tiers below the GPU: the CPU tier, then the tiers below it in order (disk, remote, ...).

The chain orders the stores (tier 0 is the highest: the CPU tier, the staging
area of every load) and keeps the two-sided bookkeeping of moving blocks
between them; it moves no bytes itself.  What it answers:

* :meth:`TierChain.lookup`: for a prefix of block keys, the longest run that
  some tier holds, and per block the *highest* tier that holds it (the
  cheapest to load from).  Each tier is asked once, about the blocks no tier
  above it holds; a remote store answers in one round trip (``probe``).
* :meth:`TierChain.stage` and :meth:`TierChain.demote`: a :class:`Move`, which
  reserves both sides at once (pins the source blocks, reserves pending
  destination slots), or ``None`` with nothing changed.  The caller turns it
  into a plan (:meth:`Move.plan`), submits it to the tier's I/O engine or copy
  engine, and hands the final handle back to :meth:`TierChain.finish_handle`,
  which commits the blocks that landed and rolls back the rest.  Between the
  two, the source blocks are pinned and the destination slots pending, so
  neither can be evicted or removed: **no block is lost while a move that
  touches it is in flight**, in any tier.
* :meth:`TierChain.writeback_due` (write-back tiers) and
  :meth:`TierChain.after_store` (write-through tiers): which blocks should go
  down a tier now, so that an eviction never drops the chain's only copy.
* :meth:`TierChain.route`: the media a block crosses to reach the GPU (a
  lower tier stages through the CPU tier unless its policy loads directly).

Write-back here is *ahead of eviction*, as an operating system's page cache
cleans pages before it needs them: the chain keeps the ``writeback_reserve``
least recent evictable blocks of a tier already held below, so the store's own
eviction (which picks least recent first) finds clean victims and never waits
for a write.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.errors import BlockStateError, InvalidArgumentError
from tiered_kv.tiers.cpu_store import CPUStore, check_keys
from tiered_kv.tiers.io_handle import BlockIOHandle, BlockOutcome
from tiered_kv.tiers.keyed_store import KeyedStore
from tiered_kv.tiers.namespace import encodable
from tiered_kv.tiers.store import Key, LoadStoreSpec
from tiered_kv.tiers.write_policy import check_write_policy
from tiered_kv.transfer.plan import GPU, PlanKind, TransferHandle, TransferPlan


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How one tier hands blocks to the tier below it, and how its blocks reach the GPU.

    Attributes:
        demote: ``"write_back"``: blocks go down before they are evicted (see
            :meth:`TierChain.writeback_due`); ``"write_through"``: blocks go down
            as soon as they are stored here (:meth:`TierChain.after_store`);
            ``"none"``: an evicted block is dropped (the last tier's only choice).
        writeback_reserve: For write-back: how many of the tier's least recent
            evictable blocks should already be held below.
        direct_load: Loads from this tier may go to the GPU directly; otherwise
            they stage through tier 0 (pinned CPU memory).
    """

    demote: str = "write_back"
    writeback_reserve: int = 16
    direct_load: bool = False

    def __post_init__(self) -> None:
        check_write_policy("TierPolicy.demote", self.demote)
        checks.count("TierPolicy.writeback_reserve", self.writeback_reserve)
        checks.flag("TierPolicy.direct_load", self.direct_load)


@dataclass(frozen=True, slots=True)
class ChainLookup:
    """The answer of :meth:`TierChain.lookup`.

    Attributes:
        tiers: For each block of the longest prefix that the chain holds, the
            index of the highest tier that holds it.
    """

    tiers: tuple[int, ...]

    @property
    def length(self) -> int:
        """Blocks of the prefix that some tier holds."""
        return len(self.tiers)

    def count(self, tier: int) -> int:
        """Blocks of the prefix whose highest tier is ``tier``."""
        return self.tiers.count(tier)


@dataclass(frozen=True, slots=True)
class Move:
    """Blocks reserved for a copy from tier ``src`` to tier ``dst``: pinned there, pending here.

    Attributes:
        move_id: Unique within the chain.
        src, dst: Tier indices.
        keys: The blocks to copy (the destination's ``keys_to_store``), in order.
        src_spec, dst_spec: Their slots in each tier, in the order of ``keys``.
        evicted: What the destination evicted to make room.
    """

    move_id: int
    src: int
    dst: int
    keys: tuple[Key, ...]
    src_spec: LoadStoreSpec
    dst_spec: LoadStoreSpec
    evicted: tuple[Key, ...]

    def plan(self, plan_id: int, kind: PlanKind = PlanKind.COPY, urgent: bool = False) -> TransferPlan:
        """The copy as a :class:`TransferPlan` for the engine between the two media."""
        return TransferPlan(
            plan_id,
            self.src_spec.medium,
            self.dst_spec.medium,
            self.src_spec.block_ids,
            self.dst_spec.block_ids,
            kind=kind,
            urgent=urgent,
        )


class TierChain:
    """Ordered stores below the GPU, highest first, each with its :class:`TierPolicy`.

    Invariants: every open move's source keys are pinned in the source tier
    and its keys pending in the destination tier, until :meth:`finish`.

    Args:
        tiers: ``(store, policy)`` pairs, highest tier first; media are distinct
            and the last tier's policy demotes nothing (there is nothing below it).
    """

    def __init__(self, tiers: Sequence[tuple[CPUStore, TierPolicy]]) -> None:
        if tiers.__class__ not in (list, tuple) or not tiers:
            raise InvalidArgumentError(
                f"tiers must be a non-empty list of (store, policy), got {checks.describe(tiers)}"
            )
        for i, pair in enumerate(tiers):
            if pair.__class__ is not tuple or len(pair) != 2:
                raise InvalidArgumentError(f"tiers[{i}] must be a (store, policy) pair, got {checks.describe(pair)}")
            checks.instance(f"tiers[{i}][0]", pair[0], CPUStore)
            checks.instance(f"tiers[{i}][1]", pair[1], TierPolicy)
        media = [store.medium for store, _ in tiers]
        if len(set(media)) != len(media):
            raise InvalidArgumentError(f"tiers must have distinct media, got {media}")
        if tiers[-1][1].demote != "none":
            raise InvalidArgumentError(
                f"the last tier ({media[-1]}) has no tier below it: its policy must demote 'none'"
            )
        self.stores: tuple[CPUStore, ...] = tuple(store for store, _ in tiers)
        self.policies: tuple[TierPolicy, ...] = tuple(policy for _, policy in tiers)
        self._open: dict[int, Move] = {}
        self._ids = itertools.count()

    @property
    def media(self) -> tuple[str, ...]:
        return tuple(store.medium for store in self.stores)

    @property
    def open_moves(self) -> list[Move]:
        """Moves reserved and not yet finished, oldest first."""
        return list(self._open.values())

    def _tier(self, name: str, tier: object, low: int = 0, high: int | None = None) -> int:
        high = len(self.stores) - 1 if high is None else high
        if tier.__class__ is not int or not low <= tier <= high:  # type: ignore[operator]
            raise InvalidArgumentError(f"{name} must be a tier index in [{low}, {high}], got {checks.describe(tier)}")
        return tier  # type: ignore[return-value]

    # ------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[Key]) -> ChainLookup:
        """Per block of the longest prefix the chain holds, the highest tier holding it (ready).

        ``keys`` may be any collection, as in vLLM 0.33's protocol; its
        iteration order is the prefix order.
        """
        keys = check_keys("keys", keys)
        owner = [-1] * len(keys)
        for t, store in enumerate(self.stores):
            ask = [i for i, o in enumerate(owner) if o < 0]
            if not ask:
                break
            held = self._held(store, [keys[i] for i in ask])
            for i, h in zip(ask, held, strict=True):
                if h:
                    owner[i] = t
        n = owner.index(-1) if -1 in owner else len(owner)
        return ChainLookup(tuple(owner[:n]))

    @staticmethod
    def _held(store: CPUStore, keys: list[Key]) -> list[bool]:
        probe = getattr(store, "probe", None)  # a remote store asks its server in one round trip
        if probe is not None:
            return probe(keys)
        return [store.is_ready(k) for k in keys]

    def route(self, tier: int) -> tuple[str, ...]:
        """The media a block of ``tier`` crosses to the GPU, ending with ``"GPU"``."""
        self._tier("tier", tier)
        if tier == 0 or self.policies[tier].direct_load:
            return (self.stores[tier].medium, GPU)
        return (self.stores[tier].medium, self.stores[0].medium, GPU)

    # ------------------------------------------------------------ moves
    def stage(self, keys: Sequence[Key], src: int) -> Move | None:
        """Reserve a load of ready blocks of tier ``src`` into tier 0 (the staging tier).

        Keys tier 0 already holds (ready or pending) are skipped.  Returns
        ``None``, changing nothing, if tier 0 cannot make room.

        Raises:
            BlockStateError: a key is not ready in ``src``; nothing changes.
        """
        return self._reserve(keys, self._tier("src", src, 1), 0)

    def demote(self, src: int, keys: Sequence[Key], dst: int | None = None) -> Move | None:
        """Reserve a copy of ready blocks of tier ``src`` into a lower tier (by default the next one).

        Keys the lower tier already holds are skipped.  Returns ``None``,
        changing nothing, if the lower tier cannot make room.

        Every I/O engine moves bytes between the CPU tier and its own medium,
        so a block goes from one tier below the CPU to another in two moves
        through the CPU tier: ``stage(keys, src)``, then ``demote(0, keys, dst)``.

        Raises:
            BlockStateError: a key is not ready in ``src``; nothing changes.
            InvalidArgumentError: the lower tier cannot name a key (a private key); nothing changes.
        """
        src = self._tier("src", src, 0, len(self.stores) - 2)
        dst = src + 1 if dst is None else self._tier("dst", dst, src + 1)
        return self._reserve(keys, src, dst)

    def _reserve(self, keys: Sequence[Key], src: int, dst: int) -> Move | None:
        keys = check_keys("keys", keys)
        source, target = self.stores[src], self.stores[dst]
        for i, key in enumerate(keys):
            if not source.is_ready(key):
                raise BlockStateError(f"keys[{i}] = {checks.describe(key)} is not ready in the {source.medium} tier")
        out = target.prepare_store(keys)
        if out is None:
            return None
        src_spec = source.prepare_load(out.keys_to_store)
        keys_to_store, evicted = tuple(out.keys_to_store), tuple(out.evicted_keys)
        move = Move(next(self._ids), src, dst, keys_to_store, src_spec, out.store_spec, evicted)
        self._open[move.move_id] = move
        return move

    def finish(self, move: Move, landed: Sequence[Key]) -> list[Key]:
        """Close a move: unpin the source, commit the ``landed`` keys in the destination, drop the rest.

        Returns:
            The landed keys, in the move's order.

        Raises:
            BlockStateError: the move is not open (finished twice, or not this chain's).
            InvalidArgumentError: ``landed`` names a key that is not in the move.  Nothing changes.
        """
        checks.instance("move", move, Move)
        landed = check_keys("landed", landed)
        if self._open.get(move.move_id) != move:
            raise BlockStateError(f"move {move.move_id} is not open in this chain")
        ok = set(landed)
        if not ok <= set(move.keys):
            extra = next(k for k in landed if k not in set(move.keys))
            raise InvalidArgumentError(
                f"landed names {checks.describe(extra)}, which move {move.move_id} does not copy"
            )
        del self._open[move.move_id]
        keys = list(move.keys)
        self.stores[move.src].complete_load(keys)
        done = [k for k in keys if k in ok]
        target = self.stores[move.dst]
        target.complete_store(done, True)
        target.complete_store([k for k in keys if k not in ok], False)
        return done

    def finish_handle(self, move: Move, handle: TransferHandle) -> list[Key]:
        """:meth:`finish` from a final copy handle.

        A :class:`BlockIOHandle` says per block what landed; a plain copy
        handle lands all or nothing.  Blocks a load found ``MISSING`` or
        ``CORRUPT`` are forgotten by the source tier (their bytes there are gone or bad).

        Raises:
            BlockStateError: the handle is not final yet; nothing changes.
        """
        checks.instance("handle", handle, TransferHandle)
        if not handle.done():
            raise BlockStateError(f"move {move.move_id}: its copy (plan {handle.plan.plan_id}) is not final yet")
        if isinstance(handle, BlockIOHandle):
            landed = handle.landed_keys()
            bad = handle.keys_with(BlockOutcome.MISSING, BlockOutcome.CORRUPT)
        else:
            landed, bad = (list(move.keys) if handle.ok else []), []
        done = self.finish(move, landed)
        source = self.stores[move.src]
        if bad and isinstance(source, KeyedStore):
            source.forget([k for k in bad if k in set(move.keys)])
        return done

    # ------------------------------------------------------------ demotion policy
    def after_store(self, tier: int, keys: Sequence[Key]) -> list[Key]:
        """Of ``keys`` just stored in ``tier``, those a write-through tier should demote now."""
        tier = self._tier("tier", tier)
        keys = check_keys("keys", keys)
        if self.policies[tier].demote != "write_through":
            return []
        store, below = self.stores[tier], self.stores[tier + 1]
        return [k for k in keys if store.is_ready(k) and self._accepts(below, k) and not below.contains(k)]

    def writeback_due(self, tier: int) -> list[Key]:
        """Blocks a write-back tier should demote now: its least recent evictable ones not yet held below.

        Looks at the tier's ``writeback_reserve`` least recent evictable
        entries (for a CPU-store-based tier, stopping there); once they are
        held below, the next evictions drop only blocks that the chain still holds.
        """
        tier = self._tier("tier", tier)
        policy = self.policies[tier]
        if policy.demote != "write_back" or policy.writeback_reserve == 0:
            return []
        below, store = self.stores[tier + 1], self.stores[tier]
        if isinstance(store, CPUStore):  # stops at the reserve instead of listing every entry
            oldest = store.oldest_evictable(policy.writeback_reserve)
        else:
            clean_candidates = [e.key for e in store.entries() if e.ready and e.ref_cnt == 0]
            oldest = clean_candidates[: policy.writeback_reserve]
        return [k for k in oldest if self._accepts(below, k) and not below.contains(k)]

    def only_copies(self, tier: int, keys: Sequence[Key]) -> list[Key]:
        """Of ``keys`` (say, just evicted from ``tier``), those no other tier holds: the chain lost them."""
        tier = self._tier("tier", tier)
        keys = check_keys("keys", keys)
        others = [s for t, s in enumerate(self.stores) if t != tier]
        return [k for k in keys if not any(s.contains(k) for s in others)]

    @staticmethod
    def _accepts(store: CPUStore, key: Key) -> bool:
        return encodable(key) if isinstance(store, KeyedStore) else True

    def check_invariants(self) -> None:
        """Every store's invariants, and every open move's reservations."""
        for store in self.stores:
            store.check_invariants()
        for move in self._open.values():
            src, dst = self.stores[move.src], self.stores[move.dst]
            pinned = {e.key for e in src.entries() if e.ref_cnt > 0}
            assert set(move.keys) <= pinned, f"move {move.move_id}: a source block is not pinned"
            assert all(dst.contains(k) and not dst.is_ready(k) for k in move.keys), (
                f"move {move.move_id}: a destination slot is not pending"
            )
