"""``rolloutbus lag-exporter``: consumer lag of every stage, for Prometheus.

Reads, every ``monitoring.lag_poll_s``, the committed offsets of the session workers'
group (prompts), the replay buffer's (turns) and the trainers' (trajectories) with
confluent-kafka's admin client (``rolloutbus.kafka.consumer_lag``), and serves the last
reading on ``monitoring.lag_exporter_port``. It runs apart from every consumer it
watches, so a dead consumer shows as lag that grows, never as a silent hang.

Why not ``kafka_exporter`` (danielqsj/kafka_exporter, the Kafka ecosystem's usual lag
exporter): it is a separate Go binary to install, it reports lag in offsets only (no age
of the oldest unconsumed record), it counts transaction markers as lag (a caught-up
trainer on the transactional trajectory topic would show a lag of one per partition), and
it knows nothing of which group is which stage. This exporter is ~250 lines on the
project's own Kafka boundary (same SASL/SSL settings, same error translation) and labels
each group with its stage. kafka_exporter remains a fine addition for broker-level series
(under-replicated partitions, topic sizes); the two do not collide (other metric names).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.consumer_lag import GroupLag, LagReader
from rolloutbus.metrics import serve_metrics
from rolloutbus.topics import Topics

__all__ = ["LagCollector", "run_lag_exporter", "watched_groups"]

log = logging.getLogger(__name__)


def watched_groups(
    cfg: Config, extra_trainer_groups: Sequence[str] = ()
) -> dict[str, tuple[str, str]]:
    """consumer group id → (stage, topic) for every stage of the pipeline."""
    topics = Topics.from_config(cfg.kafka)
    groups = {
        cfg.sessions.app_id: ("sessions", topics.prompts),  # Faust's group id is its app id
        cfg.replay_buffer.group_id: ("replay_buffer", topics.turns),
        cfg.trainer.group_id: ("trainer", topics.trajectories),
    }
    for group in extra_trainer_groups:
        groups[group] = ("trainer", topics.trajectories)
    return groups


class LagCollector:
    """The last reading as Prometheus series (a failed reading clears it: no stale lag)."""

    def __init__(self, groups: dict[str, tuple[str, str]]):
        self.groups = groups
        self.reading: list[GroupLag] = []
        self.read_at = 0.0
        self.failures = 0
        self.reads = 0

    def collect(self) -> Iterator[Any]:
        now = time.time()
        records = GaugeMetricFamily(
            "rolloutbus_consumer_lag_records",
            "Records a consumer group has not consumed yet, as a read_committed reader gets "
            "them (transaction markers and aborted records not counted while at most 256 "
            "offsets lag; beyond, offsets); records",
            labels=["group", "stage", "topic", "partition"],
        )
        seconds = GaugeMetricFamily(
            "rolloutbus_consumer_lag_seconds",
            "Age of the oldest record the group has not consumed (its timestamp to now); 0 "
            "when nothing lags; seconds",
            labels=["group", "stage", "topic", "partition"],
        )
        members = GaugeMetricFamily(
            "rolloutbus_consumer_group_members",
            "Live members of the consumer group (0: every consumer of the stage is gone); "
            "consumers",
            labels=["group", "stage"],
        )
        for row in self.reading:
            stage = self.groups[row.group][0]
            members.add_metric([row.group, stage], row.members)
            for p in row.partitions:
                labels = [row.group, stage, p.topic, str(p.partition)]
                records.add_metric(labels, p.lag_records)
                seconds.add_metric(labels, p.lag_seconds(now))
        yield from (records, seconds, members)
        yield GaugeMetricFamily(
            "rolloutbus_lag_exporter_last_read_timestamp_seconds",
            "When the lag was last read successfully; seconds since the epoch",
            value=self.read_at,
        )
        reads = CounterMetricFamily(
            "rolloutbus_lag_exporter_reads",
            "Readings of the committed offsets, by outcome (ok, failed); readings",
            labels=["outcome"],
        )
        reads.add_metric(["ok"], self.reads)
        reads.add_metric(["failed"], self.failures)
        yield reads

    def refresh(self, reader: LagReader) -> None:
        try:
            self.reading = reader.read({g: topic for g, (_, topic) in self.groups.items()})
        except BrokerError as exc:
            self.reading = []
            self.failures += 1
            log.warning("lag exporter: reading the lag failed: %s", exc)
            return
        self.reads += 1
        self.read_at = time.time()


def run_lag_exporter(
    cfg: Config, stop: threading.Event, extra_trainer_groups: Sequence[str] = ()
) -> None:
    """Serve the lag of every stage until ``stop`` is set."""
    collector = LagCollector(watched_groups(cfg, extra_trainer_groups))
    reader = LagReader(cfg.kafka)
    try:
        collector.refresh(reader)  # a first reading before anyone scrapes
        serve_metrics(cfg.monitoring.lag_exporter_port, cfg.monitoring.metrics_host, collector)
        log.info(
            "lag exporter: %s on http://%s:%d/metrics",
            ", ".join(f"{g} ({s})" for g, (s, _) in collector.groups.items()),
            cfg.monitoring.metrics_host,
            cfg.monitoring.lag_exporter_port,
        )
        while not stop.wait(cfg.monitoring.lag_poll_s):
            collector.refresh(reader)
    finally:
        reader.close()
