"""The trainer client: complete prompt groups from rollout.trajectories as Arrow batches.

Delivery: the replay buffer commits a group's trajectories in one transaction, so with
``isolation.level=read_committed`` a group is seen whole or not at all.

**Exactly once per trainer checkpoint.** ``client.position()`` says where the groups yielded
so far end; a trainer stores it in its checkpoint and resumes with
``TrainerClient(..., resume_from=position)``. That position is the truth: a crash between
an optimizer step and the Kafka commit never trains a group twice, and a crash between the
commit and the checkpoint never loses one. Kafka commits (``commit``) are advisory: progress
for monitoring, and the resume point of a trainer that does not checkpoint.

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

**Rebalances.** The committed offset of a partition carries the same position (the offset,
and the ``yielded`` list as commit metadata). On revoke the client commits, synchronously,
the position of everything it yielded from the revoked partitions, so the next owner
starts after it; it drops their partial groups (the next owner re-reads them) and never
commits for a partition it no longer owns. A partition assigned again never moves back:
the start is the checkpoint's position on the first assignment, else the later of the
committed position and the one this client left behind. A checkpointing trainer is its
group's only member (its ranks share the batches of one client); ``resume_from`` applies to
the partitions of the first assignment.

The remembered trajectory keys (``trainer.dedupe_window_keys``) are only a safety net for
a record written twice (a group the replay buffer released again).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rolloutbus.config import AsyncTrainingConfig, KafkaConfig, TrainerConfig
from rolloutbus.errors import BrokerError, SchemaError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    broker_error,
    message_location,
    read_committed_consumer,
    record_location,
    record_or_partition_end,
    record_position,
    translate_kafka_errors,
)
from rolloutbus.kafka.control import PolicyVersionFollower, latest_policy_version
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.metrics import DeliveryMetrics, StalenessMetrics
from rolloutbus.schemas.trajectories import decode_trajectory_batch
from rolloutbus.topics import Topics, uid_of_key

log = logging.getLogger(__name__)
ASSIGN_TIMEOUT_S = 30.0  # seconds for the committed-offset and watermark look-ups of an assignment
COMMIT_METADATA_MAX_BYTES = 4096  # bytes; the broker's default offset.metadata.max.bytes


# -- the position ------------------------------------------------------------------------


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


# -- groups of one partition (pure: no Kafka) ----------------------------------------------


@dataclass
class TrajectoryGroup:
    """All trajectories of one prompt group, as one ragged Arrow RecordBatch."""

    uid: str
    batch: pa.RecordBatch
    partition: int
    last_offset: int
    # where the partition resumes once this group, and every group yielded before it from
    # the same partition, is used: what ``commit`` writes
    resume: PartitionPosition | None = None
    assignment: int = field(default=0, repr=False)  # which ownership of the partition it came from
    sequence: int = field(default=0, repr=False)  # yield order within the client
    # the staleness filter's verdict (``async_training``): versions between the trainer's
    # current policy version and the group's oldest (None: no filter, or no versions), and
    # the factor for this group's loss (below 1 when down-weighted as stale)
    staleness: int | None = None
    loss_weight: float = 1.0

    @property
    def min_policy_version(self) -> int | None:
        """The oldest policy version that sampled any token of the group (verl's
        ``min_global_steps``, over its trajectories)."""
        return _column_min(self.batch, "min_global_steps")

    @property
    def max_policy_version(self) -> int | None:
        column = self.batch.column("max_global_steps").to_pylist()
        versions = [v for v in column if v is not None]
        return max(versions) if versions else None

    @property
    def keys(self) -> list[str]:
        return self.batch.column("key").to_pylist()

    def __len__(self) -> int:
        return self.batch.num_rows


@dataclass
class _PendingGroup:
    first_offset: int
    rows: list[pa.RecordBatch] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    group_size: int = 0

    def add(self, key: str, row: pa.RecordBatch) -> None:
        if key in self.keys:
            return  # the same trajectory twice within one group: keep the first
        self.keys.append(key)
        self.rows.append(row)
        self.group_size = row.column("group_size")[0].as_py()

    @property
    def complete(self) -> bool:
        return len(self.rows) >= self.group_size

    def batch(self) -> pa.RecordBatch:
        return pa.concat_batches(self.rows)  # every row has TRAJECTORY_SCHEMA (the decoder's)


class PartitionProgress:
    """One owned partition as its records arrive: the incomplete groups, and the yielded ones
    whose records may still lie at or after the resume offset."""

    def __init__(self, start: PartitionPosition, *, max_interleaved: int, where: str = ""):
        self.next_offset = start.offset  # just past the last record consumed
        self.pending: dict[str, _PendingGroup] = {}
        self.yielded: dict[str, int] = dict(start.yielded)
        self.max_interleaved = max_interleaved
        self.where = where  # topic[partition], for log lines

    def consumed(self, offset: int) -> None:
        self.next_offset = max(self.next_offset, offset + 1)

    def add(self, offset: int, key: str, value: bytes) -> _PendingGroup | None:
        """Take one record; returns its group once every trajectory of it has arrived."""
        self.consumed(offset)
        uid = uid_of_key(key)
        if uid in self.yielded:
            return None  # yielded by this client or by the one whose position it resumed
        row = decode_trajectory_batch(value)  # before the group exists: junk opens none
        group = self.pending.setdefault(uid, _PendingGroup(first_offset=offset))
        group.add(key, row)
        if not group.complete:
            return None
        del self.pending[uid]
        self.yielded[uid] = offset
        self._forget_passed()
        self._stay_bounded()
        return group

    def resume_offset(self) -> int:
        return min((g.first_offset for g in self.pending.values()), default=self.next_offset)

    def snapshot(self) -> PartitionPosition:
        return PartitionPosition(offset=self.resume_offset(), yielded=dict(self.yielded))

    def _forget_passed(self) -> None:
        resume = self.resume_offset()
        self.yielded = {uid: last for uid, last in self.yielded.items() if last >= resume}

    def _stay_bounded(self) -> None:
        while self.pending and (
            len(self.yielded) > self.max_interleaved
            or len(self.snapshot().commit_metadata()) > COMMIT_METADATA_MAX_BYTES
        ):
            uid, oldest = min(self.pending.items(), key=lambda item: item[1].first_offset)
            del self.pending[uid]
            log.error(
                "group %s at %s@%d is still incomplete (%d of %d trajectories) after %d later "
                "groups completed: given up (rebuild it with `rolloutbus replay`)",
                uid,
                self.where,
                oldest.first_offset,
                len(oldest.rows),
                oldest.group_size,
                len(self.yielded),
            )
            self._forget_passed()


# -- the staleness bound --------------------------------------------------------------------


@dataclass
class StaleGroupReport:
    """What the staleness filter did since the client started (``TrainerClient.stale``)."""

    dropped: int = 0
    down_weighted: int = 0
    max_staleness: int = 0  # the largest staleness seen in any group received
    # the last dropped groups: (uid, min policy version, policy version when dropped)
    recent_dropped: list[tuple[str, int, int]] = field(default_factory=list)

    RECENT = 32  # dropped groups kept in recent_dropped

    def note_dropped(self, uid: str, min_version: int, current: int) -> None:
        self.dropped += 1
        self.recent_dropped = [*self.recent_dropped, (uid, min_version, current)][-self.RECENT :]


class StalenessFilter:
    """AReaL's and verl's bound on the trainer's side: a group whose oldest token was
    sampled by a version older than ``current - staleness_threshold`` is stale; it is
    dropped (not yielded: its records count as consumed, so it is never delivered again)
    or yielded with ``loss_weight = stale_group_weight``, by ``stale_group_policy``.

    The current version is the trainer's: it calls :meth:`TrainerClient.set_policy_version`
    when it publishes one, or the client follows ``rollout.control`` (``follow_control``).
    A group without versions (an engine that reports none) is never stale.
    """

    def __init__(self, config: AsyncTrainingConfig, registry: CollectorRegistry | None = None):
        self.config = config
        self.policy_version = 0
        self.report = StaleGroupReport()
        self._metrics = StalenessMetrics(registry)

    def admit(self, group: TrajectoryGroup) -> bool:
        """Stamp ``group`` with its staleness and weight; False if it is to be dropped."""
        oldest = group.min_policy_version
        if oldest is None:
            return True
        group.staleness = max(0, self.policy_version - oldest)
        self.report.max_staleness = max(self.report.max_staleness, group.staleness)
        self._metrics.staleness.observe(group.staleness)
        if group.staleness <= self.config.staleness_threshold:
            return True
        if self.config.stale_group_policy == "drop":
            self.report.note_dropped(group.uid, oldest, self.policy_version)
            self._metrics.stale_groups.labels("dropped").inc()
            log.info(
                "dropped stale group %s: min policy version %d, current %d, staleness_threshold %d",
                group.uid,
                oldest,
                self.policy_version,
                self.config.staleness_threshold,
            )
            return False
        group.loss_weight = self.config.stale_group_weight
        self.report.down_weighted += 1
        self._metrics.stale_groups.labels("down_weighted").inc()
        return True


def _column_min(batch: pa.RecordBatch, name: str) -> int | None:
    versions = [v for v in batch.column(name).to_pylist() if v is not None]
    return min(versions) if versions else None


# -- the client ----------------------------------------------------------------------------


class TrainerClient:
    """Complete groups of rollout.trajectories for one trainer; see the module docstring.

    ``resume_from``: a :class:`TrainerPosition` (or its JSON dict) from the trainer's
    checkpoint; its partitions start exactly there, whatever the group has committed.
    ``config``: the ``trainer`` section (dedupe window, interleaving bound, poll interval).
    ``consumer_overrides``: extra librdkafka settings.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        group_id: str,
        *,
        from_beginning: bool = True,
        resume_from: TrainerPosition | Mapping[str, Any] | None = None,
        config: TrainerConfig | None = None,
        consumer_overrides: Mapping[str, Any] | None = None,
        async_training: AsyncTrainingConfig | None = None,
        follow_control: bool = False,
        registry: CollectorRegistry | None = None,
    ):
        self.topic = Topics.from_config(kafka).trajectories
        self._kafka = kafka
        self._letters: DeadLetterWriter | None = None  # made on the first junk record
        self.dead_letters = 0  # junk records on the trajectory topic, dead-lettered
        # the staleness bound: off unless the async_training section is given
        self.staleness = (
            StalenessFilter(async_training, registry) if async_training is not None else None
        )
        self._control: PolicyVersionFollower | None = None
        if follow_control and self.staleness is not None:
            # the current version read to the end first, so the first group is judged by it
            latest = latest_policy_version(kafka)
            self.staleness.policy_version = latest.policy_version if latest else 0
            self._control = PolicyVersionFollower(kafka)
        self.config = config or TrainerConfig()
        self._from_beginning = from_beginning
        self._resume = (
            dict(_checked_position(resume_from, self.topic).partitions) if resume_from else {}
        )
        self._progress: dict[int, PartitionProgress] = {}
        self._assignment: dict[int, int] = {}  # partition -> id of its current ownership
        self._assignments_made = 0
        self._committed_sequence: dict[
            int, int
        ] = {}  # partition -> sequence of the last group committed
        self._left_behind: dict[
            int, PartitionPosition
        ] = {}  # positions of partitions revoked or lost
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._yield_count = 0
        self._closing = self._closed = False
        overrides = {
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "max.poll.interval.ms": int(self.config.max_poll_interval_s * 1000),
            **(consumer_overrides or {}),
        }
        self._consumer = read_committed_consumer(kafka, group_id, overrides=overrides)
        with translate_kafka_errors(f"subscribing group {group_id!r}", topic=self.topic):
            self._consumer.subscribe(
                [self.topic],
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )

    # -- receiving ---------------------------------------------------------------
    def groups(
        self, *, max_groups: int | None = None, timeout_s: float | None = None, poll_s: float = 0.5
    ) -> Iterator[TrajectoryGroup]:
        """Yield complete groups as they arrive; stop after max_groups or timeout_s idle."""
        if max_groups is not None and max_groups <= 0:
            return
        yielded = 0
        for msg in self._records(poll_s, timeout_s):
            group = self._accept(msg)
            if group is None or not self._admit(group):
                continue
            yielded += 1
            DeliveryMetrics().observe_record(msg.timestamp())  # last turn -> trainer latency
            yield group
            if yielded == max_groups:
                return

    def batches(self, groups_per_batch: int, **kwargs: Any) -> Iterator[list[TrajectoryGroup]]:
        """Groups in lists of ``groups_per_batch`` (a train batch of prompts)."""
        chunk: list[TrajectoryGroup] = []
        for group in self.groups(**kwargs):
            chunk.append(group)
            if len(chunk) == groups_per_batch:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version, for the staleness bound."""
        if self.staleness is not None:
            self.staleness.policy_version = version

    @property
    def stale(self) -> StaleGroupReport:
        """What the staleness filter dropped or down-weighted (all zero without one)."""
        return self.staleness.report if self.staleness is not None else StaleGroupReport()

    def _admit(self, group: TrajectoryGroup) -> bool:
        if self.staleness is None:
            return True
        if self._control is not None and (event := self._control.poll(0)) is not None:
            # only forward: the follower reads the topic from its start
            self.staleness.policy_version = max(self.staleness.policy_version, event.policy_version)
        return self.staleness.admit(group)

    def position(self) -> TrainerPosition:
        """Where the groups yielded so far end, for every partition this client owns: store
        it in the checkpoint together with the model trained on those groups."""
        return TrainerPosition(
            topic=self.topic,
            partitions={p: prog.snapshot() for p, prog in sorted(self._progress.items())},
        )

    # -- committing --------------------------------------------------------------
    def commit(self, used: TrajectoryGroup | list[TrajectoryGroup]) -> None:
        """Record in the group that ``used`` (and every group yielded before it from the same
        partitions) was used; a restart without a checkpoint position resumes after them.

        Groups from a partition this client no longer owns are left out: the commit at revoke
        covered them. A refused commit raises BrokerError naming ``topic[partition]@offset``.
        """
        groups = used if isinstance(used, list) else [used]
        latest: dict[int, TrajectoryGroup] = {}
        for g in groups:
            if g.resume is None or self._assignment.get(g.partition) != g.assignment:
                log.info(
                    "not committing group %s: %s[%d] was revoked since it was yielded",
                    g.uid,
                    self.topic,
                    g.partition,
                )
                continue
            if g.sequence > max(
                self._committed_sequence.get(g.partition, 0),
                latest[g.partition].sequence if g.partition in latest else 0,
            ):
                latest[g.partition] = g
        self._commit_positions(
            {p: g.resume for p, g in latest.items() if g.resume is not None},
            f"{len(groups)} used groups",
        )
        for p, g in latest.items():
            self._committed_sequence[p] = g.sequence

    def close(self) -> None:
        """Leave the group without committing: what the trainer used it has committed."""
        if self._closed:
            return
        self._closing = True
        self._letters = None  # its producer flushed every letter: nothing left to deliver
        try:
            if self._control is not None:
                self._control.close()
            with translate_kafka_errors("closing the trainer consumer", topic=self.topic):
                self._consumer.close()
        finally:
            self._closed = True

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- records -----------------------------------------------------------------
    def _records(self, poll_s: float, idle_timeout_s: float | None) -> Iterator[Message]:
        idle_since = time.monotonic()
        while True:
            msg = self._poll(poll_s)
            if msg is not None:
                idle_since = time.monotonic()
                yield msg
            elif idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                return

    def _poll(self, poll_s: float) -> Message | None:
        msg = self._consumer.poll(poll_s)
        if msg is None:
            return None
        err = msg.error()
        if err is not None and err.code() == KafkaError._MAX_POLL_EXCEEDED:
            # librdkafka left the group and rejoins on this poll; the revoke already ran
            log.warning(
                "%s: this trainer rejoins its group (raise trainer.max_poll_interval_s "
                "if a train step takes this long)",
                err.str(),
            )
            return None
        item = record_or_partition_end(msg)
        return None if isinstance(item, PartitionEnd) else item

    def _accept(self, msg: Message) -> TrajectoryGroup | None:
        partition, offset = record_position(msg)
        progress = self._progress.get(partition)
        if progress is None:
            return None  # revoked meanwhile: the next owner reads it
        try:
            key, value = _key_and_value(msg)
            if key in self._seen:
                progress.consumed(offset)
                return None
            group = progress.add(offset, key, value)
        except (SchemaError, ValidationError) as exc:  # what the decoders raise on junk
            progress.consumed(offset)
            self._dead_letter(msg, f"not a trajectory record: {exc}")
            return None
        if group is None:
            return None
        for k in group.keys:
            self._remember(k)
        self._yield_count += 1
        return TrajectoryGroup(
            uid_of_key(key),
            group.batch(),
            partition,
            offset,
            resume=progress.snapshot(),
            assignment=self._assignment[partition],
            sequence=self._yield_count,
        )

    def _dead_letter(self, msg: Message, reason: str) -> None:
        """Junk on the trajectory topic (the replay buffer writes none: another writer, or
        a corrupted record) goes to the dead-letter topic and is skipped, never trained on
        and never the end of the trainer."""
        if self._letters is None:
            self._letters = DeadLetterWriter(self._kafka, stage="trainer")
        key = (msg.key() or b"").decode("utf-8", "replace")
        self._letters.write(msg.value() or b"", reason, source=message_location(msg), key=key)
        self.dead_letters += 1

    def _remember(self, key: str) -> None:
        self._seen[key] = None
        while len(self._seen) > self.config.dedupe_window_keys:
            self._seen.popitem(last=False)

    # -- rebalancing -------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        starts = self._start_positions(consumer, partitions)
        for partition, start in starts.items():
            self._assignments_made += 1
            self._assignment[partition] = self._assignments_made
            self._progress[partition] = PartitionProgress(
                start,
                max_interleaved=self.config.max_interleaved_groups,
                where=record_location(self.topic, partition),
            )
            log.info(
                "assigned %s from offset %d (%d yielded groups past it)",
                record_location(self.topic, partition),
                start.offset,
                len(start.yielded),
            )
        with translate_kafka_errors("assigning partitions", topic=self.topic):
            consumer.assign(
                [TopicPartition(self.topic, p, start.offset) for p, start in starts.items()]
            )

    def _start_positions(
        self, consumer: Consumer, partitions: list[TopicPartition]
    ) -> dict[int, PartitionPosition]:
        with translate_kafka_errors("reading committed offsets", topic=self.topic):
            committed = consumer.committed(partitions, timeout=ASSIGN_TIMEOUT_S)
        starts: dict[int, PartitionPosition] = {}
        for tp in committed:
            checkpoint = self._resume.pop(tp.partition, None)
            if checkpoint is not None:
                starts[tp.partition] = checkpoint
                continue
            group = (
                PartitionPosition.from_commit(tp.offset, tp.metadata) if tp.offset >= 0 else None
            )
            own = self._left_behind.pop(tp.partition, None)
            starts[tp.partition] = (
                _later(group, own)
                if group or own
                else PartitionPosition(offset=self._reset_offset(consumer, tp.partition))
            )
        self._forget_checkpoint_of_others()
        return starts

    def _forget_checkpoint_of_others(self) -> None:
        """The checkpoint holds for the first assignment only: a partition that went to another
        member meanwhile moved on, and going back to the checkpoint would deliver again."""
        if self._resume:
            log.warning(
                "resume_from names %s, not assigned to this client: they start at the group's "
                "committed offsets (a checkpointing trainer should be its group's only member)",
                ", ".join(record_location(self.topic, p) for p in sorted(self._resume)),
            )
            self._resume.clear()

    def _reset_offset(self, consumer: Consumer, partition: int) -> int:
        """Where a partition with no commit starts, as a number: the position needs one."""
        tp = TopicPartition(self.topic, partition)
        with translate_kafka_errors("reading watermarks", topic=self.topic, partition=partition):
            low, high = consumer.get_watermark_offsets(tp, timeout=ASSIGN_TIMEOUT_S, cached=False)
        return low if self._from_beginning else high

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        positions = self._release(partitions)
        if self._closing or not positions:
            return  # on close the trainer has committed what it used
        try:
            self._commit_positions(positions, "the groups yielded before a revoke")
        except BrokerError as exc:  # lost meanwhile; the next owner may deliver them again
            log.error("%s: the next owner of these partitions may deliver their groups again", exc)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._release(partitions)  # another member may own them already: commit nothing

    def _release(self, partitions: list[TopicPartition]) -> dict[int, PartitionPosition]:
        """Drop the partitions' partial groups (the next owner re-reads them); remember where
        this client was, so that a later assignment never moves back."""
        positions = {}
        for tp in partitions:
            progress = self._progress.pop(tp.partition, None)
            self._assignment.pop(tp.partition, None)
            self._committed_sequence.pop(tp.partition, None)
            if progress is not None:
                positions[tp.partition] = self._left_behind[tp.partition] = progress.snapshot()
        return positions

    def _commit_positions(self, positions: dict[int, PartitionPosition], what: str) -> None:
        offsets = [
            TopicPartition(self.topic, p, pos.offset, metadata=pos.commit_metadata())
            for p, pos in sorted(positions.items())
        ]
        if not offsets:
            return
        where = ", ".join(record_location(self.topic, tp.partition, tp.offset) for tp in offsets)
        try:
            results = self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise broker_error(exc, f"committing {what} at {where}") from exc
        for tp in results or []:
            if tp.error is not None:
                raise broker_error(
                    tp.error,
                    f"committing {what}",
                    topic=self.topic,
                    partition=tp.partition,
                    offset=tp.offset,
                )


def _later(a: PartitionPosition | None, b: PartitionPosition | None) -> PartitionPosition:
    """The position further on; at the same offset, skip what either one yielded."""
    if a is None or b is None:
        result = a or b
        assert result is not None
        return result
    if a.offset != b.offset:
        return a if a.offset > b.offset else b
    return PartitionPosition(offset=a.offset, yielded={**a.yielded, **b.yielded})


def _key_and_value(msg: Message) -> tuple[str, bytes]:
    raw_key, value = msg.key(), msg.value()
    if raw_key is None or value is None:  # the replay buffer writes neither
        raise SchemaError(f"record at {message_location(msg)} has no key or no value")
    try:
        return raw_key.decode(), value
    except UnicodeDecodeError as exc:
        raise SchemaError(f"record at {message_location(msg)} has a key that is not UTF-8") from exc


def _checked_position(position: TrainerPosition | Mapping[str, Any], topic: str) -> TrainerPosition:
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
