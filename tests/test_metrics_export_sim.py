"""``tiered-kv simulate --metrics PATH``: the runs' metrics as one Prometheus text exposition.

The file's values are checked against the results document of the same
command (``--json``), run by run, and the file is checked to be the same on a
second run (simulated copy latencies, not wall-clock ones).
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiered_kv.cli import main
from tiered_kv.obs import LATENCY_BUCKETS_S
from tiered_kv.obs.prometheus import SPECS

GB = 1e9


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    """The shipped quick start, cut to 150 requests (still preempting in every run; under a second)."""
    text = (files("tiered_kv") / "configs" / "quickstart-l40s.yaml").read_text()
    assert "num_requests: 400" in text
    path = tmp_path_factory.mktemp("cfg") / "quick.yaml"
    path.write_text(text.replace("num_requests: 400", "num_requests: 150"))
    return str(path)


def by_run(text: str) -> dict[str, dict[tuple[str, frozenset], float]]:
    """run label -> {(sample name, other labels): value}."""
    out: dict[str, dict[tuple[str, frozenset], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            run = labels.pop("run")
            out.setdefault(run, {})[(s.name, frozenset(labels.items()))] = s.value
    return out


def test_simulate_writes_every_runs_metrics(config, tmp_path, capsys):
    prom, doc_path = tmp_path / "out" / "m.prom", tmp_path / "doc.json"
    assert main(["simulate", config, "--metrics", str(prom), "--json", str(doc_path), "--no-progress"]) == 0
    assert f"wrote {prom}" in capsys.readouterr().out
    text = prom.read_text()
    assert {f.name for f in text_string_to_metric_families(text)} == {s.name for s in SPECS}
    doc = json.loads(doc_path.read_text())
    runs = by_run(text)
    assert list(runs) == [r["run"] for r in doc["runs"]] == ["recompute-only", "always-swap", "cost-aware+cpu-tier"]
    for r in doc["runs"]:
        m = runs[r["run"]]

        def v(name: str, m=m, **labels: str) -> float:
            return m[(name, frozenset(labels.items()))]

        def total(name: str, m=m, **labels: str) -> float:
            return sum(x for (n, ls), x in m.items() if n == name and set(labels.items()) <= ls)

        assert r["preemptions_swap"] + r["preemptions_recompute"] > 0, r["run"]  # every run preempts
        assert v("vllm:num_preemptions_total") == r["preemptions_swap"] + r["preemptions_recompute"]
        assert total("tiered_kv:preemptions_total", mode="swap") == r["preemptions_swap"]
        assert total("tiered_kv:preemptions_total", mode="recompute") == r["preemptions_recompute"]
        assert v("tiered_kv:recomputed_tokens_total") == r["tokens_recomputed"]
        assert v("tiered_kv:copies_failed_total") == r["plans_failed"]
        for kind, key in (("swap_out", "gb_swapped_out"), ("swap_in", "gb_swapped_in"), ("onboard", "gb_onboarded")):
            assert v("tiered_kv:copied_bytes_total", kind=kind) == pytest.approx(r[key] * GB, rel=1e-12)
        assert v("tiered_kv:copied_bytes_total", kind="offload") == pytest.approx(r["gb_offloaded"] * GB, rel=1e-12)
        queries, hits = v("vllm:prefix_cache_queries_total"), v("vllm:prefix_cache_hits_total")
        assert hits / queries == pytest.approx(r["gpu_prefix_hit_rate"], rel=1e-12)
        assert v("tiered_kv:tier_blocks", tier="gpu") == r["gpu_blocks"] - 1  # the null block is not usable
        assert v("vllm:num_requests_running") == v("vllm:num_requests_waiting") == 0  # every request finished
        assert v("tiered_kv:tier_free_blocks", tier="gpu") == r["gpu_blocks"] - 1 - r["blocks_held_at_end"]["gpu"]
        for kind in ("swap_out", "swap_in", "onboard", "offload"):
            n = v("tiered_kv:copy_latency_seconds_count", kind=kind)
            assert v("tiered_kv:copy_latency_seconds_bucket", kind=kind, le="+Inf") == n
            assert (n > 0) == (v("tiered_kv:copied_bytes_total", kind=kind) > 0), (r["run"], kind)
    only = runs["recompute-only"]
    assert only[("tiered_kv:preemptions_total", frozenset({("mode", "recompute"), ("reason", "requested")}))] > 0
    assert only[("tiered_kv:tier_blocks", frozenset({("tier", "cpu")}))] == 0  # this run has no CPU tier


def test_simulated_copy_latencies_are_simulated_time(config, tmp_path):
    """Latencies come from the simulated link, so a second run writes the very same file."""
    a, b = tmp_path / "a.prom", tmp_path / "b.prom"
    for path in (a, b):
        assert main(["simulate", config, "--metrics", str(path), "--no-progress"]) == 0
    assert a.read_text() == b.read_text()
    swap = by_run(a.read_text())["always-swap"]
    n = swap[("tiered_kv:copy_latency_seconds_count", frozenset({("kind", "swap_in")}))]
    fast = swap[("tiered_kv:copy_latency_seconds_bucket", frozenset({("kind", "swap_in"), ("le", "1e-05")}))]
    assert n > 0 and fast < n  # real simulated transfers (a wall-clock timing of an event would be ~0)
    assert len(LATENCY_BUCKETS_S) + 1 == sum(
        1 for name, labels in swap if name.endswith("_bucket") and ("kind", "swap_in") in labels
    )


def one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_without_prometheus_client_the_flag_names_the_extra(config, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as on an install without the extra
    err = one_line_error(["simulate", config, "--metrics", str(tmp_path / "m.prom")], capsys)
    assert err == (
        "tiered-kv simulate: --metrics needs prometheus-client, which is not installed: "
        "pip install 'tiered-kv[metrics]'\n"
    )
    assert not (tmp_path / "m.prom").exists()


def test_a_directory_as_metrics_path_fails_before_the_run(config, tmp_path, capsys):
    err = one_line_error(["simulate", config, "--metrics", str(tmp_path), "--no-progress"], capsys)
    assert err.startswith(f"tiered-kv simulate: --metrics {tmp_path}: is a directory")
