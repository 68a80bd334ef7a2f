"""Swap at preemption inside vLLM 0.33's real scheduler, with real bytes (tests/vllm_preempt_env.py).

An oversubscribed stream of requests runs through vLLM's own ``Scheduler`` with
tiered_kv's scheduler class and connector, its worker side driven as vLLM's
model runner drives it, over a copy engine that moves real bytes.  Victims are
swapped out and resumed: every resumed request finds exactly the KV bytes it
had when it was preempted, and computes again only the partial block vLLM 0.33
cannot key.  The same stream under vLLM's default preemption gives the recompute
tax side by side, and the counters reach Prometheus through vLLM's own frontend
class.
"""

from __future__ import annotations

import pytest
from vllm_env import PROBLEM, vllm_mark

pytestmark = vllm_mark()

if PROBLEM is None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm_preempt_env import BS, Rig, build_config, extra_config, oversubscribed_stream

    from tiered_kv.integrations.vllm import TieredKVScheduler
    from tiered_kv.manager.states import PreemptMode

GPU_BLOCKS = 32


def run(scheduler_cls: type, preemption: dict | None, **kw) -> Rig:
    rig = Rig.build(scheduler_cls, extra_config(preemption), GPU_BLOCKS, **kw)
    oversubscribed_stream(rig)
    rig.run()
    return rig


@pytest.fixture(scope="module")
def swapped() -> Rig:
    return run(TieredKVScheduler, {"mode": "swap"})


@pytest.fixture(scope="module")
def vllm_default() -> Rig:
    return run(Scheduler, None)


def test_swapped_victims_resume_with_the_bytes_they_had(swapped: Rig) -> None:
    sched = swapped.scheduler
    assert not sched.requests  # every request finished
    assert swapped.hazards == []  # no block was written while a store still read it
    decisions = list(sched.decisions)
    assert len(decisions) >= 2 and all(d.mode is PreemptMode.SWAP for d in decisions)
    assert sorted(r.request_id for r in swapped.resumes) == sorted(d.victim for d in decisions)
    for d in decisions:  # the quote's facts are what the store did: the blocks the CPU tier lacked
        assert d.quote is not None and d.stored_blocks == d.quote.blocks_to_move and d.quote.can_swap, d
    for r in swapped.resumes:
        assert r.bytes_equal, f"{r.request_id} resumed with other KV bytes than it had"
        # Every full block came back (GPU hits or CPU loads); only the partial last block is recomputed.
        assert r.restored == r.had // BS * BS, r


def test_resumed_requests_compute_only_their_partial_block_again(swapped: Rig) -> None:
    counters = swapped.scheduler.counters
    partial = sum(r.had - r.restored for r in swapped.resumes)
    assert swapped.tokens_recomputed() == partial  # positions the forward pass computed twice
    assert counters.tokens_recomputed == partial
    assert counters.tokens_computed == swapped.tokens_computed()
    assert counters.preemptions_swap == len(swapped.resumes) and counters.preemptions_recompute == 0
    assert counters.blocks_stored == sum(d.stored_blocks for d in swapped.scheduler.decisions) > 0
    assert 0 < counters.blocks_loaded <= sum(r.restored for r in swapped.resumes) // BS
    assert counters.stores_failed == counters.loads_failed == 0


def test_recompute_tax_against_vllms_default_preemption(swapped: Rig, vllm_default: Rig) -> None:
    """The same stream: vLLM's recompute-only preemption against swaps, recompute tax side by side (RFC 54644)."""
    assert vllm_default.hazards == [] and all(r.bytes_equal for r in vllm_default.resumes)
    default_tax = vllm_default.tokens_recomputed() / vllm_default.tokens_computed()
    swap_tax = swapped.tokens_recomputed() / swapped.tokens_computed()
    assert swapped.scheduler.counters.recompute_tax == pytest.approx(swap_tax)
    assert vllm_default.tokens_recomputed() > 0
    assert swap_tax < default_tax / 2, (swap_tax, default_tax)


def test_auto_mode_swaps_or_recomputes_by_the_quote() -> None:
    """Attention makes long victims dear to recompute, a slow link short ones dear to swap: each takes its mode."""
    costs = {
        "prefill_tokens_per_s": 50000,
        "prefill_quadratic_s_per_token2": 1e-6,
        "d2h_bytes_per_s": 2e6,
        "h2d_bytes_per_s": 2e6,
    }
    rig = run(TieredKVScheduler, {"mode": "auto", "cost_model": costs})
    decisions = list(rig.scheduler.decisions)
    assert {d.mode for d in decisions} == {PreemptMode.SWAP, PreemptMode.RECOMPUTE}
    for d in decisions:
        assert d.quote is not None and d.quote.choose("auto") == (d.mode, d.reason)
    assert rig.hazards == [] and all(r.bytes_equal for r in rig.resumes)


class _Prom(KVConnectorProm if PROBLEM is None else object):  # type: ignore[misc]
    """vLLM's frontend connector metrics, registered in a registry of the test's own."""

    registry = CollectorRegistry() if PROBLEM is None else None

    def __init__(self, *args, **kwargs) -> None:
        registry = self.registry

        def bound(cls: type) -> type:
            return type(
                cls.__name__, (cls,), {"__init__": lambda s, *a, **k: cls.__init__(s, *a, registry=registry, **k)}
            )

        self._gauge_cls, self._counter_cls, self._histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)
        super().__init__(*args, **kwargs)


def test_counters_reach_prometheus_beside_vllms_own_metrics(swapped: Rig) -> None:
    config, _ = build_config(extra_config({"mode": "swap"}), GPU_BLOCKS)
    prom = _Prom(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    payloads = [s.kv_connector_stats for s in swapped.scheduler_stats if s.kv_connector_stats]
    assert payloads
    for payload in payloads:
        prom.observe(payload, 0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(prom.registry).decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"engine": "0", "model_name": "tiny", **labels}.items())))]

    c = swapped.scheduler.counters
    assert value("tiered_kv:preemptions_total", mode="swap") == c.preemptions_swap > 0
    assert value("tiered_kv:preemption_stored_blocks_total") == c.blocks_stored > 0
    assert value("tiered_kv:resume_loaded_blocks_total") == c.blocks_loaded > 0
    assert value("tiered_kv:computed_tokens_total") == c.tokens_computed
    assert value("tiered_kv:recomputed_tokens_total") == c.tokens_recomputed
    assert value("tiered_kv:recompute_tax") == pytest.approx(c.recompute_tax)
    # vLLM's own offloading metrics come from the same payloads, into the same registry, with the same labels.
    assert value("vllm:kv_offload_store_bytes_total") > 0
