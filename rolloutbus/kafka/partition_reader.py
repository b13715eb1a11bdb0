"""Read one partition from an offset to its end (or a stop offset), committed records only.

Used where a process must learn what a partition holds right now without joining a group:
the replay buffer's released-groups recovery and the offline replay of the turn log.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

from confluent_kafka import Consumer, IsolationLevel, Message, TopicPartition
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
from rolloutbus.kafka.watchdog import Progress

POLL_S = 30.0  # seconds one poll may wait before the read counts as stalled
# seconds per poll while waiting for open transactions: short, so the deadline is checked
OPEN_TRANSACTIONS_POLL_S = 1.0
PARTITION_READER_GROUP = "rolloutbus-partition-reader"


def read_partition(
    kafka: KafkaConfig,
    topic: str,
    partition: int,
    start: int,
    stop: int | None = None,
    *,
    wait_open_transactions_s: float | None = None,
    progress: Progress | None = None,
) -> Iterator[Message]:
    """Committed records of ``topic[partition]`` from ``start`` until the end or ``stop``.

    The end is the last stable offset: a transaction still open there hides the records
    committed after it. With ``wait_open_transactions_s`` (no ``stop`` then), the end is
    the high watermark when the read starts, committed or not, and the read waits up to
    that many seconds for every transaction open there to end (a crashed writer's ends
    when the coordinator aborts it), so no committed record before that offset is missed.
    ``progress`` is beaten each time librdkafka answers (for a caller's watchdog).
    """
    if wait_open_transactions_s is not None and stop is not None:
        raise ValueError("read_partition: give stop or wait_open_transactions_s, not both")
    tp = TopicPartition(topic, partition)
    progress = progress or Progress()
    high = None
    if wait_open_transactions_s is not None:
        high = _high_watermark(kafka, tp, wait_open_transactions_s)
        progress.beat()
    # no offsets are committed: the group id only satisfies librdkafka
    consumer = read_committed_consumer(kafka, PARTITION_READER_GROUP, partition_eof=True)
    try:
        # a read_committed consumer's "high" is the last stable offset
        low, stable = watermark_offsets(consumer, tp, wait_open_transactions_s or POLL_S)
        progress.beat()
        begin = max(start, low)
        end = stable if high is None else high
        end = end if stop is None else min(stop, end)
        if end <= begin:
            return
        consumer.assign([TopicPartition(topic, partition, begin)])
        where = f"{topic}[{partition}]"
        if wait_open_transactions_s is None:
            yield from _records_before(consumer, end, where=where, progress=progress)
        else:
            yield from _records_through_open_transactions(
                consumer, tp, end, wait_open_transactions_s, progress
            )
    finally:
        consumer.close()


def _records_before(
    consumer: Consumer, end: int, *, where: str, progress: Progress
) -> Iterator[Message]:
    """Records of the one assigned partition until offset ``end`` or the partition's end."""
    while True:
        msg = poll_record(consumer, POLL_S)
        progress.beat()
        if msg is None:
            raise BrokerError(f"reading {where} stalled before offset {end}")
        if isinstance(msg, PartitionEnd) or record_position(msg)[1] >= end:
            return
        yield msg


def _records_through_open_transactions(
    consumer: Consumer, tp: TopicPartition, high: int, timeout_s: float, progress: Progress
) -> Iterator[Message]:
    """Records of the one assigned partition until its position passes ``high``."""
    deadline = time.monotonic() + timeout_s
    where = f"{tp.topic}[{tp.partition}]"
    while True:
        msg = poll_record(consumer, OPEN_TRANSACTIONS_POLL_S)
        progress.beat()
        if msg is not None and not isinstance(msg, PartitionEnd):
            yield msg
            continue
        # an end of partition is reported at the last stable offset, before any transaction
        # still open: done only once the position has passed the start's high watermark
        if isinstance(msg, PartitionEnd) and _position(consumer, tp) >= high:
            return
        if time.monotonic() > deadline:
            raise BrokerError(
                f"reading {where} up to offset {high}: a transaction there is still "
                f"open after {timeout_s:.0f} s"
            )


def _high_watermark(kafka: KafkaConfig, tp: TopicPartition, timeout_s: float) -> int:
    """The offset after the last record written, committed or not."""
    request = {TopicPartition(tp.topic, tp.partition): OffsetSpec.latest()}
    admin = admin_client(kafka)  # held until the future resolves: a dropped client fails it
    with translate_kafka_errors(
        "reading the high watermark", topic=tp.topic, partition=tp.partition
    ):
        futures = admin.list_offsets(
            request, isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=timeout_s
        )
        try:
            [result] = [future.result(timeout=timeout_s) for future in futures.values()]
        except concurrent.futures.TimeoutError:
            raise BrokerError(
                f"no answer for the high watermark of {tp.topic}[{tp.partition}] "
                f"within {timeout_s:g} s"
            ) from None
    offset: int = result.offset
    return offset


def _position(consumer: Consumer, tp: TopicPartition) -> int:
    with translate_kafka_errors("reading the position", topic=tp.topic, partition=tp.partition):
        [position] = consumer.position([tp])
    return position.offset


def offset_for_time(
    kafka: KafkaConfig, topic: str, partition: int, timestamp_s: float
) -> int | None:
    """The first offset of ``topic[partition]`` whose record timestamp is at or after
    ``timestamp_s`` (seconds since the epoch; Kafka's offsets-for-times), or None when no
    record is that recent."""
    tp = TopicPartition(topic, partition, int(timestamp_s * 1000))  # Kafka counts ms
    consumer = read_committed_consumer(kafka, PARTITION_READER_GROUP)
    try:
        with translate_kafka_errors(
            "finding the offset for a time", topic=topic, partition=partition
        ):
            [found] = consumer.offsets_for_times([tp], timeout=POLL_S)
    finally:
        consumer.close()
    return found.offset if found.offset >= 0 else None
