"""The engine's exactness matrix on CUDA, once per copy engine (torch and cupy); needs a GPU.

The same scenarios as ``test_engine_exact.py`` (swap, recompute, shared
prefix, onboarding from the CPU tier, chunked prefill under preemption,
failed copies), with the GPU tier in device memory, the CPU tier pinned, and
the copies issued by a real CUDA copy engine.  The references are computed on
the same device (``test_engine_exact.reference``), and the tolerances are
that file's.
"""

from __future__ import annotations

import random

import pytest
from engine_configs import engine_config
from engineutil import HAS_CUDA, HAS_CUPY
from test_engine_exact import MAX_TOKENS, check, moved_blocks, prompts

from tiered_kv.engine.engine import Engine
from tiered_kv.transfer.factory import make_copy_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
KINDS = ["cuda", pytest.param("cupy", marks=pytest.mark.skipif(not HAS_CUPY, reason="needs cupy + CUDA"))]
LAYOUTS = ["block_contiguous", "layer_first"]
ENGINE_CLASS = {"cuda": "TorchCudaCopyEngine", "cupy": "CupyCopyEngine"}


def engine(kind: str, **kw) -> Engine:
    e = Engine(
        config=engine_config(record_logits=True, device="cuda", **kw), copy_engine=lambda t: make_copy_engine(t, kind)
    )
    assert e.tiers["GPU"].device.type == "cuda" and e.tiers["CPU"].pinned
    assert type(e.copy).__name__ == ENGINE_CLASS[kind]
    return e


def run(kind: str, ps: dict[int, list[int]], **kw) -> Engine:
    e = engine(kind, **kw)
    for rid, p in ps.items():
        e.add_request(rid, p, MAX_TOKENS)
    e.run()
    e.close()
    return e


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_swap_out_and_back_into_other_blocks_is_bit_exact_on_cuda(kind, layout):
    ps = prompts(1)
    e = run(kind, ps, num_gpu_blocks=16, layout=layout, mode="swap")
    c = e.metrics().counters
    assert c.preemptions_swap > 0 and c.swap_in_blocks > 0 and c.preemptions_recompute == 0
    assert moved_blocks(e)
    check(e, ps, layout, exact_logits=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_swap_in_is_bit_exact_on_cuda(kind, layout):
    """Layer i of a resumed request waits on the device for layer i of its load only."""
    ps = prompts(1)
    e = run(kind, ps, num_gpu_blocks=16, layout=layout, mode="swap", layerwise=True)
    c = e.metrics().counters
    assert c.preemptions_swap > 0 and c.swap_in_blocks > 0
    check(e, ps, layout, exact_logits=True)
    e.scheduler.tm.check_invariants()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_recompute_on_cuda(kind, layout):
    ps = prompts(2)
    e = run(kind, ps, num_gpu_blocks=16, layout=layout, mode="recompute")
    assert e.metrics().counters.preemptions_recompute > 0
    check(e, ps, layout, exact_logits=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix_on_cuda(kind, layout):
    ps = prompts(3, n=5, shared=20)
    e = run(kind, ps, num_gpu_blocks=64, layout=layout)
    assert e.metrics().counters.gpu_hit_tokens >= 4 * 20 - 4 * 3
    check(e, ps, layout, exact_logits=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("layerwise", [False, True])  # True: the prefill is stored layer by layer
def test_prefix_onboarded_from_the_pinned_cpu_tier(kind, layout, layerwise):
    rng = random.Random(4)
    prefix = [rng.randrange(512) for _ in range(24)]
    first = {0: [*prefix, 1, 2, 3]}
    fillers = {i: [rng.randrange(512) for _ in range(40)] for i in (1, 2)}
    later = {3: [*prefix, 9, 8, 7, 6]}
    e = engine(kind, num_gpu_blocks=24, layout=layout, offload="write_through", layerwise=layerwise)
    for group in (first, fillers, later):
        for rid, p in group.items():
            e.add_request(rid, p, MAX_TOKENS)
        e.run()
    e.close()
    c = e.metrics().counters
    assert c.offload_blocks > 0 and c.onboard_blocks >= 5 and c.cpu_hit_tokens >= 20
    check(e, {**first, **fillers, **later}, layout, exact_logits=False)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_prefill_under_preemption_on_cuda(kind, mode):
    ps = prompts(7)
    e = run(kind, ps, num_gpu_blocks=16, mode=mode, max_num_batched_tokens=8)
    c = e.metrics().counters
    assert c.preemptions_swap + c.preemptions_recompute > 0
    assert all(s[0] <= 8 for s in e.stats.step_log) and any(s[0] == 8 for s in e.stats.step_log)
    check(e, ps, "block_contiguous", exact_logits=False)


def test_failed_cuda_copies_keep_requests_recoverable_and_exact():
    """The torch engine fails its first two plans each way while issuing them; nothing is lost."""
    from tiered_kv.transfer.cuda_engine import TorchCudaCopyEngine

    failed = {"D2H": 0, "H2D": 0}
    seen: set[int] = set()

    def fail_first_run(plan, run):  # the first run of each failing plan: nothing of it was issued
        if plan.plan_id not in seen:
            seen.add(plan.plan_id)
            if failed[plan.direction] < 2:
                failed[plan.direction] += 1
                raise RuntimeError(f"injected {plan.direction} fault")

    def flaky(tiers):
        eng = TorchCudaCopyEngine(tiers)
        eng.copy_hook = fail_first_run  # called on every copy path (raw CUDA runtime or torch)
        return eng

    ps = prompts(6)
    e = Engine(
        config=engine_config(record_logits=True, device="cuda", num_gpu_blocks=16, mode="swap"), copy_engine=flaky
    )
    for rid, p in ps.items():
        e.add_request(rid, p, MAX_TOKENS)
    e.run()
    e.close()
    c = e.metrics().counters
    assert c.plans_failed >= 3 and failed == {"D2H": 2, "H2D": 2}
    assert c.swap_in_blocks > 0
    check(e, ps, "block_contiguous", exact_logits=True)
    e.scheduler.tm.check_invariants()
