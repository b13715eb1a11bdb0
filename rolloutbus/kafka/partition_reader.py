"""Read one partition from an offset to its end (or a stop offset), committed records only.

Used where a process must learn what a partition holds right now without joining a group:
the replay buffer's released-groups recovery and the offline replay of the turn log.
"""

from __future__ import annotations

from collections.abc import Iterator

from confluent_kafka import Consumer, Message, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
)

POLL_S = 30.0  # seconds one poll may wait before the read counts as stalled
PARTITION_READER_GROUP = "rolloutbus-partition-reader"


def read_partition(
    kafka: KafkaConfig, topic: str, partition: int, start: int, stop: int | None = None
) -> Iterator[Message]:
    """Committed records of ``topic[partition]`` from ``start`` until the end or ``stop``."""
    # no offsets are committed: the group id only satisfies librdkafka
    consumer = read_committed_consumer(kafka, PARTITION_READER_GROUP, partition_eof=True)
    try:
        with translate_kafka_errors("reading watermarks", topic=topic, partition=partition):
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=POLL_S, cached=False
            )
        begin, end = max(start, low), high if stop is None else min(stop, high)
        if end <= begin:
            return
        consumer.assign([TopicPartition(topic, partition, begin)])
        yield from _records_before(consumer, end, where=f"{topic}[{partition}]")
    finally:
        consumer.close()


def _records_before(consumer: Consumer, end: int, *, where: str) -> Iterator[Message]:
    """Records of the one assigned partition until offset ``end`` or the partition's end."""
    while True:
        msg = poll_record(consumer, POLL_S)
        if msg is None:
            raise BrokerError(f"reading {where} stalled before offset {end}")
        if isinstance(msg, PartitionEnd) or record_position(msg)[1] >= end:
            return
        yield msg
