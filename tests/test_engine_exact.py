"""The exactness proof: a request's tokens do not depend on how its KV was kept.

Tokens are compared exactly.  Logits are compared exactly where the request's
own tokens were computed in the same chunks (swap and swap-in restore the very
bytes), and within ``LOGIT_TOL`` where they were not (recompute re-prefills
prompt + output in one chunk; a shared or onboarded prefix was computed as part
of another request's chunk).  Why 1e-4: the model runs in float32 (machine
epsilon 1.2e-7); regrouping the sums of a 128-wide hidden state over 2 layers
moves logits by about 1e-6 (measured below), so 1e-4 is about 50 times the
observed error and still far below the smallest gap between the top two logits
in these runs, which the tests also check, so no token can flip within it.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from engine_configs import engine_config

from tiered_kv.engine.engine import Engine
from tiered_kv.transfer.cpu_engine import CpuCopyEngine

LOGIT_TOL = 1e-4
MAX_TOKENS = 10
LAYOUTS = ["block_contiguous", "layer_first"]


def prompts(seed: int = 0, n: int = 6, shared: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(shared)]
    return {i: prefix + [rng.randrange(512) for _ in range(rng.randrange(6, 24))] for i in range(n)}


_REF: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}


def reference(prompt: list[int], layout: str) -> tuple[list[int], list[torch.Tensor]]:
    """The request alone, with ample memory: never preempted, nothing shared."""
    key = (tuple(prompt), layout)
    if key not in _REF:
        e = Engine(config=engine_config(num_gpu_blocks=64, layout=layout, record_logits=True))
        e.add_request("r", prompt, MAX_TOKENS)
        out = e.run()["r"]
        _REF[key] = (out, e.logits["r"])
        e.close()
    return _REF[key]


def check(engine: Engine, ps: dict[int, list[int]], layout: str, exact_logits: bool) -> float:
    """Tokens equal the references; logits equal (or within LOGIT_TOL); returns the max logit error.

    Also checks that the observed logit error is under half the smallest gap between the
    top two logits: no sampled token was decided by rounding.
    """
    worst = 0.0
    min_gap = float("inf")
    for rid, p in ps.items():
        want_tokens, want_logits = reference(p, layout)
        assert engine.outputs[rid] == want_tokens, f"request {rid}: tokens differ"
        for got, want in zip(engine.logits[rid], want_logits, strict=True):
            err = (got - want).abs().max().item()
            worst = max(worst, err)
            if exact_logits:
                assert torch.equal(got, want), f"request {rid}: logits not bit-identical ({err})"
            assert err <= LOGIT_TOL, f"request {rid}: logit error {err} above {LOGIT_TOL}"
            top2 = want.topk(2).values
            min_gap = min(min_gap, (top2[0] - top2[1]).item())
    assert 2 * worst < min_gap, f"logit error {worst} could flip a token (smallest top-2 gap {min_gap})"
    return worst


def run(ps, copy_engine=None, **kw) -> Engine:
    e = Engine(config=engine_config(record_logits=True, **kw), copy_engine=copy_engine)
    for rid, p in ps.items():
        e.add_request(rid, p, MAX_TOKENS)
    e.run()
    e.close()
    return e


def moved_blocks(engine: Engine) -> bool:
    """Some request computed with a GPU table that is not an extension of an earlier one."""
    return any(len(h) > 1 for h in engine.tables.values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_swapped_out_and_back_into_other_blocks_is_bit_exact(layout):
    ps = prompts(1)
    e = run(ps, num_gpu_blocks=16, layout=layout, mode="swap")
    c = e.metrics().counters
    assert c.preemptions_swap > 0 and c.swap_in_blocks > 0 and c.preemptions_recompute == 0
    assert moved_blocks(e)
    check(e, ps, layout, exact_logits=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_preempted_and_recomputed(layout):
    ps = prompts(2)
    e = run(ps, num_gpu_blocks=16, layout=layout, mode="recompute")
    assert e.metrics().counters.preemptions_recompute > 0
    worst = check(e, ps, layout, exact_logits=False)
    assert worst > 0  # the recomputed KV really was computed in different chunks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix(layout):
    ps = prompts(3, n=5, shared=20)
    e = run(ps, num_gpu_blocks=64, layout=layout)
    assert e.metrics().counters.gpu_hit_tokens >= 4 * 20 - 4 * 3
    check(e, ps, layout, exact_logits=False)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("layerwise", [False, True])  # True: the prefill is stored layer by layer
def test_prefix_onboarded_from_the_cpu_tier(layout, layerwise):
    rng = random.Random(4)
    prefix = [rng.randrange(512) for _ in range(24)]
    first = {0: [*prefix, 1, 2, 3]}
    fillers = {i: [rng.randrange(512) for _ in range(40)] for i in (1, 2)}
    later = {3: [*prefix, 9, 8, 7, 6]}
    e = Engine(
        config=engine_config(
            num_gpu_blocks=24, layout=layout, offload="write_through", record_logits=True, layerwise=layerwise
        )
    )
    for group in (first, fillers, later):  # one after another: the fillers evict the prefix from the GPU
        for rid, p in group.items():
            e.add_request(rid, p, MAX_TOKENS)
        e.run()
    e.close()
    c = e.metrics().counters
    assert c.offload_blocks > 0 and c.onboard_blocks >= 5 and c.cpu_hit_tokens >= 20
    check(e, {**first, **fillers, **later}, layout, exact_logits=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_auto_mode_mixes_and_stays_exact(layout):
    ps = prompts(5, n=8)
    e = run(ps, num_gpu_blocks=18, layout=layout, mode="auto", victim_policy="cost_aware", offload="write_back")
    c = e.metrics().counters
    assert c.preemptions_swap + c.preemptions_recompute > 0
    check(e, ps, layout, exact_logits=False)


def test_failed_swap_out_and_swap_in_keep_requests_recoverable_and_exact():
    failed = {"D2H": 0, "H2D": 0}

    class Flaky(CpuCopyEngine):
        def copy_run(self, plan, run, non_blocking=False):
            if failed[plan.direction] < 2:  # the first two plans each way fail mid-copy
                failed[plan.direction] += 1
                raise RuntimeError(f"injected {plan.direction} fault")
            super().copy_run(plan, run, non_blocking)

    ps = prompts(6)
    e = run(ps, num_gpu_blocks=16, mode="swap", copy_engine=Flaky)
    c = e.metrics().counters
    assert c.plans_failed >= 3 and failed == {"D2H": 2, "H2D": 2}
    assert c.swap_in_blocks > 0
    check(e, ps, "block_contiguous", exact_logits=True)
    e.scheduler.tm.check_invariants()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_under_preemption(mode):
    """An 8-token budget chunks every prompt; tokens still match the unchunked references."""
    ps = prompts(7)
    e = run(ps, num_gpu_blocks=16, mode=mode, max_num_batched_tokens=8)
    c = e.metrics().counters
    assert c.preemptions_swap + c.preemptions_recompute > 0
    assert all(s[0] <= 8 for s in e.stats.step_log)  # the budget held...
    assert max(len(p) for p in ps.values()) > 8 and any(s[0] == 8 for s in e.stats.step_log)  # ...so prompts were split
    check(e, ps, "block_contiguous", exact_logits=False)


class SlowDeviceToHost(CpuCopyEngine):
    """Copies out of the GPU tier take longer than a step, so saves are still in flight while others compute."""

    def copy_run(self, plan, run, non_blocking=False):
        if plan.direction == "D2H":
            time.sleep(0.01)
        super().copy_run(plan, run, non_blocking)


@pytest.mark.parametrize("window", [1, 4, 64])
def test_write_back_offload_under_a_slow_copy_engine_serves_exact_tokens(window):
    """The wrong-KV scenario: a prefix saved on eviction by a slow copy, evicted, then onboarded by a later request."""
    rng = random.Random(11)
    prefix = [rng.randrange(512) for _ in range(24)]
    first = {0: [*prefix, 1, 2, 3]}
    fillers = {i: [rng.randrange(512) for _ in range(rng.randrange(30, 44))] for i in (1, 2, 3)}
    later = {4: [*prefix, 9, 8, 7, 6], 5: [*prefix[:16], 5, 5]}
    e = Engine(
        config=engine_config(num_gpu_blocks=24, offload="write_back", record_logits=True, evict_window=window),
        copy_engine=SlowDeviceToHost,
    )
    for group in (first, fillers, later):
        for rid, p in group.items():
            e.add_request(rid, p, MAX_TOKENS)
        e.run()
    e.close()
    c = e.metrics().counters
    assert c.offload_blocks > 0
    if window >= 4:  # the window covers the prefix: it is saved whole before any of it is evicted
        assert c.onboard_blocks > 0
    check(e, {**first, **fillers, **later}, "block_contiguous", exact_logits=False)
    e.scheduler.tm.check_invariants()
