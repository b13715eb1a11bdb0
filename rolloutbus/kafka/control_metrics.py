"""The Prometheus series of every reader of ``rollout.control``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from rolloutbus.metrics import PerRegistry

__all__ = ["ControlMetrics"]


class ControlMetrics(PerRegistry):
    """Readers of ``rollout.control`` (``rolloutbus.kafka.version_ledger``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.refused = Counter(
            "rolloutbus_control_records_refused_total",
            "Control records a follower did not take, by reason: older_run (a superseded "
            "run's, ignored), backwards, no_weights, unknown_run, conflicting_run, malformed "
            "(errors: dead-lettered by the weight sync); records",
            ["reason"],
            registry=registry,
        )
        self.run_epoch = Gauge(
            "rolloutbus_control_run_epoch",
            "Run epoch of the newest trainer run this process follows (0: none yet); epoch number",
            registry=registry,
        )
