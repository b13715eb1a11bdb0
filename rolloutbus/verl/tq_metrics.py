"""The bus sampler's Prometheus series, in verl's trainer process: groups read from the
trajectory topic that TransferQueue did not ask for."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from rolloutbus.metrics import PerRegistry

__all__ = ["BusSamplerMetrics"]


class BusSamplerMetrics(PerRegistry):
    """Groups the bus sampler drops instead of writing them to TransferQueue."""

    def _init(self, registry: CollectorRegistry) -> None:
        self.dropped_groups = Counter(
            "rolloutbus_verl_sampler_dropped_groups_total",
            "Complete groups read from the trajectory topic and not written to TransferQueue, "
            "by reason: not_requested (TransferQueue holds no prompt with that uid in the "
            "group's partition: a stray, an older run, a cleared prompt) or settled (the "
            "prompt is already finished or failed there: a re-read); groups",
            ["reason"],
            registry=registry,
        )
        self.written_groups = Counter(
            "rolloutbus_verl_sampler_written_groups_total",
            "Groups written to TransferQueue, by the status their prompt got: finished or "
            "failure; groups",
            ["status"],
            registry=registry,
        )
