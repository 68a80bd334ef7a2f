"""The tier manager drives the CPU store with vLLM 0.33's request scope: admit opens, free finishes, steps end."""

from __future__ import annotations

from mgrutil import BS, make_tm, run, settle
from poolutil import letters

from tiered_kv.core import Request
from tiered_kv.sched import Scheduler, SchedulerConfig


def test_admission_opens_a_request_in_the_store_and_free_finishes_it():
    tm, eng = make_tm(gpu=9, cpu=9, offload="write_through")
    req = run(tm, "A", "abcdefgh")  # two full blocks, stored by write-through as A's own
    head, tail = req.block_hashes
    assert tm.store.open_requests() == ["A"]
    settle(tm, eng)
    # While A runs its blocks share A's rank, ordered by end token: the tail goes first.
    policy = tm.store.policy
    assert (policy.rank(tail), policy.rank(head)) == ((1, -2 * BS), (1, -BS))
    assert [e.key for e in tm.store.entries()] == [tail, head]
    tm.free("A")
    assert tm.store.open_requests() == []
    # Finished: re-ranked tail to head, so the head ends most recent.
    assert (policy.rank(tail), policy.rank(head)) == ((2, 0), (3, 0))


def test_a_requests_hits_loaded_from_the_store_are_its_uses_without_a_touch():
    tm, eng = make_tm(gpu=9, cpu=9, offload="write_through")
    head, tail = run(tm, "A", "abcdefghi").block_hashes
    settle(tm, eng)
    tm.free("A")
    assert [e.key for e in tm.store.entries()] == [tail, head]
    tm.gpu.reset_prefix_cache()  # the GPU forgets: the next prompt must come from the CPU store
    req = Request("B", letters("abcdefghij"))
    res = tm.admit(req, req.num_tokens)
    assert res is not None and res.num_loading_tokens == 2 * BS
    assert tm.store.open_requests() == ["B"]
    settle(tm, eng)
    assert tm.store.policy.rank(head) == (4, -BS)  # B read head at its first block's end: a use by B
    tm.free("B")
    assert [e.key for e in tm.store.entries()] == [tail, head]


def test_the_scheduler_ends_each_step_in_the_store():
    tm, _ = make_tm(gpu=16, cpu=9, offload="write_through")
    seen = []
    end = tm.store.on_schedule_end

    def spy(new_req_ids=(), preempted_req_ids=()):
        seen.append((list(new_req_ids), list(preempted_req_ids)))
        end(new_req_ids, preempted_req_ids)

    tm.store.on_schedule_end = spy
    sched = Scheduler(tm, SchedulerConfig(max_num_batched_tokens=64))
    sched.add_request(Request("A", letters("abcdefgh")))
    sched.schedule()
    assert seen == [(["A"], [])]
