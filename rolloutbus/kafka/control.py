"""Publish and follow policy versions on ``rollout.control``.

The control topic has one partition (``admin.CONTROL_PARTITIONS``) and its records are
keyed by event type (``topics.control_key``), so "the current policy version" is the last
``policy_version`` record of that partition: what :func:`latest_policy_version` reads and
what :class:`PolicyVersionFollower` tracks as new records arrive. No consumer group and no
committed offsets: every reader reads the partition itself, so a restarted process learns
the current version from the log.
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Message, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError, SchemaError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    broker_error,
    consume_records,
    idempotent_producer,
    message_location,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
)
from rolloutbus.schemas.control import (
    ControlEvent,
    PolicyVersionPublished,
    decode_control_event,
    encode_control_event,
)
from rolloutbus.topics import CONTROL_PARTITION, Topics, control_key

__all__ = [
    "PolicyVersionFollower",
    "PolicyVersionPublisher",
    "latest_policy_version",
    "publish_policy_version",
]

log = logging.getLogger(__name__)
DELIVERY_TIMEOUT_S = 30.0  # seconds to wait for the broker to acknowledge a version
CONTROL_READER_GROUP = "rolloutbus-control-reader"  # never commits: librdkafka wants an id
READ_TIMEOUT_S = 30.0  # seconds one poll may wait before a read of the topic counts as stalled
DRAIN_BATCH = 500  # records per consume() while catching up; a version record is ~300 bytes


def _kafka(cfg: Config | KafkaConfig) -> KafkaConfig:
    return cfg.kafka if isinstance(cfg, Config) else cfg


class PolicyVersionPublisher:
    """The trainer's writer of versions: idempotent, and :meth:`publish` returns only once
    the broker has the record, so a version is never announced before it is durable."""

    def __init__(self, cfg: Config | KafkaConfig):
        self.kafka = _kafka(cfg)
        self.topic = Topics.from_config(self.kafka).control
        self._producer = idempotent_producer(self.kafka)

    def publish(self, event: PolicyVersionPublished) -> int:
        """Write ``event``; returns its offset on the control topic."""
        delivered: list[Any] = []
        try:
            self._producer.produce(
                self.topic,
                key=control_key(event.type),
                value=encode_control_event(event),
                partition=CONTROL_PARTITION,
                on_delivery=lambda err, msg: delivered.append((err, msg)),
            )
        except KafkaException as exc:
            raise broker_error(
                exc, f"publishing policy version {event.policy_version}", topic=self.topic
            ) from exc
        if self._producer.flush(DELIVERY_TIMEOUT_S) or not delivered:
            raise BrokerError(
                f"policy version {event.policy_version} not acknowledged by {self.topic} "
                f"within {DELIVERY_TIMEOUT_S} s"
            )
        err, msg = delivered[0]
        if err is not None:
            raise broker_error(
                err, f"publishing policy version {event.policy_version}", topic=self.topic
            )
        return record_position(msg)[1]


def publish_policy_version(cfg: Config | KafkaConfig, event: PolicyVersionPublished) -> int:
    """One-off publish (a fresh producer); returns the record's offset."""
    return PolicyVersionPublisher(cfg).publish(event)


def latest_policy_version(cfg: Config | KafkaConfig) -> PolicyVersionPublished | None:
    """The last policy version on the control topic, or None if none was ever published.

    Reads the (compacted, one-partition) topic to its end with an assigned consumer, which
    waits out a partition that has no leader yet (a topic created a moment ago).
    """
    kafka = _kafka(cfg)
    topic = Topics.from_config(kafka).control
    consumer = read_committed_consumer(kafka, CONTROL_READER_GROUP, partition_eof=True)
    latest: PolicyVersionPublished | None = None
    try:
        with translate_kafka_errors("assigning", topic=topic, partition=CONTROL_PARTITION):
            consumer.assign([TopicPartition(topic, CONTROL_PARTITION, OFFSET_BEGINNING)])
        while True:
            msg = poll_record(consumer, READ_TIMEOUT_S)
            if msg is None:
                raise BrokerError(f"reading {topic} stalled for {READ_TIMEOUT_S} s")
            if isinstance(msg, PartitionEnd):
                return latest
            event = _decode(msg)
            if isinstance(event, PolicyVersionPublished):
                latest = event
    finally:
        consumer.close()


class PolicyVersionFollower:
    """Follows the control topic: :meth:`poll` returns the newest policy version that
    arrived since the last one it returned (versions published in between are skipped:
    whoever follows only ever needs the current one), or None.

    The first poll returns the version current at start, if any, so a follower that starts
    after a publish still sees it.
    """

    def __init__(self, cfg: Config | KafkaConfig):
        self.kafka = _kafka(cfg)
        self.topic = Topics.from_config(self.kafka).control
        self._consumer = read_committed_consumer(self.kafka, CONTROL_READER_GROUP)
        with translate_kafka_errors("assigning", topic=self.topic, partition=CONTROL_PARTITION):
            # the whole (compacted) partition, so the current version is seen even when it
            # was published long before this follower started
            self._consumer.assign([TopicPartition(self.topic, CONTROL_PARTITION, OFFSET_BEGINNING)])
        self.current: PolicyVersionPublished | None = None

    def poll(self, timeout_s: float) -> PolicyVersionPublished | None:
        """Waits up to ``timeout_s`` for a record, then reads whatever else is there."""
        newest: PolicyVersionPublished | None = None
        # poll() returns with the first record; consume(n, t) would wait for n records or t
        first = poll_record(self._consumer, timeout_s)
        records = [first] if isinstance(first, Message) else []
        while records:
            for msg in records:
                event = _decode(msg)
                if isinstance(event, PolicyVersionPublished):
                    newest = event
            records = consume_records(self._consumer, DRAIN_BATCH, 0)
        if newest is not None:
            self.current = newest
        return newest

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> PolicyVersionFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode(msg: Message) -> ControlEvent | None:
    """A record that is not a control event is logged and skipped: one bad record must not
    stop every follower of the topic (nothing downstream would ever move again)."""
    try:
        return decode_control_event(msg.value() or b"")
    except (ValidationError, SchemaError) as exc:
        log.error(
            "skipping a record that is not a control event at %s: %s",
            message_location(msg),
            exc.errors()[0]["msg"] if isinstance(exc, ValidationError) and exc.errors() else exc,
        )
        return None
