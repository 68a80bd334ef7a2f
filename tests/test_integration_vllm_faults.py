"""Faults around swaps at preemption inside vLLM 0.33, with a copy engine whose jobs the test controls.

The copy engine (tests/vllm_preempt_env.py, :class:`ByteWorker`) copies real
bytes; the test makes chosen jobs fail half-way (torn), cancel (nothing copied),
or report late (after the victim is scheduled again, out of order).  Whatever
happens, a victim recomputes what did not land and never loads bytes that were
not written whole, no GPU block is written while a store still reads it, and
nothing stays pinned, hidden or in flight at the end.
"""

from __future__ import annotations

from vllm_env import PROBLEM, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    from vllm.v1.request import RequestStatus
    from vllm_preempt_env import Fault, Rig, extra_config, oversubscribed_stream

    from tiered_kv.integrations.vllm import TieredKVScheduler
    from tiered_kv.manager.states import PreemptMode

GPU_BLOCKS = 32


def swap_rig(cpu_chunks: int = 256, mode: str = "swap") -> Rig:
    rig = Rig.build(TieredKVScheduler, extra_config({"mode": mode}, cpu_chunks=cpu_chunks), GPU_BLOCKS)
    oversubscribed_stream(rig)
    return rig


class PreemptStores:
    """Sets a fault on every store at preemption as it is created (the hook runs before the worker copies)."""

    def __init__(self, rig: Rig, fault: Fault | None = None, delay: int = 0) -> None:
        self.rig, self.fault, self.delay = rig, fault, delay
        self.jobs: dict[int, object] = {}
        rig.on_schedule = self

    def __call__(self, out: object) -> None:
        worker = self.rig.byte_worker
        for job_id, job in self.rig.scheduler.connector.preemption.preempt_jobs_in_flight().items():
            if job_id in self.jobs:
                continue
            self.jobs[job_id] = job
            if self.fault is not None:
                worker.faults[job_id] = self.fault
            if self.delay:
                worker.delays[job_id] = self.delay


def assert_clean(rig: Rig) -> None:
    """Everything finished, every resumed request had its own bytes, nothing is left held."""
    sched = rig.scheduler
    assert not sched.requests
    assert rig.hazards == []
    assert rig.resumes and all(r.bytes_equal for r in rig.resumes)
    conn = sched.connector.preemption
    assert conn.preempt_jobs_in_flight() == {}
    assert conn.manager.hidden() == frozenset()
    store = conn.manager.store
    assert store.num_pinned == 0 and store.num_pending == 0
    store.check_invariants()
    assert sched.counters.tokens_recomputed == rig.tokens_recomputed()


def resumed_load_sources(rig: Rig, victim: str) -> set[int]:
    """CPU chunks any load read after the victim's preemption (a superset of what the victim loaded)."""
    first = next(i for i, s in enumerate(rig.steps) if victim in s.preempted)
    return {c for s in rig.steps[first + 1 :] for src, _ in s.load_jobs.values() for c in src}


def test_a_failed_store_at_preemption_leaves_the_victim_recomputing() -> None:
    rig = swap_rig()
    faults = PreemptStores(rig, Fault.FAIL)
    rig.run()
    assert faults.jobs and rig.scheduler.counters.stores_failed == len(faults.jobs)
    assert rig.scheduler.counters.blocks_stored == 0
    store = rig.scheduler.connector.preemption.manager.store
    for job in faults.jobs.values():
        assert not any(store.contains(k) for k in job.stored_keys)  # dropped, not stored
    # The torn chunks were never loaded: every resume has its own bytes (assert_clean), recomputing what
    # neither the GPU cache nor the CPU tier still held.
    assert rig.tokens_recomputed() > sum(r.had % 16 for r in rig.resumes)
    assert_clean(rig)


def test_a_cancelled_store_at_preemption_leaves_the_victim_recomputing() -> None:
    rig = swap_rig()
    faults = PreemptStores(rig, Fault.CANCEL)
    rig.run()
    assert faults.jobs and rig.scheduler.counters.stores_failed == len(faults.jobs)
    assert_clean(rig)


def test_a_store_still_unreported_when_the_victim_runs_again_is_not_waited_for_nor_loaded() -> None:
    rig = swap_rig()
    faults = PreemptStores(rig, delay=400)  # copied at the flush, reported only after 400 more steps
    steps = 0
    while rig.scheduler.requests:
        rig.step()
        steps += 1
    assert faults.jobs
    for job_id, job in faults.jobs.items():
        # The victim ran again before its store was reported, and no load read the chunks it was writing.
        assert any(r.restored < r.had for r in rig.resumes if r.request_id == job.request_id)
        written = {c for s in rig.steps if job_id in s.store_jobs for c in s.store_jobs[job_id][1]}
        assert written and not written & resumed_load_sources(rig, job.request_id)
    assert steps < 400  # the stream finished long before the reports: nobody waited for them
    assert rig.scheduler.counters.blocks_stored == 0
    rig.run()  # vLLM keeps stepping while jobs are in flight; the late reports land, the chunks are stored
    assert rig.scheduler.counters.blocks_stored == sum(j.num_blocks for j in faults.jobs.values())
    assert_clean(rig)


def test_reports_out_of_order() -> None:
    rig = swap_rig()
    delays = iter([30, 0, 2, 0, 1, 0, 0, 0, 0, 0])
    seen: set[int] = set()

    def hook(out: object) -> None:
        for job_id in rig.scheduler.connector.preemption.preempt_jobs_in_flight():
            if job_id not in seen:
                seen.add(job_id)
                rig.byte_worker.delays[job_id] = next(delays)

    rig.on_schedule = hook
    rig.run()
    reported = [j for j, ok in rig.byte_worker.reported if j in seen]
    assert ok_all(rig) and reported[:2] == [6, 5]  # the first store at preemption reported after the second
    assert_clean(rig)


def ok_all(rig: Rig) -> bool:
    return all(ok for _, ok in rig.byte_worker.reported)


def test_a_full_cpu_tier_makes_the_victim_recompute() -> None:
    rig = swap_rig(cpu_chunks=12)
    rig.run()
    decisions = list(rig.scheduler.decisions)
    full = [d for d in decisions if d.mode is PreemptMode.RECOMPUTE]
    assert full and all("the CPU tier has no room" in d.reason for d in full)
    assert any(d.mode is PreemptMode.SWAP for d in decisions)
    for d in full:
        assert d.quote is not None and not d.quote.cpu_has_room and d.stored_blocks == 0
    assert_clean(rig)


def test_a_failed_load_at_resume_is_recomputed_from_its_first_block() -> None:
    rig = swap_rig()
    failed: list[int] = []

    def hook(out: object) -> None:
        meta = out.kv_connector_metadata
        for job_id, job in meta.load_jobs.items():
            if rig.added[job.req_id].num_preemptions and not failed:
                rig.byte_worker.faults[job_id] = Fault.FAIL  # half the chunks land; the job fails
                failed.append(job_id)

    rig.on_schedule = hook
    rig.run()
    assert failed and rig.scheduler.counters.loads_failed == 1
    assert rig.scheduler.counters.blocks_loaded > 0  # the other resumes loaded
    assert_clean(rig)


def test_a_victim_aborted_while_its_store_is_in_flight_leaves_nothing_held() -> None:
    rig = swap_rig()
    faults = PreemptStores(rig, delay=5)
    while not faults.jobs:
        rig.step()
    victim = next(iter(faults.jobs.values())).request_id
    rig.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    rig.run()
    rig.finish_pending()
    for _ in range(6):
        rig.step()
    conn = rig.scheduler.connector.preemption
    assert conn.preempt_jobs_in_flight() == {} and conn.pinned_keys(victim) == []
    assert conn.manager.store.num_pinned == 0 and conn.manager.hidden() == frozenset()


def test_a_prefix_cache_reset_with_a_store_in_flight_drops_it_and_recomputes() -> None:
    rig = swap_rig()
    faults = PreemptStores(rig, delay=3)
    while not faults.jobs:
        rig.step()
    sched = rig.scheduler
    before = len(sched.decisions)
    assert sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    reset = list(sched.decisions)[before:]
    assert reset and all(d.needed_by is None and d.mode is PreemptMode.RECOMPUTE for d in reset)
    assert sched.connector.preemption.preempt_jobs_in_flight() == {}
    rig.run()
    for _ in range(4):  # the stale report arrives and is ignored
        rig.step()
    assert_clean(rig)
