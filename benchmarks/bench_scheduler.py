"""tiered_kv's ``Scheduler`` against vLLM 0.33.0's own ``Scheduler``: the cost of one step, with identical decisions.

Both schedulers are built and driven exactly as the differential test
``tests/test_integration_vllm_sched_diff.py`` builds and drives them (its
``build_vllm``, ``build_ours``, request builders and stand-in model runner are
imported from it): vLLM's real ``Scheduler`` on the CPU from the local tiny
model's ``config.json``; ours over a ``TierManager`` with no CPU tier,
recompute preemption and the ``last_admitted`` victim (vLLM's own victim).

The stream is oversubscribed: a few hundred requests, most of them sharing one
of a few system prompts, arriving over the first steps into a pool that holds
a fraction of what they need, so requests are preempted (and find their
prefix blocks again), long prompts are prefilled in chunks and the running set
hits ``max_num_seqs``.

First the differential test's own ``run_both`` replays the stream with every
check it makes at every step (batch, preemptions, finishes, free blocks, block
tables, queue orders).  Then each timed repeat replays it again, both
schedulers in lockstep in one process, and times only the schedulers' own
calls: vLLM's ``schedule()`` and ``update_from_output()``, ours ``schedule()``
and ``update()``.  Which scheduler is called first alternates from step to
step.  Outside the timed span: adding requests (and building them, where vLLM
hashes a prompt's blocks; ours hashes them inside ``schedule()``: this intake
is timed apart and printed below the table, not in the ratio), the stand-in
model runner (sampling, building vLLM's ``ModelRunnerOutput``) and the
comparisons.  Every repeat compares both schedulers' decisions step by step
(scheduled ids in order with their token counts, preemptions, finishes) with
each other and with the checked replay, and stops with a message naming the
step on the first difference.

``--hash-at-intake`` hashes each of our prompts where vLLM hashes its own: at
intake, when the request is built (vLLM's ``Request`` calls its
``block_hasher`` in its constructor), with the manager's own ``BlockHasher``
(``tm.gpu.hasher``), so that both spans hold the same work; the manager then
finds the prompt hashed and hashes only the blocks decoding fills, as vLLM's
``update_from_output`` does inside its span.  Without it, ours hashes its
prompts inside ``schedule()`` and that cost counts against ours only.

``--clock cpu`` times with ``time.process_time_ns`` (CPU time of this process;
on a shared machine other processes' load does not enter it), ``--clock wall``
with ``time.perf_counter_ns``.  The garbage collector stays on (both
schedulers allocate as they would in a server); it is run before each repeat.

Usage (vLLM's environment)::

    .venv-vllm/bin/python benchmarks/bench_scheduler.py --clock cpu [--requests 300] [--repeats 5] [--hash-at-intake]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

CLOCKS: dict[str, Callable[[], int]] = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}


def load_diff() -> Any:
    """The differential test module (its builders and stand-in model runner), or exit naming why vLLM is unusable."""
    from vllm_env import PROBLEM

    if PROBLEM is not None:
        sys.exit(f"bench_scheduler: {PROBLEM}; run it with .venv-vllm (bash scripts/setup-venv.sh vllm)")
    import test_integration_vllm_sched_diff as diff

    return diff


def make_stream(diff: Any, n: int, seed: int, setup: Any) -> list[Any]:
    """``n`` requests, two arriving per step; two in three start with one of six shared system prompts.

    Prompts are 16 to 700 tokens and outputs 1 to 160 tokens, so with 64 seats the running
    set wants several times the pool: requests are preempted under pressure throughout.
    """
    rng = random.Random(seed)
    systems = [diff.prompt(seed * 100 + k, rng.randint(3, 16) * setup.block_size) for k in range(6)]
    stream = []
    for i in range(n):
        base = rng.choice(systems) if rng.random() < 2 / 3 else ()
        length = len(base) + rng.randint(16, 700 - len(base))
        stream.append(
            diff.Arrival(i // 2, f"r{i}", diff.prompt(seed * 10_000 + i, length, base), max_tokens=rng.randint(1, 160))
        )
    return stream


@dataclass
class Timing:
    """Nanoseconds spent in each scheduler's calls over one replay."""

    steps: int = 0
    vllm_schedule: int = 0
    vllm_update: int = 0
    ours_schedule: int = 0
    ours_update: int = 0
    vllm_intake: int = 0  # building each request (vLLM hashes its prompt's blocks here) and add_request
    ours_intake: int = 0  # the same for ours (prompt blocks hashed here with --hash-at-intake, else in schedule())


class Mismatch(Exception):
    """The two schedulers (or a repeat and the checked replay) decided differently."""


def timed_replay(
    diff: Any, setup: Any, stream: list[Any], clock: Callable[[], int], max_steps: int, hash_at_intake: bool = False
) -> tuple:
    """One lockstep replay of ``stream``: (the differential test's Trace, Timing); Mismatch at the first difference.

    ``hash_at_intake``: each of our requests is hashed by the manager's own hasher when it is
    built, as vLLM's ``Request`` is by its ``block_hasher``, before ``add_request``.
    """
    v, s = diff.build_vllm(setup), diff.build_ours(setup)
    hasher = s.tm.gpu.hasher if hash_at_intake else None
    pending = sorted(stream, key=lambda a: (a.step, a.rid))
    dec, tim = diff.Trace(), Timing()
    gc.collect()
    for step in range(max_steps):
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            t0 = clock()
            v.add_request(diff.vllm_request(a, setup.block_size))
            t1 = clock()
            ours = diff.our_request(a)
            if hasher is not None:
                hasher.update(ours)
            s.add_request(ours)
            t2 = clock()
            tim.vllm_intake += t1 - t0
            tim.ours_intake += t2 - t1
        if not pending and not s.num_unfinished and not v.get_num_unfinished_requests():
            tim.steps = step
            return dec, tim
        vllm_first = step % 2 == 0
        if vllm_first:
            t0 = clock()
            out_v = v.schedule()
            t1 = clock()
            out_s = s.schedule()
            t2 = clock()
            tim.vllm_schedule += t1 - t0
            tim.ours_schedule += t2 - t1
        else:
            t0 = clock()
            out_s = s.schedule()
            t1 = clock()
            out_v = v.schedule()
            t2 = clock()
            tim.ours_schedule += t1 - t0
            tim.vllm_schedule += t2 - t1
        batch_v = list(out_v.num_scheduled_tokens.items())
        batch_s = [(str(r.request_id), n) for r, n in out_s.scheduled]
        if batch_s != batch_v:
            raise Mismatch(f"step {step}: batch: vLLM {batch_v}, ours {batch_s}")
        preempted_v = set(out_v.preempted_req_ids)
        preempted_s = {str(rid) for rid, _ in out_s.preempted}
        if preempted_s != preempted_v or len(out_s.preempted) != len(preempted_s):
            raise Mismatch(f"step {step}: preemptions: vLLM {sorted(preempted_v)}, ours {out_s.preempted}")
        # The differential test's stand-in model runner: a token only where the step reaches the end.
        sampled_v: list[list[int]] = []
        sampled_s: dict[str, int] = {}
        for rid, _ in batch_v:
            vreq = v.requests[rid]
            if vreq.num_computed_tokens >= vreq.num_tokens:
                t = diff.token(rid, vreq.num_tokens)
                sampled_v.append([t])
                sampled_s[rid] = t
            else:
                sampled_v.append([])
        mro = diff.runner_output([rid for rid, _ in batch_v], sampled_v)
        if vllm_first:
            t0 = clock()
            v.update_from_output(out_v, mro)
            t1 = clock()
            done = s.update(out_s, sampled_s)
            t2 = clock()
            tim.vllm_update += t1 - t0
            tim.ours_update += t2 - t1
        else:
            t0 = clock()
            done = s.update(out_s, sampled_s)
            t1 = clock()
            v.update_from_output(out_v, mro)
            t2 = clock()
            tim.ours_update += t1 - t0
            tim.vllm_update += t2 - t1
        finished_s = {str(r.request_id) for r in done}
        finished_v = set(v.finished_req_ids)
        if finished_s != finished_v:
            raise Mismatch(f"step {step}: finished: vLLM {sorted(finished_v)}, ours {sorted(finished_s)}")
        dec.batches.append(batch_s)
        dec.preempted.append(preempted_s)
        dec.finished.append(finished_s)
    raise Mismatch(f"not finished after {max_steps} steps")


def compare(checked: Any, dec: Any) -> None:
    """Raise Mismatch at the first step where a timed replay decided otherwise than the checked one."""
    for what in ("batches", "preempted", "finished"):
        ref, got = getattr(checked, what), getattr(dec, what)
        for step, (a, b) in enumerate(zip(ref, got, strict=False)):
            if a != b:
                raise Mismatch(f"step {step}: {what} differ from the checked replay: {a} != {b}")
        if len(ref) != len(got):
            raise Mismatch(f"{what}: the checked replay took {len(ref)} steps, this one {len(got)}")


def clock_overhead(clock: Callable[[], int], n: int = 20_000) -> float:
    """Nanoseconds one empty timed span reads (two clock reads), the median of ``n``."""
    spans = []
    for _ in range(n):
        t0 = clock()
        spans.append(clock() - t0)
    return statistics.median(spans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu", help="cpu: process time; wall: perf_counter")
    parser.add_argument("--requests", type=int, default=300, help="requests in the stream (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="timed replays (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument(
        "--hash-at-intake",
        action="store_true",
        help="hash our prompts when the requests are built, where vLLM hashes its own (outside the span)",
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.repeats < 1:
        parser.error("--requests and --repeats must be >= 1")
    diff = load_diff()
    setup = diff.Setup(
        num_blocks=513,  # 512 usable blocks of 16 tokens (8,192 tokens) and vLLM's null block
        max_num_batched_tokens=512,
        max_num_seqs=64,
        block_size=16,
        max_model_len=1024,
    )
    stream = make_stream(diff, args.requests, args.seed, setup)
    clock = CLOCKS[args.clock]
    try:
        checked = diff.run_both(setup, stream, max_steps=args.max_steps)
    except AssertionError as exc:
        sys.exit(f"bench_scheduler: the schedulers decided differently in the checked replay: {exc}")
    steps = len(checked.batches)
    print(
        f"stream: {args.requests} requests (seed {args.seed}), {steps} steps, "
        f"{sum(len(b) for b in checked.batches)} scheduled entries, "
        f"{sum(n for b in checked.batches for _, n in b)} tokens, {len(checked.all_preempted)} preemptions "
        f"({len(set(checked.all_preempted))} requests); pool {setup.num_blocks - 1} blocks of {setup.block_size}, "
        f"budget {setup.max_num_batched_tokens} tokens, {setup.max_num_seqs} seats, chunked prefill, FCFS"
    )
    print("checked replay: identical at every step (batch, preemptions, finishes, free blocks, block tables, queues)")
    where = "at intake, as vLLM's (outside the span)" if args.hash_at_intake else "inside schedule() (in the span)"
    print(f"our prompts hashed {where}")
    print(f"clock: {args.clock}; empty span {clock_overhead(clock):.0f} ns; load average {os.getloadavg()}")
    print()
    rows = []
    intake: list[tuple[float, float]] = []
    header = (
        f"{'repeat':>6} | {'vLLM schedule':>13} | {'vLLM update':>11} | {'vLLM step':>9} | "
        f"{'ours schedule':>13} | {'ours update':>11} | {'ours step':>9} | {'ratio':>5}"
    )
    print("us per step")
    print(header)
    print("-" * len(header))
    for rep in range(args.repeats):
        try:
            dec, tim = timed_replay(diff, setup, stream, clock, args.max_steps, args.hash_at_intake)
            compare(checked, dec)
        except Mismatch as exc:
            sys.exit(f"bench_scheduler: repeat {rep}: the schedulers decided differently: {exc}")
        us = [x / tim.steps / 1e3 for x in (tim.vllm_schedule, tim.vllm_update, tim.ours_schedule, tim.ours_update)]
        row = (us[0], us[1], us[0] + us[1], us[2], us[3], us[2] + us[3])
        rows.append(row)
        intake.append((tim.vllm_intake / tim.steps / 1e3, tim.ours_intake / tim.steps / 1e3))
        print(
            f"{rep:>6} | {row[0]:>13.1f} | {row[1]:>11.1f} | {row[2]:>9.1f} | "
            f"{row[3]:>13.1f} | {row[4]:>11.1f} | {row[5]:>9.1f} | {row[2] / row[5]:>4.2f}x"
        )
    med = [statistics.median(r[k] for r in rows) for k in range(6)]
    ratios = sorted(r[2] / r[5] for r in rows)
    print("-" * len(header))
    print(
        f"{'median':>6} | {med[0]:>13.1f} | {med[1]:>11.1f} | {med[2]:>9.1f} | "
        f"{med[3]:>13.1f} | {med[4]:>11.1f} | {med[5]:>9.1f} | {med[2] / med[5]:>4.2f}x"
    )
    print(
        f"outside the ratio, intake (building requests and add_request) per step: "
        f"vLLM {statistics.median(i[0] for i in intake):.1f} us, ours {statistics.median(i[1] for i in intake):.1f} us"
    )
    print()
    print(
        f"vLLM's step / ours: {med[2] / med[5]:.2f}x (medians); per repeat {ratios[0]:.2f}x-{ratios[-1]:.2f}x; "
        f"load average after {os.getloadavg()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
