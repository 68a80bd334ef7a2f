"""Victim policies: which running requests to preempt first, and how.

Each policy is a small class with a sort key; one shared contract test runs
against all of them (tests/test_policies.py).  Keys always end with the
request's admission sequence number, which is unique, so the order is total
and ties break deterministically whatever order candidates arrive in.

``mode`` is the caller's instruction: ``"swap"`` and ``"recompute"`` force the
mode, ``"auto"`` lets the policy choose per victim from the cost model.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.cost_model import CostModel
from tiered_kv.manager.states import MODES, PreemptMode


class VictimInfo:
    """What a policy may know about a candidate.  Block statistics are computed lazily.

    Attributes:
        request_id / seq: identity and admission order (the final tie-break).
        last_scheduled: manager tick of the last allocation (higher = more recent).
        num_gpu_blocks: blocks in its GPU table.
        num_computed_tokens / num_prompt_tokens: progress.
        cpu_free_blocks: CPU blocks free when the decision is made.
    """

    __slots__ = (
        "_exclusive",
        "_runs",
        "_table",
        "cost_model",
        "cpu_free_blocks",
        "last_scheduled",
        "num_computed_tokens",
        "num_gpu_blocks",
        "num_prompt_tokens",
        "request_id",
        "seq",
    )

    def __init__(
        self,
        request_id: Hashable,
        seq: int,
        last_scheduled: int,
        table: Sequence,
        num_computed_tokens: int,
        num_prompt_tokens: int,
        cost_model: CostModel,
        cpu_free_blocks: int,
    ) -> None:
        self.request_id = request_id
        self.seq = seq
        self.last_scheduled = last_scheduled
        self._table = table
        self.num_gpu_blocks = len(table)
        self.num_computed_tokens = num_computed_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.cost_model = cost_model
        self.cpu_free_blocks = cpu_free_blocks
        self._exclusive = -1
        self._runs = -1

    @property
    def num_freeable_blocks(self) -> int:
        """GPU blocks that preempting this request frees (those it alone holds)."""
        if self._exclusive < 0:
            # A list comprehension + C count measured fastest (vs map/attrgetter or a loop).
            self._exclusive = [b.ref_cnt for b in self._table].count(1)
        return self._exclusive

    @property
    def num_runs(self) -> int:
        """Runs of consecutive ids among the freeable blocks: the copies a swap-out would issue."""
        if self._runs < 0:
            runs = 0
            prev = -2
            for b in self._table:
                if b.ref_cnt == 1:
                    if b.block_id != prev + 1:
                        runs += 1
                    prev = b.block_id
            self._runs = runs
        return self._runs

    @property
    def is_prefilling(self) -> bool:
        """In the middle of its prefill: part of the prompt computed, not all of it."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def cpu_fits(self) -> bool:
        return self.num_freeable_blocks <= self.cpu_free_blocks

    @property
    def swap_cost_s(self) -> float:
        """Time lost by swapping: out now, back in later (both on the request's critical path)."""
        if not self.cpu_fits:
            return math.inf
        n, r = self.num_freeable_blocks, self.num_runs
        return self.cost_model.swap_out_time(n, r) + self.cost_model.swap_in_time(n, r)

    @property
    def swap_bytes_cost_s(self) -> float:
        """Lower bound of :attr:`swap_cost_s`: the bytes both ways, without per-copy overhead."""
        n = self.num_freeable_blocks
        return self.cost_model.swap_out_time(n, 0) + self.cost_model.swap_in_time(n, 0)

    @property
    def recompute_cost_s(self) -> float:
        """Time lost by recomputing: a prefill of everything computed so far."""
        return self.cost_model.recompute_time(self.num_computed_tokens)

    def __repr__(self) -> str:
        return f"VictimInfo({self.request_id!r}, seq={self.seq}, blocks={self.num_gpu_blocks})"


@dataclass(frozen=True, slots=True)
class Choice:
    """A ranked candidate with the mode the policy picked and the estimated cost of that mode."""

    info: VictimInfo
    mode: PreemptMode
    cost_s: float


def cheaper_mode(info: VictimInfo, mode: str) -> tuple[PreemptMode, float]:
    """The mode to use for ``info`` under the caller's ``mode`` instruction, and its cost."""
    if mode == "recompute":
        return PreemptMode.RECOMPUTE, info.recompute_cost_s
    if mode == "swap":
        return PreemptMode.SWAP, info.swap_cost_s
    rec = info.recompute_cost_s
    if not info.cpu_fits or info.swap_bytes_cost_s >= rec:
        return PreemptMode.RECOMPUTE, rec  # decided without counting copy runs (a table scan)
    swap = info.swap_cost_s
    return (PreemptMode.SWAP, swap) if swap < rec else (PreemptMode.RECOMPUTE, rec)


class VictimPolicy:
    """Base class: rank candidates by :meth:`key` (smallest first = preempted first)."""

    name = "base"

    def key(self, info: VictimInfo, mode: str) -> tuple:
        raise NotImplementedError

    def lower_key(self, info: VictimInfo, mode: str) -> tuple | None:
        """Optional cheap bound with ``lower_key(c) <= key(c)``; enables best-first ranking."""
        return None

    def choose_mode(self, info: VictimInfo, mode: str) -> tuple[PreemptMode, float]:
        return cheaper_mode(info, mode)

    def iter_rank(self, candidates: Sequence[VictimInfo], mode: str) -> Iterator[Choice]:
        """Candidates in preemption order, each with its mode and cost, computed lazily.

        Keys are computed for every candidate (they define the order); the mode
        and its cost only for the candidates the caller actually consumes, so a
        manager that needs one victim does not price all of them.
        """
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        key = self.key
        if not candidates or self.lower_key(candidates[0], mode) is None:
            ordered: Iterator[VictimInfo] = iter(sorted(candidates, key=lambda c: key(c, mode)))
        else:
            ordered = self._best_first(candidates, mode)
        for c in ordered:
            m, cost = self.choose_mode(c, mode)
            yield Choice(c, m, cost)

    def _best_first(self, candidates: Sequence[VictimInfo], mode: str) -> Iterator[VictimInfo]:
        """Exact key order, computing exact keys only until the next lower bound exceeds the best.

        Candidates are sorted by their cheap lower bound; exact keys go on a heap.
        The heap's minimum is final once every unexamined candidate's lower bound
        is larger, because their exact keys are at least their bounds.
        """
        bounded = sorted(((self.lower_key(c, mode), i) for i, c in enumerate(candidates)), key=lambda t: t[0])
        heap: list[tuple[tuple, int]] = []
        j = 0
        while True:
            while j < len(bounded) and (not heap or bounded[j][0] <= heap[0][0]):
                i = bounded[j][1]
                heapq.heappush(heap, (self.key(candidates[i], mode), i))
                j += 1
            if not heap:
                return
            yield candidates[heapq.heappop(heap)[1]]

    def rank(self, candidates: Sequence[VictimInfo], mode: str) -> list[Choice]:
        """All candidates in preemption order (eager :meth:`iter_rank`)."""
        return list(self.iter_rank(candidates, mode))


class LRUPolicy(VictimPolicy):
    """Least recently scheduled first (vLLM v0's default for the running queue's tail)."""

    name = "lru"

    def key(self, info: VictimInfo, mode: str) -> tuple:
        return (info.last_scheduled, info.seq)


class LargestPolicy(VictimPolicy):
    """Most GPU blocks first: frees the most memory per preemption."""

    name = "largest"

    def key(self, info: VictimInfo, mode: str) -> tuple:
        return (-info.num_gpu_blocks, info.last_scheduled, info.seq)


class PrefillAwarePolicy(VictimPolicy):
    """Avoid requests mid-prefill; among the rest, put the least work at risk.

    A request in the middle of a chunked prefill has paid for part of its
    prompt and produced no token yet, so it goes last.  Within each group the
    request with the least computed work (the prefill time its KV represents,
    which recompute would redo) goes first.  The mode is then chosen per victim
    from the cost model, only for the victims actually taken.
    """

    name = "prefill_aware"

    def key(self, info: VictimInfo, mode: str) -> tuple:
        return (info.is_prefilling, info.num_computed_tokens, info.last_scheduled, info.seq)


class CostAwarePolicy(VictimPolicy):
    """Minimise expected time lost per GPU block freed, choosing swap or recompute per victim."""

    name = "cost_aware"

    def key(self, info: VictimInfo, mode: str) -> tuple:
        freed = info.num_freeable_blocks
        cost = cheaper_mode(info, mode)[1]
        per_block = cost / freed if freed else math.inf
        return (per_block, info.last_scheduled, info.seq)

    def lower_key(self, info: VictimInfo, mode: str) -> tuple:
        """Per-block cost bound without scanning the table.

        With ``n <= len(table)`` freeable blocks and at least one copy run:
        swap per block >= bytes both ways per block + 2 * overhead / len(table);
        recompute per block >= recompute cost / len(table).  A 1-tuple sorts
        before any longer tuple with the same first element, so it bounds
        ``key`` in tuple order too.
        """
        n_max = info.num_gpu_blocks
        if n_max == 0:
            return (math.inf,)
        cm = info.cost_model
        swap = (
            cm.swap_out_time(1, 0) + cm.swap_in_time(1, 0) + 2 * cm.per_copy_overhead_s / n_max
            if info.cpu_free_blocks > 0
            else math.inf
        )
        rec = info.recompute_cost_s / n_max
        bound = swap if mode == "swap" else rec if mode == "recompute" else min(swap, rec)
        # The exact key is computed in a different order of float operations: shave a
        # relative 1e-9 so rounding can never lift the bound above it.
        return (bound * (1 - 1e-9),)


POLICIES: dict[str, type[VictimPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LargestPolicy, PrefillAwarePolicy, CostAwarePolicy)
}


def get_policy(policy: str | VictimPolicy) -> VictimPolicy:
    if isinstance(policy, VictimPolicy):
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise InvalidArgumentError(f"unknown victim policy {policy!r}; choose from {sorted(POLICIES)}") from None
