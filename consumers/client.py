"""The trainer client: complete prompt groups from rollout.trajectories as Arrow batches.

Delivery: the replay buffer commits a group's trajectories in one transaction, so with
``isolation.level=read_committed`` a group is seen whole or not at all.

**Exactly once per trainer checkpoint.** ``client.position()`` says where the groups yielded
so far end (``consumers/position.py``); a trainer stores it in its checkpoint and resumes
with ``TrainerClient(..., resume_from=position)``. That position is the truth: a crash
between an optimizer step and the Kafka commit never trains a group twice, and a crash
between the commit and the checkpoint never loses one. Kafka commits are where a trainer
without a checkpoint starts: ``commit_position(saved)`` after each checkpoint keeps them
no further than what is saved (``rolloutbus train`` does so, and passes
``commit_on_revoke=False``); ``commit(groups)`` marks groups used, for a trainer that does
not checkpoint.

The seams: ``consumers/groups.py`` assembles a partition's records into groups,
``consumers/ownership.py`` owns partitions across rebalances and commits,
``consumers/staleness.py`` bounds staleness; this module polls and hands groups out.

**Which groups the trainer gets.** A complete group is skipped (consumed, never yielded,
counted) when fewer of its members than ``trainer.min_successful_per_group`` completed or
were truncated, and dropped or down-weighted when it is stale (``async_training``). With
``follow_control`` the staleness bound follows the newest run's version on
``rollout.control`` (``rolloutbus.kafka.version_ledger``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rolloutbus.config import AsyncTrainingConfig, KafkaConfig, TrainerConfig
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.metrics import DeliveryMetrics, TrainerClientMetrics
from rolloutbus.consumers.ownership import PartitionOwnership
from rolloutbus.consumers.position import (
    ASSIGN_TIMEOUT_S,
    KeyWindow,
    TrainerPosition,
    checked_position,
)
from rolloutbus.consumers.staleness import StaleGroupReport, StalenessFilter
from rolloutbus.errors import SchemaError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    message_location,
    read_committed_consumer,
    record_or_partition_end,
    record_position,
    translate_kafka_errors,
    watermark_offsets,
)
from rolloutbus.kafka.control import PolicyVersionFollower
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.topics import Topics, uid_of_key

__all__ = ["SkippedGroupReport", "TrainerClient"]

log = logging.getLogger(__name__)


@dataclass
class SkippedGroupReport:
    """Complete groups skipped for too few successful members (``TrainerClient.skipped``)."""

    too_few_successful: int = 0
    # the last skipped groups: (uid, members that completed or were truncated)
    recent: list[tuple[str, int]] = field(default_factory=list)

    RECENT = 32  # skipped groups kept in recent

    def note(self, uid: str, successful: int) -> None:
        self.too_few_successful += 1
        self.recent = [*self.recent, (uid, successful)][-self.RECENT :]


class TrainerClient:
    """Complete groups of rollout.trajectories for one trainer; see the module docstring.

    ``resume_from``: a :class:`TrainerPosition` (or its JSON dict) from the trainer's
    checkpoint; its partitions start exactly there, whatever the group has committed.
    ``config``: the ``trainer`` section (dedupe window, interleaving bound, poll interval,
    ``min_successful_per_group``). ``consumer_overrides``: extra librdkafka settings.
    ``commit_on_revoke``: commit what was yielded from partitions taken away (off for a
    trainer that commits only what its checkpoint holds).
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
        commit_on_revoke: bool = True,
        registry: CollectorRegistry | None = None,
    ):
        self.topic = Topics.from_config(kafka).trajectories
        self.config = config or TrainerConfig()
        self._kafka = kafka
        self._letters: DeadLetterWriter | None = None  # made on the first junk record
        self.dead_letters = 0  # junk records on the trajectory topic, dead-lettered
        # the staleness bound: off unless the async_training section is given
        self.staleness = (
            StalenessFilter(async_training, registry) if async_training is not None else None
        )
        self.skipped = SkippedGroupReport()
        self._metrics = TrainerClientMetrics(registry)
        self._control: PolicyVersionFollower | None = None
        if follow_control and self.staleness is not None:
            self._control = PolicyVersionFollower(kafka, registry=registry)
            self._follow_control()  # the first poll reads to the end: the current version
        resume = dict(checked_position(resume_from, self.topic).partitions) if resume_from else {}
        self._owned = PartitionOwnership(
            self.topic,
            self.config,
            resume=resume,
            from_beginning=from_beginning,
            commit_on_revoke=commit_on_revoke,
        )
        self._seen = KeyWindow(self.config.dedupe_window_keys)
        self._yield_count = 0
        self._closed = False
        overrides = {
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "max.poll.interval.ms": int(self.config.max_poll_interval_s * 1000),
            **(consumer_overrides or {}),
        }
        self._consumer = read_committed_consumer(kafka, group_id, overrides=overrides)
        with translate_kafka_errors(f"subscribing group {group_id!r}", topic=self.topic):
            self._consumer.subscribe(
                [self.topic],
                on_assign=self._owned.on_assign,
                on_revoke=self._owned.on_revoke,
                on_lost=self._owned.on_lost,
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
        """Whether the trainer gets ``group``: enough successful members, and not stale."""
        wanted = self.config.min_successful_per_group
        if wanted and group.successful < wanted:
            self.skipped.note(group.uid, group.successful)
            self._metrics.skipped_groups.labels("too_few_successful").inc()
            log.info(
                "skipped group %s: %d of %d members completed or truncated, "
                "trainer.min_successful_per_group is %d",
                group.uid,
                group.successful,
                len(group),
                wanted,
            )
            return False
        if self.staleness is None:
            return True
        self._follow_control()
        return self.staleness.admit(group)

    def _follow_control(self) -> None:
        """The newest run's current version (it may go down: a new run starts at 0)."""
        if self._control is None or self.staleness is None:
            return
        if (event := self._control.poll(0)) is not None:
            self.staleness.policy_version = event.policy_version

    def position(self) -> TrainerPosition:
        """Where the groups yielded so far end, for every partition this client owns: store
        it in the checkpoint together with the model trained on those groups."""
        return self._owned.position()

    def at_end(self, timeout_s: float = ASSIGN_TIMEOUT_S) -> bool:
        """Whether this client owns every partition of the topic and has read each one to
        its end (what a read_committed reader can reach now; a transaction's marker counts
        as read): ``rolloutbus consume`` without ``--follow`` stops there."""
        owned = [TopicPartition(self.topic, p) for p in sorted(self._owned.progress)]
        with translate_kafka_errors("reading the end of the topic", topic=self.topic):
            topic = self._consumer.list_topics(self.topic, timeout=timeout_s).topics[self.topic]
            if not owned or len(owned) < len(topic.partitions):
                return False  # not (yet) assigned all of it
            positions = self._consumer.position(owned)
        for tp in positions:
            low, end = watermark_offsets(self._consumer, tp, timeout_s)
            if low < end and tp.offset < end:  # negative: nothing fetched from it yet
                return False
        return True

    # -- committing --------------------------------------------------------------
    def commit(self, used: TrajectoryGroup | list[TrajectoryGroup]) -> None:
        """Record in the group that ``used`` (and every group yielded before it from the same
        partitions) was used; a restart without a checkpoint position resumes after them.

        Groups from a partition this client no longer owns are left out: the commit at revoke
        covered them. A refused commit raises BrokerError naming ``topic[partition]@offset``.
        """
        groups = used if isinstance(used, list) else [used]
        self._owned.commit_groups(self._consumer, groups)

    def commit_position(self, position: TrainerPosition) -> None:
        """Commit a saved position (the checkpoint's), for the partitions this client owns:
        what a trainer without a checkpoint would start from never runs ahead of it."""
        self._owned.commit_position(self._consumer, position)

    def close(self) -> None:
        """Leave the group without committing: what the trainer used it has committed."""
        if self._closed:
            return
        self._owned.closing = True
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
                continue
            self._follow_control()  # idle: the version stays current for the next group
            if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
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
        progress = self._owned.progress.get(partition)
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
        self._seen.remember(group.keys)
        self._yield_count += 1
        return TrajectoryGroup(
            uid_of_key(key),
            group.rows,  # concatenated when the trainer reads the group's batch
            partition,
            offset,
            resume=progress.snapshot(),
            assignment=self._owned.assignment[partition],
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


def _key_and_value(msg: Message) -> tuple[str, bytes]:
    raw_key, value = msg.key(), msg.value()
    if raw_key is None or value is None:  # the replay buffer writes neither
        raise SchemaError(f"record at {message_location(msg)} has no key or no value")
    try:
        return raw_key.decode(), value
    except UnicodeDecodeError as exc:
        raise SchemaError(f"record at {message_location(msg)} has a key that is not UTF-8") from exc
