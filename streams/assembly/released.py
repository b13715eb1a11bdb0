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

import json
import logging
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.partition_reader import read_partition

log = logging.getLogger(__name__)

# seconds to wait for transactions open on the partition to end: longer than the replay
# buffer's transaction.timeout.ms (30 s), after which the coordinator aborts a dead writer's
READ_TIMEOUT_S = 60.0


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
    and how many records were read.

    Committed records only, up to the high watermark at the start, not just up to the last
    stable offset: a transaction still open there (a crashed writer's, until the
    coordinator aborts it) would hide the records committed after it, and a group released
    in one of those would be released again. So the read waits for every transaction open
    at the start to end, up to READ_TIMEOUT_S.
    """
    uids: OrderedDict[str, None] = OrderedDict()
    count = 0
    records = read_partition(kafka, topic, partition, 0, wait_open_transactions_s=READ_TIMEOUT_S)
    for msg in records:
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
