"""Observability: the scheduler's and the tier manager's numbers, ready to export.

This package sits above the scheduler (it reads :class:`~tiered_kv.sched.Scheduler`
and the manager's metrics) and below the drivers that publish it (the real
engine serves it over HTTP, the simulator writes it to a file).  Everything
here but :mod:`tiered_kv.obs.prometheus` needs only the standard library; that
module needs ``prometheus_client`` (the ``metrics`` extra).
"""

from tiered_kv.obs.recorder import (
    LATENCY_BUCKETS_S,
    REASONS,
    LatencyHistogram,
    MetricsRecorder,
    Reading,
    decision_reason,
)

__all__ = ["LATENCY_BUCKETS_S", "REASONS", "LatencyHistogram", "MetricsRecorder", "Reading", "decision_reason"]
