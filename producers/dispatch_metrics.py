"""``rolloutbus dispatch``'s Prometheus series, read from its report at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["DispatchCollector"]


class DispatchCollector:
    """``rolloutbus dispatch``: the dispatcher's progress, read from its report at scrape
    time (``report()`` returns a ``DispatchReport`` or None before the run starts)."""

    def __init__(self, report: Callable[[], Any], waiting: Callable[[], bool]):
        self._report = report
        self._waiting = waiting

    def collect(self) -> Iterator[Any]:
        report = self._report()
        if report is None:
            return
        yield _gauge(
            "rolloutbus_dispatch_groups_started",
            "Groups of this run on the prompt topic (found there at start plus published); groups",
            report.started,
        )
        yield CounterMetricFamily(
            "rolloutbus_dispatch_groups_published",
            "Groups this process published; groups",
            value=report.published,
        )
        yield CounterMetricFamily(
            "rolloutbus_dispatch_dead_letters",
            "Dataset rows sent to the dead-letter topic; rows",
            value=report.dead_lettered,
        )
        yield _gauge(
            "rolloutbus_dispatch_policy_version",
            "The trainer's latest policy version the dispatcher has read; version number",
            report.policy_version,
        )
        yield _gauge(
            "rolloutbus_dispatch_bound_groups",
            "Groups the staleness bound allows started at that version; groups",
            report.bound,
        )
        yield _gauge(
            "rolloutbus_dispatch_waiting",
            "1 while the staleness bound holds the dispatcher back (waiting for the trainer), "
            "else 0; boolean",
            1 if self._waiting() else 0,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
