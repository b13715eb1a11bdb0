"""The trainer client's Prometheus series, in any trainer process: groups skipped,
stale ones dropped, and the latency from a group's last turn to the trainer."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from rolloutbus.metrics import GROUP_SECONDS_BUCKETS, PerRegistry

__all__ = ["DeliveryMetrics", "StalenessMetrics", "TrainerClientMetrics"]


class StalenessMetrics(PerRegistry):
    """The trainer client's staleness filter (``async_training.stale_group_policy``)."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.stale_groups = Counter(
            "rolloutbus_trainer_client_stale_groups_total",
            "Groups whose min policy version is older than the staleness bound allows, by "
            "action: dropped (not yielded) or down_weighted (yielded with a smaller weight); "
            "groups",
            ["action"],
            registry=registry,
        )
        self.staleness = Histogram(
            "rolloutbus_trainer_client_group_staleness_versions",
            "Current policy version minus the group's min policy version, per group received "
            "(staleness at training); versions",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32),
            registry=registry,
        )


class TrainerClientMetrics(PerRegistry):
    """The trainer client's groups that never reach the trainer, besides stale ones."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.skipped_groups = Counter(
            "rolloutbus_trainer_client_skipped_groups_total",
            "Complete groups skipped (consumed, never yielded), by reason: too_few_successful "
            "(fewer completed or truncated members than trainer.min_successful_per_group); groups",
            ["reason"],
            registry=registry,
        )


class DeliveryMetrics(PerRegistry):
    """The trainer client: how long a finished rollout waits for the trainer."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.last_turn_latency = Histogram(
            "rolloutbus_trainer_client_last_turn_latency_seconds",
            "From the last turn event of a group (its log timestamp) to the trainer client "
            "yielding the complete group; seconds",
            buckets=GROUP_SECONDS_BUCKETS,
            registry=registry,
        )

    def observe_record(self, timestamp: tuple[int, int]) -> None:
        """``timestamp``: the group's last trajectory record's ``Message.timestamp()``; the
        replay buffer stamps a group's records with its last turn's log time."""
        kind, ms = timestamp
        if kind != 0 and ms > 0:  # 0: TIMESTAMP_NOT_AVAILABLE
            self.last_turn_latency.observe(max(0.0, time.time() - ms / 1000))
