"""The scheduler's own invariants, for tests: queues, statuses and the manager's residencies agree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiered_kv.errors import InvalidTransitionError
from tiered_kv.manager.states import Residency
from tiered_kv.sched.status import RequestStatus

if TYPE_CHECKING:
    from tiered_kv.sched.scheduler import Scheduler

S = RequestStatus


def check_consistency(sched: Scheduler) -> None:
    """Assert every request's status matches where the manager holds its KV, and each queue its statuses."""
    for rid, st in sched.status.items():
        res = sched.tm.residency(rid) if sched.tm.holds(rid) else None
        expect = {
            S.WAITING: None,
            S.LOADING: Residency.LOADING,
            S.RUNNING: Residency.GPU,
            S.SWAPPING_OUT: Residency.SWAPPING_OUT,
            S.SWAPPED: Residency.CPU,
            S.SWAPPING_IN: Residency.SWAPPING_IN,
        }[st]
        if rid in sched._loads:  # running while its KV lands layer by layer
            expect = Residency.SWAPPING_IN
        assert res is expect, f"{rid!r}: status {st.value} but residency {res}"
    assert {r.request_id for r in sched.running} == {k for k, s in sched.status.items() if s is S.RUNNING}
    assert sched._arriving == {k for k, s in sched.status.items() if s is S.LOADING or s is S.SWAPPING_IN}
    assert {r.request_id for r in sched.waiting} == {k for k, s in sched.status.items() if s is S.WAITING}
    swapping = (S.SWAPPING_OUT, S.SWAPPED)
    assert {r.request_id for r in sched.swapped} == {k for k, s in sched.status.items() if s in swapping}
    for rid, st in sched.status.items():
        if st is S.WAITING and sched.requests[rid].num_computed_tokens != 0:
            raise InvalidTransitionError(f"{rid!r} waits with computed tokens")
