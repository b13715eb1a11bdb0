"""Read one partition from an offset to its end (or a stop offset), committed records only.

Used where a process must learn what a partition holds right now without joining a group:
the replay buffer's rescan of released groups and the offline replay of the turn log.
"""

from __future__ import annotations

from collections.abc import Iterator

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError

POLL_S = 30.0  # seconds one poll may wait before the read counts as stalled


def read_partition(kafka: KafkaConfig, topic: str, partition: int, start: int,
                   stop: int | None = None) -> Iterator[Message]:
    """Committed records of ``topic[partition]`` from ``start`` until the end or ``stop``."""
    consumer = Consumer({**kafka.client_settings(), "group.id": "rolloutbus-partition-reader",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True,
                         "max.partition.fetch.bytes": kafka.max_message_bytes})
    where = f"{topic}[{partition}]"
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=POLL_S,
                                                   cached=False)
        begin, end = max(start, low), high if stop is None else min(stop, high)
        if end <= begin:
            return
        consumer.assign([TopicPartition(topic, partition, begin)])
        while True:
            msg = consumer.poll(POLL_S)
            if msg is None:
                raise BrokerError(f"reading {where} stalled before offset {end}")
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return
                raise BrokerError(f"reading {where}: {msg.error()}")
            if msg.offset() >= end:
                return
            yield msg
    finally:
        consumer.close()
