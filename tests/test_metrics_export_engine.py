"""The real engine's ``/metrics``: started on a free localhost port, scraped over HTTP, checked value by value.

Every scraped sample is compared with what the engine's own API says at the
same moment (``Engine.metrics()``, the scheduler's statuses, recomputed tokens
and decision log, and the copies the test saw the scheduler apply), and the
expected samples are written out here, independently of the exporter's table:
a metric that goes missing, appears unannounced or drifts from its source fails.
"""

from __future__ import annotations

import random
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter

import pytest
from engine_configs import engine_config
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.engine.engine import Engine
from tiered_kv.errors import InvalidArgumentError, InvalidTransitionError, MissingDependencyError
from tiered_kv.manager.outcomes import Completion
from tiered_kv.manager.states import Residency
from tiered_kv.obs import LATENCY_BUCKETS_S, decision_reason
from tiered_kv.sched import RequestStatus
from tiered_kv.transfer.cpu_engine import CpuCopyEngine

KINDS = ("swap_out", "swap_in", "onboard", "offload")
PAIRS = [("swap", "swap_cheaper"), ("swap", "requested")] + [
    ("recompute", r) for r in ("recompute_cheaper", "cpu_full", "no_cpu_tier", "nothing_computed", "requested")
]

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """GET ``url`` and parse the exposition; ``le`` labels become floats so bounds compare as numbers."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {k: (float(v) if k == "le" else v) for k, v in s.labels.items()}
            key = (s.name, frozenset(labels.items()))
            assert key not in out, key
            out[key] = s.value
    return out


def expected(engine: Engine, applied: list[Completion]) -> Samples:
    """Every sample /metrics must show now, from the engine's public API."""
    m = engine.metrics()
    c = m.counters
    sched = engine.scheduler
    S = RequestStatus
    # An arriving request waits while its prefix loads, and counts as swapped while its swap-in lands.
    status = Counter(
        (S.WAITING if sched.tm.state(rid).residency is Residency.LOADING else S.SWAPPED) if st is S.ARRIVING else st
        for rid, st in sched.status.items()
    )
    plain = {
        "vllm:kv_cache_usage_perc": m.gpu_usage,
        "vllm:prefix_cache_queries_total": c.gpu_query_tokens,
        "vllm:prefix_cache_hits_total": c.gpu_hit_tokens,
        "vllm:external_prefix_cache_queries_total": c.cpu_query_tokens,
        "vllm:external_prefix_cache_hits_total": c.cpu_hit_tokens,
        "vllm:num_preemptions_total": c.preemptions_swap + c.preemptions_recompute,
        "vllm:num_requests_running": status[S.RUNNING],
        "vllm:num_requests_waiting": status[S.WAITING],
        "tiered_kv:num_requests_swapped": status[S.SWAPPED],
        "tiered_kv:cpu_cache_usage_perc": m.cpu_usage,
        "tiered_kv:cpu_cached_blocks": m.cpu_cached_blocks,
        "tiered_kv:cpu_pinned_blocks": m.cpu_pinned_blocks,
        "tiered_kv:copies_submitted_total": c.plans_submitted,
        "tiered_kv:copies_failed_total": c.plans_failed,
        "tiered_kv:copies_cancelled_total": c.plans_cancelled,
        "tiered_kv:copies_in_flight": m.plans_in_flight,
        "tiered_kv:swaps_dropped_total": c.swaps_dropped,
        "tiered_kv:recomputed_tokens_total": sched.tokens_recomputed,
    }
    out: Samples = {(name, frozenset()): float(v) for name, v in plain.items()}

    def put(name: str, value: float, **labels: object) -> None:
        out[(name, frozenset(labels.items()))] = float(value)

    for tier, total, free, evicted in (
        ("gpu", m.gpu_blocks, m.gpu_free_blocks, c.gpu_blocks_evicted),
        ("cpu", m.cpu_blocks, m.cpu_free_blocks, c.cpu_blocks_evicted),
    ):
        put("tiered_kv:tier_blocks", total, tier=tier)
        put("tiered_kv:tier_free_blocks", free, tier=tier)
        put("tiered_kv:evicted_blocks_total", evicted, tier=tier)
    for kind in KINDS:
        put("tiered_kv:copied_blocks_total", getattr(c, f"{kind}_blocks"), kind=kind)
        put("tiered_kv:copied_bytes_total", getattr(c, f"{kind}_bytes"), kind=kind)
        times = [x.elapsed_s for x in applied if x.ok and x.kind.value == kind]
        for le in (*LATENCY_BUCKETS_S, float("inf")):
            put("tiered_kv:copy_latency_seconds_bucket", sum(t <= le for t in times), kind=kind, le=le)
        put("tiered_kv:copy_latency_seconds_count", len(times), kind=kind)
        put("tiered_kv:copy_latency_seconds_sum", sum(times), kind=kind)
    decisions = Counter((d.mode.value, decision_reason(d)) for d in sched.tm.decision_log)
    assert set(decisions) <= set(PAIRS)
    for mode, reason in PAIRS:
        put("tiered_kv:preemptions_total", decisions[(mode, reason)], mode=mode, reason=reason)
    return out


class Synchronous(CpuCopyEngine):
    """Real copies on the CPU engine's threads, finished before ``submit`` returns.

    Every copy then lands at the scheduler's next poll, so the schedule, and
    every count below, is the same on every run (copy latencies still vary).
    """

    def submit(self, plan):
        handle = super().submit(plan)
        handle.wait()
        return handle


def workload(engine: Engine) -> None:
    """Eight requests sharing an 8-token prefix on an 18-block GPU pool and a 12-block CPU tier, then a ninth.

    With :class:`Synchronous` copies this always goes the same way: requests
    are swapped out and back in, one is recomputed because the CPU tier is
    full, and write-through stores prompt blocks.  The ninth resends the
    fifth's prompt: its blocks past the shared prefix have left the GPU, and it
    loads them from the CPU tier, a prefix hit of a fresh request.  (The
    recompute victim finds its own blocks again when it is re-admitted; as in
    vLLM, that is not counted as a prefix hit.)
    """
    rng = random.Random(5)
    prefix = [rng.randrange(512) for _ in range(8)]
    prompts = [prefix + [rng.randrange(512) for _ in range(rng.randrange(6, 24))] for _ in range(8)]
    for i, prompt in enumerate(prompts):
        engine.add_request(i, prompt, 10)
    engine.add_request(8, prompts[4] + [1, 2, 3], 10)


def make_engine(copy_engine=Synchronous, **kw) -> tuple[Engine, list[Completion]]:
    config = engine_config(num_gpu_blocks=18, num_cpu_blocks=12, mode="auto", offload="write_through", **kw)
    e = Engine(config=config, copy_engine=copy_engine)
    applied: list[Completion] = []
    e.scheduler.completion_observers.append(applied.append)
    return e, applied


def test_metrics_scraped_mid_run_and_at_the_end_match_the_engine():
    before = set(threading.enumerate())
    e, applied = make_engine(metrics_port=0)
    url = e.metrics_server.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert scrape(url) == expected(e, applied)  # before any step: the published start state
    workload(e)
    while not (e.metrics().counters.preemptions_swap and e.metrics().counters.preemptions_recompute):
        assert e.step()
    assert e.scheduler.num_unfinished  # mid-run, with requests in several states
    mid = scrape(url)
    assert mid == expected(e, applied)
    e.run()
    end = scrape(url)
    assert end == expected(e, applied)

    # The run exercised what the metrics are for (so the equalities above are not all zeros).
    def total(name: str, **labels: str) -> float:
        return end[(name, frozenset(labels.items()))]

    assert total("tiered_kv:preemptions_total", mode="swap", reason="swap_cheaper") > 0
    assert total("tiered_kv:preemptions_total", mode="recompute", reason="cpu_full") > 0
    assert total("tiered_kv:recomputed_tokens_total") > 0
    for kind in KINDS:
        assert total("tiered_kv:copied_bytes_total", kind=kind) > 0, kind
        assert total("tiered_kv:copy_latency_seconds_count", kind=kind) > 0, kind
    assert total("vllm:external_prefix_cache_hits_total") > 0 and total("vllm:prefix_cache_hits_total") > 0
    assert total("vllm:num_requests_running") == 0 and mid[("vllm:num_requests_running", frozenset())] > 0
    assert sum(x.ok for x in applied) == e.scheduler.copies_landed

    port = e.metrics_server.port
    e.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    for _ in range(1000):  # request handlers are daemon threads that end just after their response
        if set(threading.enumerate()) <= before:
            break
        threading.Event().wait(0.01)
    assert set(threading.enumerate()) <= before


def test_scrapes_during_a_run_never_enter_the_manager():
    """A scraper thread hammering /metrics while the engine runs: every scrape answers, none races the manager.

    The tier manager raises ConcurrentUseError when a second thread enters it;
    a scrape that called it would fail (HTTP 500) or break the run.
    """
    e, _ = make_engine(copy_engine=None)  # the default engine: copies land whenever its threads finish
    url = e.serve_metrics(0)
    workload(e)
    stop = threading.Event()
    results: list[object] = []

    def scraper() -> None:
        while not stop.is_set():
            try:
                results.append(scrape(url)[("vllm:prefix_cache_queries_total", frozenset())])
            except Exception as exc:  # any failure is the finding
                results.append(exc)

    t = threading.Thread(target=scraper)
    t.start()
    try:
        e.run()
    finally:
        stop.set()
        t.join()
        e.close()
    assert results and not [r for r in results if isinstance(r, Exception)]
    assert results == sorted(results)  # a counter, read whole each time: never goes back


def test_serving_twice_is_refused_and_closing_twice_is_fine():
    e, _ = make_engine()
    try:
        url = e.serve_metrics(0)
        with pytest.raises(InvalidTransitionError, match="already served at"):
            e.serve_metrics(0)
        assert e.metrics_server.url == url
    finally:
        e.close()
    e.metrics_server.close()


@pytest.mark.parametrize("port", [-1, 70000, True, "9400"])
def test_a_bad_metrics_port_fails_before_the_engine_starts_anything(port):
    before = set(threading.enumerate())
    with pytest.raises(InvalidArgumentError, match="metrics port must be an int from 0 to 65535"):
        Engine(config=engine_config(num_gpu_blocks=8, metrics_port=port))
    assert set(threading.enumerate()) == before


def test_without_prometheus_client_the_port_fails_with_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as on an install without the extra
    monkeypatch.delitem(sys.modules, "tiered_kv.obs.prometheus", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tiered-kv\[metrics\]'"):
        Engine(config=engine_config(num_gpu_blocks=8, metrics_port=0))
