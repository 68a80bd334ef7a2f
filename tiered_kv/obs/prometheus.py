"""Prometheus export: a ``/metrics`` server for a live scheduler, and text snapshots for finished runs.

What is exported, under vLLM's names where vLLM has the metric, is the table
of :mod:`~tiered_kv.obs.metric_specs`; ``docs/metrics.md`` has it too.

Every value comes from a :class:`~tiered_kv.obs.recorder.Reading` published by
the thread that drives the scheduler; a scrape reads the latest one and never
calls into the manager (which is single-threaded).  Each exporter has its own
``CollectorRegistry``: nothing goes into ``prometheus_client``'s global one.

Needs ``prometheus_client`` (``pip install 'tiered-kv[metrics]'``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence

from tiered_kv.errors import MissingDependencyError

try:
    import prometheus_client
except ModuleNotFoundError as exc:  # the one-line message, as for every optional extra
    if exc.name != "prometheus_client":
        raise
    raise MissingDependencyError(
        "metrics export needs prometheus-client, which is not installed: pip install 'tiered-kv[metrics]'"
    ) from None
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from tiered_kv import checks
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.obs.metric_specs import SPECS, MetricSpec
from tiered_kv.obs.recorder import MetricsRecorder, Reading
from tiered_kv.sched.scheduler import Scheduler

__all__ = ["SPECS", "LatestReading", "MetricSpec", "MetricsServer", "check_port", "exposition", "families"]

_FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


def _check_sources(sources: Sequence[tuple[Mapping[str, str], Reading]]) -> tuple[str, ...]:
    """The label names the sources share; refuse mixed label names, clashes with ours, or repeated sources."""
    names: tuple[str, ...] | None = None
    seen = set()
    own = {n for s in SPECS for n in s.labels} | {"le"}
    for labels, reading in sources:
        checks.instance("reading", reading, Reading)
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise InvalidArgumentError(f"source labels must map str to str, got {checks.describe(labels)}")
        keys = tuple(sorted(labels))
        if names is None:
            names = keys
        elif keys != names:
            raise InvalidArgumentError(f"every source needs the same label names: {list(names)} vs {list(keys)}")
        if own & set(keys):
            raise InvalidArgumentError(f"source labels {sorted(own & set(keys))} clash with the metrics' own labels")
        values = tuple(labels[k] for k in keys)
        if values in seen:
            raise InvalidArgumentError(f"two sources have the same labels {dict(labels)}")
        seen.add(values)
    return names or ()


def families(sources: Sequence[tuple[Mapping[str, str], Reading]]) -> list[Metric]:
    """Every metric of :data:`SPECS`, one family each, with one set of samples per source.

    Args:
        sources: ``(labels, reading)`` pairs; ``labels`` (for example
            ``{"run": "lru-swap"}``) tell the sources apart and must have the
            same names for all of them (none for a single source).
    """
    names = _check_sources(sources)
    out: list[Metric] = []
    for spec in SPECS:
        labelnames = [*names, *spec.labels]
        if spec.type == "histogram":
            fam: Metric = HistogramMetricFamily(spec.name, spec.doc, labels=labelnames)
            for labels, reading in sources:
                base = [labels[k] for k in names]
                for kind, h in reading.copy_latency.items():
                    les = [*map(floatToGoString, h.bounds), "+Inf"]
                    fam.add_metric([*base, kind], list(zip(les, h.cumulative, strict=True)), h.sum_s)  # type: ignore[attr-defined]
        else:
            fam = _FAMILY[spec.type](spec.name, spec.doc, labels=labelnames)
            for labels, reading in sources:
                base = [labels[k] for k in names]
                for own, value in spec.values(reading):
                    fam.add_metric([*base, *own], value)  # type: ignore[attr-defined]
        out.append(fam)
    return out


def exposition(sources: Sequence[tuple[Mapping[str, str], Reading]]) -> str:
    """The Prometheus text exposition of ``sources`` (see :func:`families`)."""
    registry = CollectorRegistry()
    registry.register(_Fixed(families(sources)))
    return prometheus_client.generate_latest(registry).decode()


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


class LatestReading(Collector):
    """A collector that serves the latest published reading (swapped in whole: scrapes never see half of one)."""

    def __init__(self) -> None:
        self._latest: Reading | None = None

    def publish(self, reading: Reading) -> None:
        self._latest = checks.instance("reading", reading, Reading)

    def collect(self) -> Iterator[Metric]:
        latest = self._latest  # one read: the publisher may swap it meanwhile
        return iter(families([({}, latest)]) if latest is not None else [])


class MetricsServer:
    """Serves one scheduler's metrics at ``http://HOST:PORT/metrics`` until closed.

    The driver calls :meth:`publish` at step boundaries (from its own thread);
    scrapes see the last published reading.  It publishes once on start.

    Args:
        scheduler: The scheduler to observe (it is observed from now on).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        host: Address to bind; loopback by default, so nothing is exposed by accident.
    """

    def __init__(self, scheduler: Scheduler, port: int = 0, host: str = "127.0.0.1") -> None:
        check_port(port)
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError(f"host must be a non-empty address string, got {checks.describe(host)}")
        self.recorder = MetricsRecorder(scheduler)
        self.host = host
        self.collector = LatestReading()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self._lock = threading.Lock()
        try:
            self.publish()
            self._httpd, self._thread = prometheus_client.start_http_server(port, host, self.registry)
        except BaseException:
            self.recorder.close()
            raise
        self._closed = False

    @property
    def port(self) -> int:
        """The bound port (the one picked when 0 was asked)."""
        return int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def publish(self) -> Reading:
        """Take a reading now and serve it; return it (call from the thread that drives the scheduler)."""
        reading = self.recorder.read()
        self.collector.publish(reading)
        return reading

    def close(self) -> None:
        """Stop serving, free the port and stop observing (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        self.recorder.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_port(port: object) -> int:
    """A TCP port number (0: any free port)."""
    if port.__class__ is not int or not 0 <= port <= 65535:  # type: ignore[operator]
        raise InvalidArgumentError(f"metrics port must be an int from 0 to 65535, got {checks.describe(port)}")
    return port  # type: ignore[return-value]
