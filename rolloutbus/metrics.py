"""Prometheus metrics of the rollout pipeline (prefix ``rolloutbus_``, base units): what
every process's metric set shares. The sets live beside the process they describe
(``streams/sessions/metrics.py``, ``streams/assembly/metrics.py``, ...).

Every help text ends in ``; <unit>``. No ``_created`` series: prometheus_client would add one
per counter, histogram and label set (a timestamp Prometheus does not need), doubling the
series a dashboard never reads; importing this module turns them off in the process
(``disable_created_metrics``). ``docs/reference/metrics.md`` lists every series
(``ops/metric_reference.py`` writes it from the sets).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)

from rolloutbus.config import LOOPBACK

disable_created_metrics()  # for the whole process: see the module docstring

# seconds; a prompt group on CPU takes seconds, on a busy GPU fleet up to half an hour
GROUP_SECONDS_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
# seconds; a generate() on CPU takes seconds, a tool call milliseconds to minutes
AGENT_LOOP_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class PerRegistry:
    """One instance per (class, registry): several workers in one process (tests,
    benchmarks) share the series instead of registering them twice."""

    _instances: dict[type, weakref.WeakKeyDictionary] = {}

    def __new__(cls, registry: CollectorRegistry | None = None):
        registry = REGISTRY if registry is None else registry
        per_class = PerRegistry._instances.setdefault(cls, weakref.WeakKeyDictionary())
        if registry not in per_class:
            instance = super().__new__(cls)
            instance._init(registry)
            per_class[registry] = instance
        return per_class[registry]

    def __init__(self, registry: CollectorRegistry | None = None):
        pass  # built once in _init

    def _init(self, registry: CollectorRegistry) -> None:
        raise NotImplementedError


class SeriesDeclarer:
    """Declares a metric set's series on one registry: ``counter(name, help, labels=...)``
    is prometheus_client's ``Counter(name, help, labels, registry=registry)`` (likewise
    ``gauge``, and ``histogram`` with its ``buckets``); names, help texts, labels and
    buckets pass through as written."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


def failure_class_of(record: object) -> str:
    """The failure class a failed session or trajectory names (``infrastructure``, ``loop``,
    ``reward``), or ``unknown`` for a record written before the field existed."""
    value = getattr(record, "failure_class", None)
    return str(getattr(value, "value", value)) if value else "unknown"


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The text format of ``registry`` (no ``_created`` series: this module turned them off)."""
    return generate_latest(registry)


def serve_metrics(port: int | None, host: str = LOOPBACK, *collectors: Any) -> bool:
    """Serve ``/metrics`` when a port is configured, with ``collectors`` added to the
    process's registry; False (nothing started) for None."""
    if port is None:
        return False
    for collector in collectors:
        REGISTRY.register(collector)
    start_metrics_server(port, host)
    return True


def start_metrics_server(port: int, addr: str = LOOPBACK) -> None:
    """Serve ``/metrics`` on ``addr:port``: loopback unless the caller passes the configured
    address (``sessions.metrics_host``, ``replay_buffer.metrics_host``); prometheus_client's
    own default would be every interface."""
    start_http_server(port, addr=addr)
