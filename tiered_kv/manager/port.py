"""The verbs a scheduler uses to talk to the tier manager, in one place, with their contracts.

:class:`~tiered_kv.manager.tier_manager.TierManager` implements them (and
more, for drivers, plug-ins and tests); :class:`~tiered_kv.sched.Scheduler`
holds the manager typed as this port and uses nothing else, so the interface
between the two stays this narrow (tests/test_scheduler_port.py counts the
members the scheduler's source uses).  Every verb validates its arguments
before it changes anything, returns an outcome the scheduler applies, and
never calls back into the scheduler.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from tiered_kv.core.request import Request
from tiered_kv.manager.outcomes import Admission, Completion, Preemption, Resumption, Room
from tiered_kv.manager.states import KVState
from tiered_kv.manager.victim_policy import VictimPolicy
from tiered_kv.transfer.plan import TransferHandle, TransferPlan


class SchedulerPort(Protocol):
    """Admit, grow, preempt, resume, free, poll; the step's two ends; three read-only queries."""

    def admit(
        self,
        request: Request,
        max_new_tokens: int,
        *,
        chunked: bool = ...,
        full_sequence_must_fit: bool = ...,
        has_scheduled_reqs: bool = ...,
    ) -> Admission | None:
        """Take a new (or recomputed) request: prefix hits, blocks for its first tokens; ``None``: it does not fit."""
        ...

    def grow(self, request_id: Hashable, num_new_tokens: int) -> int | None:
        """Blocks for a running request's next tokens; ``None``: they do not fit (nothing changed).

        Otherwise how far it may grow next without asking (a cache of the answer
        holds until its KV leaves the GPU or a copy of it settles).
        """
        ...

    def preempt(self, request_id: Hashable, mode: str = ..., *, unschedule: bool = ...) -> Preemption | None:
        """Swap out or recompute a request on the GPU, by the mode its quote chooses; ``None``: ``mode`` impossible."""
        ...

    def resume(
        self, request_id: Hashable, layered: bool = ..., *, num_new_tokens: int = ..., keep_watermark: bool = ...
    ) -> Resumption | None:
        """Bring a swapped request back with room for its next tokens; ``None``: it does not fit (nothing changed)."""
        ...

    def free(self, request_id: Hashable, *, cancel: bool = ...) -> bool:
        """End an open request in every tier; with ``cancel``, its copy in flight first (False: it landed first)."""
        ...

    def poll(self, timeout: float | None = ...) -> list[Completion]:
        """Settle every final copy, in plan order (waiting up to ``timeout`` first); a new batch starts."""
        ...

    def on_schedule_end(
        self, new_req_ids: list[Hashable], preempted_req_ids: list[Hashable], *, layerwise_stores: bool = ...
    ) -> dict[Hashable, TransferHandle]:
        """The batch is final; with ``layerwise_stores``, the gated stores of the prompt blocks it completes."""
        ...

    def step_computed(
        self, saves: Sequence[TransferHandle] = ..., loads: Sequence[TransferHandle] = ...
    ) -> list[Completion]:
        """The step's compute is done: open the rest of its stores' layers, settle its layer-wise loads."""
        ...

    def on_tokens_computed(self, request_id: Hashable) -> TransferPlan | None:
        """A request's step is computed: a victim again; with write-through, its new full prompt blocks are stored."""
        ...

    def state(self, request_id: Hashable) -> KVState:
        """Read-only: open or not, and where its KV is (the one state machine's state)."""
        ...

    def room(self, request_id: Hashable | None = ..., num_new_tokens: int = ...) -> Room:
        """Read-only: blocks short for these tokens, blocks copies in flight will free, copies in flight."""
        ...

    def victim(
        self,
        requester: Hashable,
        ranked: Sequence[Hashable],
        policy: str | VictimPolicy = ...,
        mode: str = ...,
    ) -> Hashable | None:
        """Read-only: the victim policy's first among ``ranked`` (the scheduler's order); ``None``: nobody may go."""
        ...
