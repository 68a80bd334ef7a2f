"""Metrics export: reason labels, the recorder, the exposition and the HTTP server's life cycle.

The engine's scraped ``/metrics`` is checked value by value in
``test_metrics_export_engine.py``, the simulator's snapshot file in
``test_metrics_export_sim.py``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
from mgrutil import make_tm, run
from poolutil import letters
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.core import Request
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.manager import CostModel
from tiered_kv.manager.outcomes import Completion, Decision
from tiered_kv.manager.states import PreemptMode
from tiered_kv.obs import LATENCY_BUCKETS_S, REASONS, MetricsRecorder, decision_reason
from tiered_kv.obs.prometheus import SPECS, MetricsServer, exposition
from tiered_kv.sched import Scheduler
from tiered_kv.transfer.plan import PlanKind

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "metrics.md"


class FloorCost(CostModel):
    """A cost model whose recompute has a floor even for no tokens: "auto" then picks swap for nothing."""

    def recompute_time(self, context_len: int) -> float:
        return 1.0


SLOW_LINK = CostModel(kv_bytes_per_token=1024, block_size=4, d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0)


# ------------------------------------------------------------------ reasons
def preempt(mode: str, computed: bool = True, **tm_kw) -> Decision:
    """One request of 8 tokens (2 blocks) on a tiny manager, preempted under ``mode``; its decision."""
    tm, _ = make_tm(**tm_kw)
    if computed:
        run(tm, "a", "abcdefgh")
    else:
        req = Request("a", letters("abcdefgh"))
        assert tm.admit(req, req.num_tokens) is not None  # blocks held, nothing computed yet
        tm.poll()  # a later step, in which it is not batched (a request batched in its step is no victim)
    assert tm.preempt("a", mode) is not None
    assert len(tm.decision_log) == 1
    return tm.decision_log[0]


# (mode asked, computed?, manager kwargs) -> (mode taken, label, how the manager's words begin)
SCENARIOS = {
    "swap_cheaper": (("auto", True, {}), (PreemptMode.SWAP, "swap_cheaper", "swap is cheaper")),
    "recompute_cheaper": (
        ("auto", True, {"cost_model": SLOW_LINK}),
        (PreemptMode.RECOMPUTE, "recompute_cheaper", "recompute is no dearer"),
    ),
    "cpu_full": (
        ("auto", True, {"cpu": 2}),
        (PreemptMode.RECOMPUTE, "cpu_full", "recompute: the CPU tier has no room"),
    ),
    "cpu_full_although_cheaper": (
        ("auto", True, {"cpu": 2}),
        (PreemptMode.RECOMPUTE, "cpu_full", "recompute: the CPU tier has no room for 2 blocks although swapping"),
    ),
    "no_cpu_tier": (("auto", True, {"cpu": 0}), (PreemptMode.RECOMPUTE, "no_cpu_tier", "recompute: there is no CPU")),
    "nothing_computed": (  # a forced swap of nothing is refused (None); "auto" recomputes when swap looked cheaper
        ("auto", False, {"cost_model": FloorCost(kv_bytes_per_token=1024, block_size=4)}),
        (PreemptMode.RECOMPUTE, "nothing_computed", "nothing is computed yet"),
    ),
    "swap_requested": (("swap", True, {}), (PreemptMode.SWAP, "requested", "swap requested")),
    "recompute_requested": (("recompute", True, {}), (PreemptMode.RECOMPUTE, "requested", "recompute requested")),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_real_manager_decision_gets_the_label_its_words_give(name):
    (mode, computed, kw), (taken, label, words) = SCENARIOS[name]
    d = preempt(mode, computed, **kw)
    assert d.mode is taken and d.reason.startswith(words), d.reason
    assert decision_reason(d) == label
    assert taken in REASONS[label]


def test_every_label_is_reached_by_some_scenario():
    assert {label for _, (_, label, _) in SCENARIOS.values()} == set(REASONS)


def test_decisions_the_manager_cannot_make_are_refused():
    swap = preempt("auto")  # a swap with 8 computed tokens and room on the CPU
    computed_but_recomputed = dataclasses.replace(swap, mode=PreemptMode.RECOMPUTE)
    with pytest.raises(InvalidArgumentError, match="recompute although a swap was chosen"):
        decision_reason(computed_but_recomputed)
    full = preempt("auto", cpu=2)
    forced = dataclasses.replace(full, requested="swap")  # a forced swap that could not swap returns None instead
    with pytest.raises(InvalidArgumentError, match="forced swap"):
        decision_reason(forced)
    with pytest.raises(InvalidArgumentError, match="decision must be a Decision"):
        decision_reason("swap is cheaper")


# ----------------------------------------------------------------- recorder
def scheduler(**tm_kw) -> Scheduler:
    tm, _ = make_tm(**tm_kw)
    return Scheduler(tm)


def landed(kind: PlanKind, elapsed_s: float, ok: bool = True) -> Completion:
    return Completion(1, "r", kind, ok, 0, None, 4096, elapsed_s)


def test_latencies_fall_in_the_first_bucket_at_or_above_them():
    rec = MetricsRecorder(scheduler(), buckets=(1e-3, 1e-2))
    for c in (
        landed(PlanKind.SWAP_OUT, 1e-3),  # exactly on a bound: counted under it (Prometheus' "le")
        landed(PlanKind.SWAP_OUT, 2e-3),
        landed(PlanKind.SWAP_OUT, 20.0),  # above every bound: only in +Inf
        landed(PlanKind.SWAP_OUT, 5e-4, ok=False),  # failed: no latency
        landed(PlanKind.ONBOARD, 0.0),
        landed(PlanKind.COPY, 1e-3),  # not a kind the manager emits
    ):
        rec.observe(c)
    h = rec.read().copy_latency
    assert set(h) == {"swap_out", "swap_in", "onboard", "offload"}
    assert h["swap_out"].bounds == (1e-3, 1e-2)
    assert h["swap_out"].cumulative == (1, 2, 3) and h["swap_out"].count == 3
    assert h["swap_out"].sum_s == 1e-3 + 2e-3 + 20.0
    assert h["onboard"].cumulative == (1, 1, 1) and h["onboard"].sum_s == 0.0
    assert h["swap_in"].cumulative == (0, 0, 0) and h["offload"].count == 0


@pytest.mark.parametrize("buckets", [(), (1e-3, 1e-3), (1e-2, 1e-3), (0.0, 1.0), (1.0, float("inf")), [1.0], (True,)])
def test_bad_buckets_are_refused_and_nothing_is_observed(buckets):
    sched = scheduler()
    with pytest.raises(InvalidArgumentError, match="buckets must be"):
        MetricsRecorder(sched, buckets=buckets)
    assert sched.completion_observers == []


def test_recorder_needs_a_scheduler():
    with pytest.raises(InvalidArgumentError, match="scheduler must be a Scheduler"):
        MetricsRecorder(make_tm()[0])


def test_the_recorder_sees_applied_copies_until_closed():
    tm, eng = make_tm(offload="write_through")
    sched = Scheduler(tm)
    rec = MetricsRecorder(sched)
    seen: list[Completion] = []
    sched.completion_observers.append(seen.append)
    sched.add_request(Request("a", letters("abcdefgh"), max_tokens=2))
    out = sched.schedule()
    sched.update(out, {"a": 1})  # the prompt's two full blocks are computed: write-through stores them
    eng.complete_all()
    sched.schedule()
    assert [c.kind for c in seen] == [PlanKind.OFFLOAD]
    assert rec.read().copy_latency["offload"].count == 1
    rec.close()
    rec.close()  # idempotent
    assert sched.completion_observers == [seen.append]


def test_a_raising_observer_leaves_the_copy_applied():
    tm, eng = make_tm(gpu=5, cpu=9)
    sched = Scheduler(tm)

    def broken(c: Completion) -> None:
        raise RuntimeError("observer bug")

    sched.completion_observers.append(broken)
    for rid in "ab":
        sched.add_request(Request(rid, letters("abcdefgh" if rid == "a" else "ijklmnop"), max_tokens=4))
    out = sched.schedule()
    sched.update(out, {"a": 1, "b": 2})
    out = sched.schedule()  # both need a third block; 4 are usable: one is swapped out
    assert any(mode is PreemptMode.SWAP for _, mode in out.preempted)
    eng.complete_all()
    with pytest.raises(RuntimeError, match="observer bug"):
        sched.schedule()
    sched.check_consistency()  # the swap-out was applied before the observer ran
    assert sched.copies_landed == 1


# --------------------------------------------------------------- exposition
def parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def reading(**tm_kw):
    return MetricsRecorder(scheduler(**tm_kw)).read()


def test_exposition_has_every_metric_once_per_source_with_the_source_labels():
    fams = parse(exposition([({"run": "a"}, reading()), ({"run": "b"}, reading(cpu=0))]))
    assert list(fams) == [s.name for s in SPECS]
    for spec in SPECS:
        fam = fams[spec.name]
        assert fam.type == spec.type
        for s in fam.samples:
            own = set(s.labels) - {"run", "le"}
            assert own == set(spec.labels), (spec.name, s.labels)
        assert {s.labels["run"] for s in fam.samples} == {"a", "b"}
    cpu = {s.labels["run"]: s.value for s in fams["tiered_kv:tier_blocks"].samples if s.labels["tier"] == "cpu"}
    assert cpu == {"a": 8.0, "b": 0.0}  # make_tm's CPU store: 9 slots, one reserved; none without a tier


def test_exposition_of_nothing_is_empty_families():
    assert all(f.samples == [] for f in parse(exposition([])).values())


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([({"run": "a"}, None)], "reading must be a Reading"),
        ([({"run": 1}, "R")], "labels must map str to str"),
        ([({"run": "a"}, "R"), ({"cfg": "b"}, "R")], "same label names"),
        ([({"run": "a"}, "R"), ({"run": "a"}, "R")], "same labels"),
        ([({"kind": "a"}, "R")], "clash"),
    ],
)
def test_bad_sources_are_refused(sources, message):
    r = reading()
    sources = [(labels, r if x == "R" else x) for labels, x in sources]
    with pytest.raises(InvalidArgumentError, match=message):
        exposition(sources)


def test_docs_table_lists_exactly_the_exported_metrics():
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"\| `((?:vllm|tiered_kv):\w+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    assert set(rows) == {s.name for s in SPECS}
    for s in SPECS:
        kind, labels = rows[s.name]
        assert kind == s.type, s.name
        assert labels == (", ".join(f"`{x}`" for x in s.labels) or "-"), s.name
    text = DOCS.read_text()
    assert all(f"`{label}`" in text for label in REASONS)
    assert ", ".join(f"{b:g}" for b in LATENCY_BUCKETS_S) in " ".join(text.split())  # the buckets as documented


# ------------------------------------------------------------------- server
def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def wait_for_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before`` that are still alive after a generous grace for daemon handlers."""
    for _ in range(1000):
        extra = set(threading.enumerate()) - before
        if not extra:
            return extra
        threading.Event().wait(0.01)
    return extra


def test_server_serves_published_readings_and_frees_its_port_and_threads():
    before = set(threading.enumerate())
    sched = scheduler()
    with MetricsServer(sched) as srv:
        assert srv.url == f"http://127.0.0.1:{srv.port}/metrics" and srv.port > 0
        fams = parse(get(srv.url))
        assert [s.value for s in fams["tiered_kv:tier_free_blocks"].samples] == [8.0, 8.0]
        run(sched.tm, "x", "abcdefgh")  # a driver changes things; scrapes see them once published
        assert [s.value for s in parse(get(srv.url))["tiered_kv:tier_free_blocks"].samples] == [8.0, 8.0]
        srv.publish()
        assert [s.value for s in parse(get(srv.url))["tiered_kv:tier_free_blocks"].samples] == [6.0, 8.0]
        port = srv.port
    srv.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert sched.completion_observers == []
    assert wait_for_threads(before) == set()


@pytest.mark.parametrize("port", [-1, 65536, True, "9100", 9100.0, None])
def test_bad_ports_are_refused_before_anything_starts(port):
    before = set(threading.enumerate())
    sched = scheduler()
    with pytest.raises(InvalidArgumentError, match="metrics port must be an int from 0 to 65535"):
        MetricsServer(sched, port)
    assert sched.completion_observers == [] and set(threading.enumerate()) == before


def test_a_port_in_use_fails_and_leaves_the_scheduler_unobserved():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        sched = scheduler()
        with pytest.raises(OSError):
            MetricsServer(sched, s.getsockname()[1])
        assert sched.completion_observers == []


def test_bad_host_is_refused():
    sched = scheduler()
    with pytest.raises(InvalidArgumentError, match="host must be"):
        MetricsServer(sched, 0, "")
    assert sched.completion_observers == []
