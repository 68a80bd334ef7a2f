"""What the tier manager returns: outcomes that a scheduler applies.

The manager never writes a request's progress.  Every call that changes where
KV lives returns how many tokens of KV the request now has, or will have when a
copy lands, and the scheduler (the one owner of ``num_computed_tokens``)
applies it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from tiered_kv.core.block import KVCacheBlock
from tiered_kv.manager.pricing import LoadQuote, Quote
from tiered_kv.manager.states import PreemptMode, Residency
from tiered_kv.transfer.plan import PlanKind, TransferHandle, TransferPlan


@dataclass(frozen=True, slots=True)
class Admission:
    """Outcome of ``TierManager.admit``.

    Attributes:
        new_blocks: GPU blocks allocated (for CPU hits, new tokens and lookahead).
        num_computed_tokens: Prefix tokens found cached on the GPU: the
            request's progress now (the scheduler sets it).
        num_loading_tokens: Prefix tokens found on the CPU tier (or below it, to be
            staged through it), arriving by ``plan``; they count as computed when the
            load's ONBOARD completion says so (it may say fewer, if some did not land).
        num_new_tokens: Tokens to compute after the hits (capped by what was asked).
        plan: The onboarding copy, or ``None``.  For a prefix staged from below the
            CPU tier, its first staging move; the request still gets one ONBOARD completion.
    """

    new_blocks: list[KVCacheBlock]
    num_computed_tokens: int
    num_loading_tokens: int
    num_new_tokens: int
    plan: TransferPlan | None

    @property
    def runnable(self) -> bool:
        """Whether the request may be computed now (nothing is arriving)."""
        return self.plan is None


@dataclass(frozen=True, slots=True)
class Decision:
    """Why a request was preempted the way it was: one entry per preemption, in the decision log.

    Attributes:
        tick: The manager's operation counter when it happened.
        request_id: The victim.
        requested: The caller's instruction (``"swap"``, ``"recompute"``, ``"auto"``).
        mode: What was done.
        reason: Why, in words (costs, and whatever made the cheaper mode impossible).
        quote: The prices the choice was made from.
    """

    tick: int
    request_id: Hashable
    requested: str
    mode: PreemptMode
    reason: str
    quote: Quote


@dataclass(frozen=True, slots=True)
class LoadDecision:
    """How much of a new request's prefix, found below the GPU, admission chose to load, and why.

    Attributes:
        request_id: The request.
        quote: The prices the choice was made from (its ``num_blocks`` is what was worth loading).
        num_blocks: Leading blocks actually set to load; fewer than the quote's when the
            CPU tier had no room to stage the rest.
        reason: Why, in words.
    """

    request_id: Hashable
    quote: LoadQuote
    num_blocks: int
    reason: str


@dataclass(frozen=True, slots=True)
class Preemption:
    """Outcome of ``TierManager.preempt``.

    A recompute frees its GPU blocks at once and the manager forgets the
    request (the scheduler resets its progress to 0).  A swap frees them when
    ``plan`` completes; a swap with nothing to copy settles at once.
    """

    request_id: Hashable
    mode: PreemptMode
    reason: str
    plan: TransferPlan | None
    blocks_freed_now: int
    blocks_freed_on_completion: int
    residency: Residency | None  # None: the manager holds nothing for it any more


@dataclass(frozen=True, slots=True)
class Resumption:
    """Outcome of ``TierManager.resume``.

    Attributes:
        num_tokens: Tokens of KV the request has once ``plan`` lands (all of
            them: a swapped request's blocks are pinned on the CPU tier).
        plan: The swap-in copy, or ``None`` when every block was still cached
            on the GPU (then the request is runnable at once).
        handle: The swap-in copy's handle (a layer-wise one is waited on layer by layer).
    """

    request_id: Hashable
    num_tokens: int
    plan: TransferPlan | None
    handle: TransferHandle | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A copy that settled, and what it means for its request.

    Attributes:
        plan_id / kind: The plan.
        request_id: Whose KV moved: the request of a swap or an onboarding,
            and of a write-through OFFLOAD (the request whose computed prompt
            blocks were stored); ``None`` only for an on-evict save, which
            stores cached blocks no request holds.
        ok: Whether it succeeded.  A failed or cancelled copy left the KV where
            it was: a failed swap-out leaves the request on the GPU, a failed
            swap-in leaves it on the CPU, a failed onboarding leaves it with
            nothing (recompute from scratch).
        num_tokens: One meaning for every kind: the request's progress now, i.e.
            the tokens of KV it has on the GPU, counted from its first token (a
            scheduler sets ``num_computed_tokens`` to it).  For a swap-in: all
            of its KV; for an onboarding: its GPU prefix hits plus the tokens
            that landed (the hits alone if nothing did); 0 for a failed copy
            and for the kinds that do not change progress (swap-out, offload).
        residency: Where the request's KV is now (``None``: nowhere).
        num_bytes / elapsed_s: What the engine moved, and how long it took.
        error: Why a failed or cancelled copy did not land, in the engine's words
            (``None`` when it landed, or when it landed but was rolled back
            because a block it relied on did not).
    """

    plan_id: int
    request_id: Hashable | None
    kind: PlanKind
    ok: bool
    num_tokens: int
    residency: Residency | None
    num_bytes: int = 0
    elapsed_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Room:
    """GPU room now, and what the copies in flight will give back (``TierManager.room``).

    Attributes:
        blocks_short: GPU blocks ``allocate`` would lack right now for the
            request's tokens asked about (0 if they fit, or if none was asked about).
        blocks_freed_on_completion: GPU blocks that copies in flight will free
            when they settle (swap-outs, stores of blocks nobody else holds).  A
            scheduler that cannot allocate counts these before it preempts
            anyone: waiting for a copy is cheaper than a preemption.
        copies_in_flight: Copies not settled yet (every kind, moves between
            the tiers below the GPU included).
    """

    blocks_short: int
    blocks_freed_on_completion: int
    copies_in_flight: int
