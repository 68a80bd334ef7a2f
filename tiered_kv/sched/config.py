"""Scheduler limits and choices."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager.states import MODES
from tiered_kv.manager.victim_policy import (
    RENAMED_VICTIM_POLICIES,
    VICTIM_POLICIES,
    VictimPolicy,
    check_victim_policy,
)

SCHEDULING_POLICIES = ("fcfs", "priority")
"""The scheduling orders, vLLM v1's ``policy`` values."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and choices of one scheduler.

    Attributes:
        max_num_batched_tokens: Token budget of one step.
        max_num_seqs: Requests admitted at once (running, loading or swapping in).
        chunked_prefill: Split prompts longer than the budget across steps.
        policy: The scheduling order, vLLM v1's ``policy``: ``"fcfs"`` (serve
            and keep in arrival order; preempt the last of the running queue)
            or ``"priority"`` (serve the lowest ``(priority, arrival_time)``
            first; preempt the highest).
        victim_policy: Which running requests are preempted first (see
            :mod:`tiered_kv.manager.victim_policy`): a policy's name
            (``"last_admitted"``, vLLM v1's order, ``"largest"``,
            ``"prefill_aware"``, ``"cost_aware"``, or one registered with
            :func:`~tiered_kv.manager.victim_policy.register_victim_policy`),
            a policy class's qualified name (``"package.module.ClassName"``),
            or a :class:`~tiered_kv.manager.victim_policy.VictimPolicy` instance.
        mode: Preemption mode: ``"swap"``, ``"recompute"`` or ``"auto"`` (per
            victim, from its quote).
        layerwise: Resume swapped requests layer by layer and compute them in
            the step their load starts: :attr:`SchedulerOutput.loads` names the
            handle whose layer ``i`` a driver must wait for before layer ``i``
            of that request (the load overlaps the layers before it).
        scheduler_reserve_full_isl: vLLM 0.33's admission gate, under its name
            and with its default (on): a waiting request is admitted only when
            the GPU pool could hold its whole sequence now (every token, its
            prefix hits counted as held), not only its first chunk, so chunked
            prefill does not admit more than can finish and preempt the rest.
            (A swapped request, which vLLM does not have, resumes with room for
            its KV and its next step, as before.)
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    policy: str = "fcfs"
    victim_policy: str | VictimPolicy = "last_admitted"
    mode: str = "auto"
    layerwise: bool = False
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        checks.count("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        checks.count("max_num_seqs", self.max_num_seqs, 1)
        checks.flag("chunked_prefill", self.chunked_prefill)
        if (
            type(self.policy) is str
            and self.policy not in SCHEDULING_POLICIES
            and (self.policy in VICTIM_POLICIES or self.policy in RENAMED_VICTIM_POLICIES)
        ):
            # The field meant the victim policy once; a name from that vocabulary is refused, not reinterpreted.
            new = RENAMED_VICTIM_POLICIES.get(self.policy, self.policy)
            raise InvalidArgumentError(
                f"policy: {self.policy!r} is not a scheduling order (policy is fcfs or priority, as in vLLM); "
                f"the victim policy is now victim_policy={new!r}"
            )
        checks.choice("policy", self.policy, SCHEDULING_POLICIES)
        check_victim_policy("victim_policy", self.victim_policy)
        checks.choice("mode", self.mode, MODES)
        checks.flag("layerwise", self.layerwise)
        checks.flag("scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)
