"""Consumer lag read from outside the consumers: committed offsets, end offsets, and the
timestamp of the first record not yet consumed.

A consumer cannot report its own lag when it is dead, which is exactly when lag matters,
so this reads what the broker holds for a group: its committed offsets (the admin API),
each partition's last stable offset (what a ``read_committed`` reader can reach), the
group's live members, and, for a partition that lags, the first record after the commit
(its timestamp dates the oldest unconsumed work).

Transactional topics hold control markers (one per transaction and partition) and aborted
records that take offsets but are nothing a reader gets. ``lag_records`` counts the records
a ``read_committed`` reader would get: a group whose committed offset is followed only by
markers (a trainer that read everything the replay buffer committed) lags 0, and one that
has 16 trajectories left lags 16, not 16 plus the markers between them. The records are
counted by reading them when at most ``EXACT_COUNT_OFFSETS`` offsets lag; beyond that the
count is the offsets (markers included: an upper bound, off by at most one per transaction),
and ``lag_seconds``, the alerting signal, is exact either way.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, IsolationLevel, TopicPartition
from confluent_kafka.admin import OffsetSpec

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    admin_client,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
    watermark_offsets,
)

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["GroupLag", "LagReader", "PartitionLag"]

LAG_READER_GROUP = "rolloutbus-lag-reader"  # assigns partitions, never commits or joins
FIRST_RECORD_POLL_S = 0.5  # seconds per poll while fetching the first unconsumed records
NO_TIMESTAMP = -1.0  # a record without a timestamp: lagging, of unknown age
# offsets behind the end up to which the unconsumed records are read and counted exactly
# (a trajectory is a few KB to a few MB: a reading stays small); past it, offsets
EXACT_COUNT_OFFSETS = 256


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int | None  # None: the group has committed nothing here (reads from the start)
    end: int  # last stable offset
    lag_records: int
    oldest_unconsumed_ts: float | None  # seconds since the epoch; None when nothing lags

    def lag_seconds(self, now: float) -> float:
        """Age of the oldest record the group has not consumed; 0 when nothing lags."""
        if self.lag_records == 0 or self.oldest_unconsumed_ts is None:
            return 0.0
        if self.oldest_unconsumed_ts == NO_TIMESTAMP:
            return 0.0
        return max(0.0, now - self.oldest_unconsumed_ts)


@dataclass(frozen=True)
class GroupLag:
    group: str
    topic: str
    members: int  # live members of the consumer group (0: every consumer is gone)
    partitions: list[PartitionLag]


class LagReader:
    """Reads the lag of consumer groups on their topics; one admin client and one
    assign-only consumer, kept for the reader's life (``close()``)."""

    def __init__(self, kafka: KafkaConfig, *, timeout_s: float = 10.0):
        self.kafka = kafka
        self.timeout_s = timeout_s
        self._admin = admin_client(kafka)
        # a committed offset deleted by retention reads from the oldest record kept
        self._consumer: Consumer = read_committed_consumer(
            kafka, LAG_READER_GROUP, partition_eof=True, overrides={"auto.offset.reset": "earliest"}
        )

    def close(self) -> None:
        self._consumer.close()

    def read(self, groups: Mapping[str, str]) -> list[GroupLag]:
        """``groups``: consumer group id → the topic it consumes."""
        topics = sorted(set(groups.values()))
        ends = self._end_offsets(topics)
        members = self._members(list(groups))
        rows = []
        for group, topic in groups.items():
            committed = self._committed(group, topic)
            parts = [
                self._partition_lag(group, topic, p, committed.get(p), end)
                for (t, p), end in sorted(ends.items())
                if t == topic
            ]
            rows.append(GroupLag(group, topic, members.get(group, 0), parts))
        return self._dated(rows)

    # -- admin queries -------------------------------------------------------------------
    def _end_offsets(self, topics: list[str]) -> dict[tuple[str, int], int]:
        request = {
            TopicPartition(topic, p): OffsetSpec.latest()
            for topic in topics
            for p in range(self.kafka.partitions)
        }
        with translate_kafka_errors("reading end offsets", topic=",".join(topics)):
            futures = self._admin.list_offsets(
                request,
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=self.timeout_s,
            )
            results = self._results(futures, "end offsets")
        return {(tp.topic, tp.partition): r.offset for tp, r in results.items()}

    def _committed(self, group: str, topic: str) -> dict[int, int]:
        request = [
            ConsumerGroupTopicPartitions(
                group, [TopicPartition(topic, p) for p in range(self.kafka.partitions)]
            )
        ]
        with translate_kafka_errors(
            f"reading the committed offsets of group {group!r}", topic=topic
        ):
            futures = self._admin.list_consumer_group_offsets(
                request, request_timeout=self.timeout_s
            )
            [answer] = self._results(futures, f"committed offsets of {group}").values()
        return {tp.partition: tp.offset for tp in answer.topic_partitions if tp.offset >= 0}

    def _members(self, groups: list[str]) -> dict[str, int]:
        with translate_kafka_errors("describing consumer groups " + ", ".join(groups)):
            futures = self._admin.describe_consumer_groups(groups, request_timeout=self.timeout_s)
            described = self._results(futures, "consumer group descriptions")
        return {group: len(d.members) for group, d in described.items()}

    def _results(self, futures: Mapping[K, concurrent.futures.Future[V]], what: str) -> dict[K, V]:
        try:
            return {key: f.result(timeout=self.timeout_s) for key, f in futures.items()}
        except concurrent.futures.TimeoutError:
            raise BrokerError(
                f"no answer for the {what} from {self.kafka.bootstrap_servers} "
                f"within {self.timeout_s:g} s"
            ) from None

    # -- lag -----------------------------------------------------------------------------
    def _partition_lag(
        self, group: str, topic: str, partition: int, committed: int | None, end: int
    ) -> PartitionLag:
        start = committed if committed is not None else self._low(topic, partition)
        return PartitionLag(group, topic, partition, committed, end, max(0, end - start), None)

    def _low(self, topic: str, partition: int) -> int:
        low, _ = watermark_offsets(self._consumer, TopicPartition(topic, partition), self.timeout_s)
        return low

    def _dated(self, rows: list[GroupLag]) -> list[GroupLag]:
        """Each lagging partition with the timestamp of its first unconsumed record, and its
        records counted where few lag (0 where only transaction markers follow the commit)."""
        spans = {
            (p.topic, p.partition, p.end - p.lag_records, p.end)
            for row in rows
            for p in row.partitions
            if p.lag_records > 0
        }
        # one position per partition at a time: several groups on one partition in turn
        found = {span: self._unconsumed(*span) for span in sorted(spans)}
        return [
            GroupLag(
                row.group,
                row.topic,
                row.members,
                [
                    _counted(p, found.get((p.topic, p.partition, p.end - p.lag_records, p.end)))
                    for p in row.partitions
                ],
            )
            for row in rows
        ]

    def _unconsumed(self, topic: str, partition: int, offset: int, end: int) -> Unconsumed:
        """The records from ``offset`` to ``end`` as a read_committed reader gets them: the
        first one's timestamp, and how many (read to the end when few lag, else None)."""
        with translate_kafka_errors(
            "reading the first unconsumed record", topic=topic, partition=partition, offset=offset
        ):
            self._consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + self.timeout_s
        first: float | None = None
        records = 0
        try:
            while time.monotonic() < deadline:
                msg = poll_record(self._consumer, FIRST_RECORD_POLL_S)
                if isinstance(msg, PartitionEnd):
                    return Unconsumed(first, records)
                if msg is None or record_position(msg)[0] != partition:
                    continue
                if first is None:
                    kind, ms = msg.timestamp()
                    first = ms / 1000 if kind != 0 and ms > 0 else NO_TIMESTAMP
                    if end - offset > EXACT_COUNT_OFFSETS:
                        return Unconsumed(first, None)
                records += 1
        finally:
            with translate_kafka_errors(
                "unassigning", topic=topic, partition=partition, offset=offset
            ):
                self._consumer.unassign()
        raise BrokerError(
            f"reading the unconsumed records of {topic}[{partition}] from offset {offset}: "
            f"no end within {self.timeout_s:g} s"
        )


@dataclass(frozen=True)
class Unconsumed:
    first_ts: float | None  # None: only transaction markers (or aborted records) follow
    records: int | None  # None: not counted (too many lag); the offsets stand


def _counted(p: PartitionLag, seen: Unconsumed | None) -> PartitionLag:
    if p.lag_records == 0 or seen is None:
        return p
    if seen.first_ts is None:  # only transaction markers after the commit: nothing to consume
        return PartitionLag(p.group, p.topic, p.partition, p.committed, p.end, 0, None)
    records = p.lag_records if seen.records is None else seen.records
    return PartitionLag(p.group, p.topic, p.partition, p.committed, p.end, records, seen.first_ts)
