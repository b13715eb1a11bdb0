"""The staleness bound on the trainer's side (``async_training``, AReaL's and verl's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from rolloutbus.config import AsyncTrainingConfig
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.metrics import StalenessMetrics

__all__ = ["StaleGroupReport", "StalenessFilter"]

log = logging.getLogger(__name__)


@dataclass
class StaleGroupReport:
    """What the staleness filter did since the client started (``TrainerClient.stale``)."""

    dropped: int = 0
    down_weighted: int = 0
    max_staleness: int = 0  # the largest staleness seen in any group received
    # the last dropped groups: (uid, min policy version, policy version when dropped)
    recent_dropped: list[tuple[str, int, int]] = field(default_factory=list)

    RECENT = 32  # dropped groups kept in recent_dropped

    def note_dropped(self, uid: str, min_version: int, current: int) -> None:
        self.dropped += 1
        self.recent_dropped = [*self.recent_dropped, (uid, min_version, current)][-self.RECENT :]


class StalenessFilter:
    """AReaL's and verl's bound on the trainer's side: a group whose oldest token was
    sampled by a version older than ``current - staleness_threshold`` is stale; it is
    dropped (not yielded: its records count as consumed, so it is never delivered again)
    or yielded with ``loss_weight = stale_group_weight``, by ``stale_group_policy``.

    The current version is the trainer's: it calls :meth:`TrainerClient.set_policy_version`
    when it publishes one, or the client follows ``rollout.control`` (``follow_control``).
    A group without versions (an engine that reports none) is never stale.
    """

    def __init__(self, config: AsyncTrainingConfig, registry: CollectorRegistry | None = None):
        self.config = config
        self.policy_version = 0
        self.report = StaleGroupReport()
        self._metrics = StalenessMetrics(registry)

    def admit(self, group: TrajectoryGroup) -> bool:
        """Stamp ``group`` with its staleness and weight; False if it is to be dropped."""
        oldest = group.min_policy_version
        if oldest is None:
            return True
        group.staleness = max(0, self.policy_version - oldest)
        self.report.max_staleness = max(self.report.max_staleness, group.staleness)
        self._metrics.staleness.observe(group.staleness)
        if group.staleness <= self.config.staleness_threshold:
            return True
        if self.config.stale_group_policy == "drop":
            self.report.note_dropped(group.uid, oldest, self.policy_version)
            self._metrics.stale_groups.labels("dropped").inc()
            log.info(
                "dropped stale group %s: min policy version %d, current %d, staleness_threshold %d",
                group.uid,
                oldest,
                self.policy_version,
                self.config.staleness_threshold,
            )
            return False
        group.loss_weight = self.config.stale_group_weight
        self.report.down_weighted += 1
        self._metrics.stale_groups.labels("down_weighted").inc()
        return True
