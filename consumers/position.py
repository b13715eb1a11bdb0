"""Where a trainer stands on rollout.trajectories: the position a checkpoint stores.

**The position.** Per partition, ``offset`` is the first offset of the oldest group not yet
yielded that has records in the partition, or just past the last record consumed when none
is pending: every group wholly before it was yielded. Groups may interleave in a partition
(a0 b0 b1 a1: b is yielded while a is incomplete), and an offset alone cannot say "re-read
a but not b", so the groups yielded past the offset are listed too (``yielded``: uid →
offset of the group's last record) and their records are skipped on resume. An entry leaves
the list once the offset passes the group's last record, so the list holds only groups
that completed while an older one was incomplete: empty in practice (the replay buffer
writes each group's records together), and at most ``trainer.max_interleaved_groups``. The
alternatives were worse: committing past the incomplete group loses it on a crash, stopping
at it without the list trains b twice, and remembering every uid ever yielded is unbounded.

How partitions move between clients is ``consumers/ownership.py``.

The remembered trajectory keys (:class:`KeyWindow`, ``trainer.dedupe_window_keys``) are only
a safety net for a record written twice (a group the replay buffer released again).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import SchemaError
from rolloutbus.kafka.clients import (
    committed_offsets,
    read_committed_consumer,
    translate_kafka_errors,
    watermark_offsets,
)
from rolloutbus.topics import Topics

__all__ = [
    "COMMIT_METADATA_MAX_BYTES",
    "KeyWindow",
    "PartitionPosition",
    "TrainerPosition",
    "checked_position",
    "end_offsets",
    "later_position",
    "start_position",
    "watermark",
]

log = logging.getLogger(__name__)
ASSIGN_TIMEOUT_S = 30.0  # seconds for the committed-offset and watermark look-ups of an assignment
COMMIT_METADATA_MAX_BYTES = 4096  # bytes; the broker's default offset.metadata.max.bytes
START_READER_GROUP = "rolloutbus-offsets-reader"  # never commits: librdkafka wants an id


class PartitionPosition(BaseModel):
    """Where one partition resumes: from ``offset``, skipping the records of ``yielded``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int = Field(ge=0)
    # uid -> offset of the group's last record, for groups yielded past ``offset``
    yielded: dict[str, int] = Field(default_factory=dict)

    def commit_metadata(self) -> str:
        return json.dumps({"yielded": self.yielded}, separators=(",", ":")) if self.yielded else ""

    @classmethod
    def from_commit(cls, offset: int, metadata: str | None) -> PartitionPosition:
        """The position a commit of this client wrote; metadata it cannot read counts as none."""
        try:
            yielded = json.loads(metadata)["yielded"] if metadata else {}
            return cls(offset=offset, yielded=yielded)
        except (ValueError, TypeError, KeyError, ValidationError):
            log.warning(
                "commit metadata %r is not a trainer position; resuming at offset %d without it",
                metadata,
                offset,
            )
            return cls(offset=offset)


class TrainerPosition(BaseModel):
    """What a trainer stores in its checkpoint: ``position.model_dump(mode="json")`` is
    plain JSON, and ``TrainerClient(..., resume_from=that_dict)`` resumes from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    topic: str
    partitions: dict[int, PartitionPosition] = Field(default_factory=dict)

    @property
    def offsets(self) -> dict[int, int]:
        """``{partition: next_offset}``: every record before it was yielded."""
        return {p: pos.offset for p, pos in self.partitions.items()}


def later_position(a: PartitionPosition | None, b: PartitionPosition | None) -> PartitionPosition:
    """The position further on; at the same offset, skip what either one yielded."""
    if a is None or b is None:
        result = a or b
        assert result is not None
        return result
    if a.offset != b.offset:
        return a if a.offset > b.offset else b
    return PartitionPosition(offset=a.offset, yielded={**a.yielded, **b.yielded})


def checked_position(position: TrainerPosition | Mapping[str, Any], topic: str) -> TrainerPosition:
    try:
        checked = (
            position
            if isinstance(position, TrainerPosition)
            else TrainerPosition.model_validate(position)
        )
    except ValidationError as exc:
        raise SchemaError(f"resume_from is not a trainer position: {exc}") from exc
    if checked.topic != topic:
        raise SchemaError(
            f"resume_from is a position in {checked.topic!r}, this client reads {topic!r}"
        )
    return checked


def start_position(
    kafka: KafkaConfig, group_id: str, *, from_beginning: bool = True
) -> TrainerPosition:
    """Where a trainer without a checkpoint starts, for every partition, without joining the
    group: the group's committed position, else the beginning (or end) of the partition.

    ``rolloutbus train`` saves this in its step-0 checkpoint, so a restart before its first
    step begins exactly here again, whatever is committed meanwhile.
    """
    topic = Topics.from_config(kafka).trajectories
    consumer = read_committed_consumer(kafka, group_id)
    try:
        partitions = [TopicPartition(topic, p) for p in range(kafka.partitions)]
        with translate_kafka_errors(f"reading the committed offsets of {group_id!r}", topic=topic):
            committed = committed_offsets(consumer, partitions, ASSIGN_TIMEOUT_S)
        starts = {
            tp.partition: PartitionPosition.from_commit(tp.offset, tp.metadata)
            if tp.offset >= 0
            else PartitionPosition(offset=watermark(consumer, topic, tp.partition, from_beginning))
            for tp in committed
        }
    finally:
        consumer.close()
    return TrainerPosition(topic=topic, partitions=starts)


def end_offsets(kafka: KafkaConfig, topic: str) -> dict[int, int]:
    """``{partition: end offset}`` of ``topic`` now (the last stable offset)."""
    consumer = read_committed_consumer(kafka, START_READER_GROUP)
    try:
        return {p: watermark(consumer, topic, p, low=False) for p in range(kafka.partitions)}
    finally:
        consumer.close()


def watermark(consumer: Consumer, topic: str, partition: int, low: bool) -> int:
    first, end = watermark_offsets(consumer, TopicPartition(topic, partition), ASSIGN_TIMEOUT_S)
    return first if low else end


class KeyWindow:
    """The last ``size`` trajectory keys yielded: a record written twice is dropped."""

    def __init__(self, size: int):
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def remember(self, keys: list[str]) -> None:
        for key in keys:
            self._keys[key] = None
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)
