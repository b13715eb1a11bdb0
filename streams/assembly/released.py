"""The durable record of released groups: topic ``{prefix}.released``, key uid, compacted.

The replay buffer writes one :class:`ReleasedRecord` per group it releases, in the same
Kafka transaction as the group's trajectories (and its dead letters and the consumer
offsets), to partition p — the partition of the turn log that released it, which is
``partition_for(uid)``. Trajectories and their released record therefore commit or abort
together: the record exists exactly when the group's trajectories do.

On partition assignment the buffer reads partition p of this topic from its start
(:func:`read_released_uids`) and remembers the uids as released, so nothing that
happens to its consumer group — a restart, expired or lost offsets, a new group id, a
session worker re-running a released group — can release a group twice. The uid is taken
from the record's value, never parsed out of a key.

Cost and bounds: the topic is compacted (one record per uid) and time-bounded (twice the
turn log's retention, ``rolloutbus/kafka/admin.py``), so the read on assignment is
O(groups released on the partition within that retention), ~150 bytes per record; memory
keeps the newest ``replay_buffer.max_released_uids`` of them.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Consumer, IsolationLevel, Message, TopicPartition
from confluent_kafka.admin import OffsetSpec
from pydantic import BaseModel, ConfigDict, ValidationError

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    admin_client,
    poll_record,
    read_committed_consumer,
    translate_kafka_errors,
)

log = logging.getLogger(__name__)

READER_GROUP = "rolloutbus-released-reader"  # nothing is committed: librdkafka wants a group id
# seconds to wait for transactions open on the partition to end: longer than the replay
# buffer's transaction.timeout.ms (30 s), after which the coordinator aborts a dead writer's
READ_TIMEOUT_S = 60.0
POLL_S = 1.0  # seconds per poll while reading


class ReleasedRecord(BaseModel):
    """What was released for one group (value of a record on the released topic)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # newer writers may add fields

    uid: str
    partition: int  # of the turn log, and of every topic holding the group's records
    trajectories: int  # records written to the trajectory topic (0: rejected)
    failed: int = 0  # of which status failed
    kind: str = "completed"  # partition_fold.RELEASE_KINDS
    turns_first_offset: int = -1  # the group's first event in the turn log
    turns_last_offset: int = -1  # the event that released it
    released_at_ms: int = 0  # wall clock of the writer, for people reading the topic

    def encode(self) -> bytes:
        return self.model_dump_json().encode("utf-8")


def released_record(
    uid: str,
    partition: int,
    *,
    trajectories: int,
    failed: int,
    kind: str,
    turns_first_offset: int,
    turns_last_offset: int,
) -> ReleasedRecord:
    return ReleasedRecord(
        uid=uid,
        partition=partition,
        trajectories=trajectories,
        failed=failed,
        kind=kind,
        turns_first_offset=turns_first_offset,
        turns_last_offset=turns_last_offset,
        released_at_ms=int(time.time() * 1000),
    )


def read_released_uids(
    kafka: KafkaConfig, topic: str, partition: int, limit: int
) -> tuple[OrderedDict[str, None], int]:
    """The uids released on ``topic[partition]``, oldest first, the newest ``limit`` kept;
    and how many records were read. Committed records only (read_committed)."""
    uids: OrderedDict[str, None] = OrderedDict()
    count = 0
    for msg in _committed_records(kafka, topic, partition):
        count += 1
        uid = _uid_of(msg.value())
        if uid is None:
            log.warning(
                "released-groups record at %s[%d]@%s is not a released record: skipped",
                topic,
                partition,
                msg.offset(),
            )
            continue
        uids[uid] = None
        uids.move_to_end(uid)
        if len(uids) > limit:
            uids.popitem(last=False)
    return uids, count


def _uid_of(value: Any) -> str | None:
    if not value:
        return None  # a tombstone: nothing this buffer writes
    try:
        return ReleasedRecord.model_validate_json(value).uid
    except (ValidationError, json.JSONDecodeError):
        return None


def _committed_records(kafka: KafkaConfig, topic: str, partition: int) -> Iterator[Message]:
    """Every committed record of the partition up to its high watermark at the start.

    Not just up to the last stable offset: a transaction still open there (a crashed
    writer's, until the coordinator aborts it) would hide the records committed after it,
    and a group released in one of those would be released again. So the read waits for
    every transaction open at the start to end, up to READ_TIMEOUT_S.
    """
    tp = TopicPartition(topic, partition)
    high = _high_watermark(kafka, tp)
    consumer = read_committed_consumer(kafka, READER_GROUP, partition_eof=True)
    try:
        with translate_kafka_errors("reading watermarks", topic=topic, partition=partition):
            # a read_committed consumer's "high" is the last stable offset
            low, _ = consumer.get_watermark_offsets(tp, timeout=READ_TIMEOUT_S, cached=False)
        if high <= low:
            return
        consumer.assign([TopicPartition(topic, partition, low)])
        yield from _records_until(consumer, tp, high)
    finally:
        consumer.close()


def _high_watermark(kafka: KafkaConfig, tp: TopicPartition) -> int:
    """The offset after the last record written, committed or not."""
    request = {TopicPartition(tp.topic, tp.partition): OffsetSpec.latest()}
    admin = admin_client(kafka)  # held until the future resolves: a dropped client fails it
    with translate_kafka_errors(
        "reading the high watermark", topic=tp.topic, partition=tp.partition
    ):
        futures = admin.list_offsets(
            request, isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=READ_TIMEOUT_S
        )
        try:
            [result] = [future.result(timeout=READ_TIMEOUT_S) for future in futures.values()]
        except concurrent.futures.TimeoutError:
            raise BrokerError(
                f"no answer for the high watermark of {tp.topic}[{tp.partition}] "
                f"within {READ_TIMEOUT_S:g} s"
            ) from None
    return result.offset


def _records_until(consumer: Consumer, tp: TopicPartition, high: int) -> Iterator[Message]:
    deadline = time.monotonic() + READ_TIMEOUT_S
    where = f"{tp.topic}[{tp.partition}]"
    while True:
        msg = poll_record(consumer, POLL_S)
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
                f"open after {READ_TIMEOUT_S:.0f} s"
            )


def _position(consumer: Consumer, tp: TopicPartition) -> int:
    with translate_kafka_errors("reading the position", topic=tp.topic, partition=tp.partition):
        [position] = consumer.position([tp])
    return position.offset
