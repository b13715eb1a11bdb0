"""``rolloutbus weight-sync``'s Prometheus series: policy versions applied to the replicas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rolloutbus.metrics import PerRegistry

__all__ = ["WeightSyncMetrics"]


class WeightSyncMetrics(PerRegistry):
    """``rolloutbus weight-sync``: policy versions applied to the replicas."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.syncs = Counter(
            "rolloutbus_weight_sync_total",
            "Replica syncs by outcome: applied (weights loaded), labelled (version 0, the "
            "initial weights: label only), failed; syncs",
            ["outcome"],
            registry=registry,
        )
        self.replica_version = Gauge(
            "rolloutbus_weight_sync_replica_policy_version",
            "Policy version each replica was last moved to; version number",
            ["replica"],
            registry=registry,
        )
        self.sync_seconds = Histogram(
            "rolloutbus_weight_sync_duration_seconds",
            "Wall time to move one replica to a version (pause to resume); seconds",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
