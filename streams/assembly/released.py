"""The durable record of released groups: topic ``{prefix}.released``, key uid, compacted.

The replay buffer writes one :class:`ReleasedRecord` per group it releases, in the same
Kafka transaction as the group's trajectories (and its dead letters and the consumer
offsets), to partition p — the partition of the turn log that released it, which is
``partition_for(uid)``. Trajectories and their released record therefore commit or abort
together: the record exists exactly when the group's trajectories do.

On partition assignment the buffer reads partition p of this topic from its start
(:func:`read_released`) and remembers the uids as released, so nothing that
happens to its consumer group — a restart, expired or lost offsets, a new group id, a
session worker re-running a released group — can release a group twice. The uid is taken
from the record's value, never parsed out of a key.

**A released record is obeyed only where the turn log backs it.** Anyone who may write the
topic could otherwise make a live group vanish with one forged record (ACLs keep other
roles out: ``rolloutbus/broker/acls.py``). So a record's uid must have an event at the
record's ``turns_first_offset``, where the group started (:class:`ReleasedClaims`). The
check is made when it matters and costs no extra read in the common case: while the buffer
folds the turn log from its committed offset, an event at a claimed first offset settles
that claim; a claim whose first offset lies before the fold's start is read from the turn
log (one record, :class:`TurnLogProbe`) the first time it would suppress an event. A claim
that fails is dead-lettered with its reason and not obeyed; so is a record that is not a
released record at all, or that sits on another partition than its uid's.

What the check cannot catch: a forged record naming the exact offset where a running
group started is obeyed, and compaction may replace a group's record by a later forged one
with its key; only ACLs stop both. A refused record is dead-lettered again at each recovery
of its partition (its source offset names it), until retention removes it.

Cost and bounds: the topic is compacted (one record per uid) and time-bounded (twice the
turn log's retention, ``rolloutbus/kafka/admin.py``), so the read on assignment is
O(groups released on the partition within that retention), ~150 bytes per record; memory
keeps the newest ``replay_buffer.max_released_uids`` of them, each with its record
(~0.4 KB) until the turn log backs it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from typing import NamedTuple

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from pydantic import BaseModel, ConfigDict, ValidationError

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError, RolloutBusError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    message_location,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
    watermark_offsets,
)
from rolloutbus.kafka.partition_reader import PARTITION_READER_GROUP, read_partition
from rolloutbus.kafka.watchdog import NoAnswer, Progress, run_watched
from rolloutbus.schemas.turns import decode_turn_event

log = logging.getLogger(__name__)

# seconds to wait for transactions open on the partition to end: longer than the replay
# buffer's transaction.timeout.ms (30 s), after which the coordinator aborts a dead writer's
READ_TIMEOUT_S = 60.0
PROBE_RETRY_S = 120.0  # seconds a claim check retries a broker error (a restart) before failing
PROBE_RETRY_BACKOFF_S = 1.0  # seconds between those retries
PROBE_POLL_S = 1.0  # seconds per poll of a single-record read of the turn log
# seconds before a claim check with no answer from librdkafka is given up: past the
# longest single call it makes (a watermark query of READ_TIMEOUT_S)
PROBE_LIMIT_S = READ_TIMEOUT_S + 15.0


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


class Claim(NamedTuple):
    """One released record read back from the topic, not yet backed by the turn log (a
    tuple, not the model: a partition may hold 100k of them, ~0.4 KB each)."""

    uid: str
    first_offset: int  # turns_first_offset: where it says its group started
    offset: int  # of the record on the released topic
    key: bytes | None
    value: bytes  # as read, for its dead letter

    @classmethod
    def of(cls, record: ReleasedRecord, offset: int, key: bytes | None, value: bytes) -> Claim:
        return cls(record.uid, record.turns_first_offset, offset, key, value)


class BadRecord(NamedTuple):
    """A record of the released topic that is not obeyed: what to dead-letter."""

    source: str  # topic[partition]@offset
    key: bytes | None
    value: bytes
    reason: str


class ReleasedClaims:
    """The claims of one partition, each settled against the turn log at most once.

    ``fold_start`` is the turn-log offset the buffer's fold starts from: a claim whose first
    offset is at or past it is settled when the fold passes that offset (:meth:`passed`); an
    older one when it first suppresses an event (:meth:`suppressing`), by one read.
    """

    def __init__(self, topic: str, partition: int, fold_start: int):
        self.topic, self.partition, self.fold_start = topic, partition, fold_start
        self._by_uid: dict[str, list[Claim]] = {}
        self._by_first: dict[int, list[Claim]] = {}
        self._freed: list[str] = []

    def take_freed(self) -> list[str]:
        """The uids whose every claim was refused since the last call: the fold must forget
        them as released, so their groups are folded and released like any other."""
        freed, self._freed = self._freed, []
        return freed

    def __len__(self) -> int:
        return len(self._by_uid)

    def add(self, claim: Claim) -> None:
        self._by_uid.setdefault(claim.uid, []).append(claim)
        if claim.first_offset >= self.fold_start:
            self._by_first.setdefault(claim.first_offset, []).append(claim)

    def pending(self, uid: str) -> bool:
        return uid in self._by_uid

    def passed(self, offset: int, uid: str | None) -> list[BadRecord]:
        """The fold reached the turn-log ``offset``, an event of ``uid`` (None: not a turn
        event). Claims that name it as their first offset are settled: backed when ``uid``
        is theirs, refused otherwise."""
        refused = []
        for claim in self._by_first.pop(offset, []):
            if claim.uid == uid:
                self._backed(claim.uid)
            else:
                holds = f"an event of uid {uid}" if uid is not None else "no turn event"
                refused.append(self._refuse(claim, f"the turn log holds {holds} there"))
        return refused

    def suppressing(self, offset: int, uid: str, probe: TurnLogProbe) -> list[BadRecord]:
        """An event of ``uid`` at ``offset`` is about to be ignored as released: settle the
        claims of ``uid`` that are still pending first."""
        refused = []
        for claim in list(self._by_uid.get(uid, [])):
            first = claim.first_offset
            if first >= offset:
                why = f"the group has an event at offset {offset}, before the claimed start"
                refused.append(self._refuse(claim, why))
            elif first >= self.fold_start:
                # the fold read past the claimed start and found no event of the uid there
                refused.append(self._refuse(claim, "the fold found no event of it there"))
            else:
                found = probe.uid_at(first)
                if found is BELOW_LOG_START or found == uid:
                    self._backed(uid)  # deleted by retention: too old to check, trusted
                    return refused
                holds = f"an event of uid {found}" if found is not None else "no turn event"
                refused.append(self._refuse(claim, f"the turn log holds {holds} there"))
        return refused

    def forget(self, uid: str) -> None:
        """The buffer released ``uid`` itself: its claims no longer decide anything."""
        self._backed(uid)

    def _backed(self, uid: str) -> None:
        """One claim of ``uid`` is backed by the log: the uid is released, its other claims
        need no check."""
        for claim in self._by_uid.pop(uid, []):
            at = self._by_first.get(claim.first_offset)
            if at is not None and claim in at:
                at.remove(claim)

    def _refuse(self, claim: Claim, why: str) -> BadRecord:
        at = self._by_first.get(claim.first_offset, [])
        if claim in at:
            at.remove(claim)
        claims = self._by_uid.get(claim.uid, [])
        if claim in claims:
            claims.remove(claim)
        if not claims and self._by_uid.pop(claim.uid, None) is not None:
            self._freed.append(claim.uid)  # every claim of it refused: not released
        return BadRecord(
            f"{self.topic}[{self.partition}]@{claim.offset}",
            claim.key,
            claim.value,
            f"released record for uid {claim.uid} claims its group started at turns"
            f"[{self.partition}]@{claim.first_offset}, but {why}: not obeyed (forged, "
            "or written by another role than the replay buffer)",
        )


# The turn-log offset asked for was deleted by retention: nothing can be checked there.
BELOW_LOG_START = "<below the log start>"


class TurnLogProbe:
    """Reads single events of one turn-log partition, on one consumer kept for the purpose
    (a claim check is one fetch, not a consumer's start-up)."""

    def __init__(self, kafka: KafkaConfig, topic: str, partition: int):
        self.kafka, self.topic, self.partition = kafka, topic, partition
        self._consumer: Consumer | None = None

    def uid_at(self, offset: int) -> str | None:
        """The uid of the turn event at ``offset``; None when there is none (no record,
        not a turn event); BELOW_LOG_START when retention deleted it. A broker error is
        retried on a fresh consumer for PROBE_RETRY_S: a broker killed or restarted leaves
        the handle unusable, and the replay buffer must not exit for it."""
        deadline = time.monotonic() + PROBE_RETRY_S
        while True:
            try:
                return self._read_uid_at_watched(offset)
            except BrokerError as exc:
                self._discard()
                if time.monotonic() >= deadline:
                    raise
                log.warning("%s; retrying on a fresh consumer", exc)
                time.sleep(PROBE_RETRY_BACKOFF_S)

    def _read_uid_at_watched(self, offset: int) -> str | None:
        """``_read_uid_at`` on a helper thread, given up after PROBE_LIMIT_S (the
        released-topic read's poll hung in CI; this one polls the same way, on the
        buffer's main thread). The abandoned call keeps its consumer: it is dropped here,
        never closed under it, and the retry opens another."""
        where = f"checking {self.topic}[{self.partition}]@{offset}"
        consumer, progress = self._open(), Progress()  # opened here: nothing else sets it
        try:
            return run_watched(
                lambda: self._read_uid_at(consumer, offset, progress),
                PROBE_LIMIT_S,
                where,
                thread_name="claim-check",
                progress=progress,
            )
        except NoAnswer as exc:
            log.warning("%s; the read is left on its thread, at:\n%s", exc, exc.stack.rstrip())
            self._consumer = None
            raise BrokerError(str(exc)) from None

    def _read_uid_at(self, consumer: Consumer, offset: int, progress: Progress) -> str | None:
        tp = TopicPartition(self.topic, self.partition)
        where = f"{self.topic}[{self.partition}]@{offset}"
        try:
            low, high = watermark_offsets(consumer, tp, READ_TIMEOUT_S)
            progress.beat()
        except BrokerError as exc:
            raise BrokerError(f"checking a released record against {where}: {exc}") from exc
        if offset < low:
            return BELOW_LOG_START
        if offset >= high:
            return None
        with translate_kafka_errors("checking a released record against", topic=where):
            consumer.assign([TopicPartition(self.topic, self.partition, offset)])
            msg = _first_record(consumer, where, progress)
        if msg is None or record_position(msg)[1] != offset:
            return None  # a transaction marker or an aborted record sits there
        try:
            return decode_turn_event(msg.value() or b"").uid
        except (ValidationError, RolloutBusError):
            return None

    def _open(self) -> Consumer:
        if self._consumer is None:
            self._consumer = read_committed_consumer(
                self.kafka, PARTITION_READER_GROUP, partition_eof=True
            )
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def _discard(self) -> None:
        """Drop a consumer a broker error may have left unusable (closing it may fail too)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                consumer.close()


def _first_record(consumer: Consumer, where: str, progress: Progress) -> Message | None:
    deadline = time.monotonic() + READ_TIMEOUT_S
    while time.monotonic() < deadline:
        msg = poll_record(consumer, PROBE_POLL_S)
        progress.beat()
        if isinstance(msg, PartitionEnd):
            return None
        if msg is not None:
            return msg
    raise BrokerError(f"reading {where} stalled for {READ_TIMEOUT_S:.0f} s")


class ReleasedRead(NamedTuple):
    """What one partition of the released topic says, read back on assignment."""

    uids: OrderedDict[str, None]  # released uids, oldest first, the newest ``limit`` kept
    claims: ReleasedClaims  # those uids' records, to be backed by the turn log
    read: int  # records read
    bad: list[BadRecord]  # records that are not released records of this partition


def read_released(
    kafka: KafkaConfig,
    topic: str,
    partition: int,
    limit: int,
    fold_start: int,
    progress: Progress | None = None,
) -> ReleasedRead:
    """Every released record on ``topic[partition]``, as claims to check against a fold of
    the turn log that starts at ``fold_start``; a record that is not a released record of
    this partition is returned as bad, never obeyed. ``progress``: see read_partition."""
    by_uid: dict[str, list[Claim]] = {}
    uids: OrderedDict[str, None] = OrderedDict()
    bad: list[BadRecord] = []
    count = 0
    records = read_partition(
        kafka, topic, partition, 0, wait_open_transactions_s=READ_TIMEOUT_S, progress=progress
    )
    for msg in records:
        count += 1
        value = msg.value() or b""
        record, reason = _released_record(value, partition)
        if record is None:
            bad.append(BadRecord(message_location(msg), msg.key(), value, reason))
            continue
        by_uid.setdefault(record.uid, []).append(
            Claim.of(record, record_position(msg)[1], msg.key(), value)
        )
        uids[record.uid] = None
        uids.move_to_end(record.uid)
        if len(uids) > limit:
            by_uid.pop(uids.popitem(last=False)[0], None)
    claims = ReleasedClaims(topic, partition, fold_start)
    for uid in uids:
        for claim in by_uid[uid]:
            claims.add(claim)
    return ReleasedRead(uids, claims, count, bad)


def _released_record(value: bytes, partition: int) -> tuple[ReleasedRecord | None, str]:
    try:
        record = ReleasedRecord.model_validate_json(value)
    except (ValidationError, ValueError) as exc:
        return None, f"not a released record: {short_text(str(exc))}"
    if record.turns_first_offset < 0 or record.turns_last_offset < record.turns_first_offset:
        return None, (
            f"released record for uid {record.uid} names no turn-log range "
            f"({record.turns_first_offset}..{record.turns_last_offset}): not obeyed"
        )
    if record.partition != partition:
        return None, (
            f"released record for uid {record.uid} names partition {record.partition} but "
            f"sits on partition {partition}: not obeyed"
        )
    return record, ""


def short_text(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."
