"""Scheduler limits and choices."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.manager.policies import POLICIES
from tiered_kv.manager.states import MODES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and choices of one scheduler.

    Attributes:
        max_num_batched_tokens: Token budget of one step.
        max_num_seqs: Requests admitted at once (running, loading or swapping in).
        chunked_prefill: Split prompts longer than the budget across steps.
        policy: Victim policy name (see :mod:`tiered_kv.manager.policies`).
        mode: Preemption mode: ``"swap"``, ``"recompute"`` or ``"auto"`` (per
            victim, from its quote).
        scheduling: ``"fcfs"`` (serve and keep in arrival order; preempt the
            last of the running queue) or ``"priority"`` (serve the lowest
            ``(priority, arrival_time)`` first; preempt the highest), as vLLM v1.
        layerwise: Resume swapped requests layer by layer and compute them in
            the step their load starts: :attr:`SchedulerOutput.loads` names the
            handle whose layer ``i`` a driver must wait for before layer ``i``
            of that request (the load overlaps the layers before it).
        skip_quiet_allocations: Skip the manager's ``allocate`` for a step it
            would serve without changing anything (``TierManager.quiet_tokens``:
            a decode token that lands in a block the request holds and fills
            none).  Decisions are the same either way; ``False`` calls it for
            every scheduled request, the plain path the fast one is checked against.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    policy: str = "lru"
    mode: str = "auto"
    scheduling: str = "fcfs"
    layerwise: bool = False
    skip_quiet_allocations: bool = True

    def __post_init__(self) -> None:
        checks.count("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        checks.count("max_num_seqs", self.max_num_seqs, 1)
        checks.flag("chunked_prefill", self.chunked_prefill)
        checks.choice("policy", self.policy, POLICIES)
        checks.choice("mode", self.mode, MODES)
        checks.choice("scheduling", self.scheduling, ("fcfs", "priority"))
        checks.flag("layerwise", self.layerwise)
        checks.flag("skip_quiet_allocations", self.skip_quiet_allocations)
