"""The turn log as the session services use it: write a session's events to its group's
partition of rollout.turns, and scan a partition for the groups that did not finish.

Shared by the session worker and the OpenAI gateway (``streams/gateway``): both log turns
the same way, and both resume what they find unfinished in the log after a restart.
"""

from __future__ import annotations

from confluent_kafka import TopicPartition
from pydantic import BaseModel, ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import SchemaError
from rolloutbus.kafka.async_producer import AsyncProducer
from rolloutbus.kafka.clients import read_committed_consumer, translate_kafka_errors
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.turns import decode_turn_event, encode_turn_event
from rolloutbus.streams.sessions.metrics import SessionMetrics
from rolloutbus.streams.sessions.recovery import TurnLogScan
from rolloutbus.topics import Topics, partition_for, session_key

__all__ = ["RecordTooLargeError", "TurnLog", "scan_turn_log", "scan_start_offset"]

OFFSET_QUERY_TIMEOUT_S = 30.0  # seconds for the committed-offset lookup of a scan


class RecordTooLargeError(SchemaError):
    """An event is larger than the topic accepts: it cannot be logged, ever."""


class TurnLog:
    """Writes turn events to their group's partition of rollout.turns, durably, in order."""

    def __init__(self, cfg: Config, producer: AsyncProducer, metrics: SessionMetrics):
        self.topic = Topics.from_config(cfg.kafka).turns
        self.partitions = cfg.kafka.partitions
        self.max_bytes = cfg.kafka.max_message_bytes
        self._producer = producer
        self._metrics = metrics

    async def emit(self, event: BaseModel) -> None:
        uid: str = event.uid  # type: ignore[attr-defined]  # every turn event has one
        session_id = getattr(event, "session_id", None)
        key = uid if session_id is None else session_key(uid, session_id)
        value = encode_turn_event(event)
        if len(value) > self.max_bytes:
            raise RecordTooLargeError(
                f"{getattr(event, 'type', 'event')} of {key} is {len(value)} bytes, over "
                f"kafka.max_message_bytes ({self.max_bytes})"
            )
        await self._producer.send(
            self.topic, key=key.encode(), value=value, partition=partition_for(uid, self.partitions)
        )
        self._metrics.count_event(event)


def scan_turn_log(cfg: Config, partition: int) -> TurnLogScan:
    """Fold ``partition`` of rollout.turns from the replay buffer's committed offset (blocking):
    every group that started there and did not finish, with its sessions' logged attempts."""
    topic = Topics.from_config(cfg.kafka).turns
    scan = TurnLogScan()
    for msg in read_partition(cfg.kafka, topic, partition, scan_start_offset(cfg, partition)):
        try:
            event = decode_turn_event(msg.value() or b"")
        except (ValidationError, SchemaError):
            continue  # the replay buffer dead-letters it; it is no session's event
        scan.apply(msg.offset() or 0, event)
    return scan


def scan_start_offset(cfg: Config, partition: int) -> int:
    """The replay buffer's committed offset: every group before it was released."""
    topic = Topics.from_config(cfg.kafka).turns
    consumer = read_committed_consumer(cfg.kafka, cfg.replay_buffer.group_id)
    try:
        with translate_kafka_errors("reading committed offsets", topic=topic, partition=partition):
            [tp] = consumer.committed(
                [TopicPartition(topic, partition)], timeout=OFFSET_QUERY_TIMEOUT_S
            )
    finally:
        consumer.close()
    return max(tp.offset, 0)  # never committed: the whole retained log
