"""Which partitions of rollout.trajectories a trainer client owns, across rebalances.

The committed offset of a partition carries the client's position (``consumers/position.py``:
the offset, and the ``yielded`` list as commit metadata). On revoke the
client commits, synchronously, the position of everything it yielded from the revoked
partitions, so the next owner starts after it (unless ``commit_on_revoke`` is off: a
checkpointing trainer commits only what it saved); it drops their partial groups (the next
owner re-reads them) and never commits for a partition it no longer owns. A partition
assigned again never moves back: the start is the checkpoint's position on the first
assignment, else the later of the committed position and the one this client left behind.
A checkpointing trainer is its group's only member (its ranks share the batches of one
client); ``resume_from`` applies to the partitions of the first assignment.
"""

from __future__ import annotations

import logging

from confluent_kafka import Consumer, TopicPartition

from rolloutbus.config import TrainerConfig
from rolloutbus.consumers.groups import PartitionProgress, TrajectoryGroup
from rolloutbus.consumers.position import (
    ASSIGN_TIMEOUT_S,
    PartitionPosition,
    TrainerPosition,
    later_position,
    watermark,
)
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    broker_error,
    committed_offsets,
    record_location,
    translate_kafka_errors,
)

__all__ = ["PartitionOwnership"]

log = logging.getLogger(__name__)


class PartitionOwnership:
    """The partitions a :class:`~rolloutbus.consumers.client.TrainerClient` owns: where each
    starts on assignment, what it leaves behind on revoke, and what it commits."""

    def __init__(
        self,
        topic: str,
        config: TrainerConfig,
        *,
        resume: dict[int, PartitionPosition],
        from_beginning: bool,
        commit_on_revoke: bool,
    ):
        self.topic = topic
        self.config = config
        self.progress: dict[int, PartitionProgress] = {}
        self.assignment: dict[int, int] = {}  # partition -> id of its current ownership
        self.closing = False
        self._resume = resume
        self._from_beginning = from_beginning
        self._commit_on_revoke = commit_on_revoke
        self._assignments_made = 0
        self._committed_sequence: dict[int, int] = {}  # partition -> last group committed
        self._left_behind: dict[int, PartitionPosition] = {}  # revoked or lost partitions

    # -- rebalancing -------------------------------------------------------------
    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        starts = self._start_positions(consumer, partitions)
        for partition, start in starts.items():
            self._assignments_made += 1
            self.assignment[partition] = self._assignments_made
            self.progress[partition] = PartitionProgress(
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

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        positions = self._release(partitions)
        if self.closing or not positions or not self._commit_on_revoke:
            return  # on close the trainer has committed what it used
        try:
            self.commit(consumer, positions, "the groups yielded before a revoke")
        except BrokerError as exc:  # lost meanwhile; the next owner may deliver them again
            log.error("%s: the next owner of these partitions may deliver their groups again", exc)

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._release(partitions)  # another member may own them already: commit nothing

    def _start_positions(
        self, consumer: Consumer, partitions: list[TopicPartition]
    ) -> dict[int, PartitionPosition]:
        with translate_kafka_errors("reading committed offsets", topic=self.topic):
            committed = committed_offsets(consumer, partitions, ASSIGN_TIMEOUT_S)
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
                later_position(group, own)
                if group or own
                else PartitionPosition(
                    offset=watermark(consumer, self.topic, tp.partition, self._from_beginning)
                )
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

    def _release(self, partitions: list[TopicPartition]) -> dict[int, PartitionPosition]:
        """Drop the partitions' partial groups (the next owner re-reads them); remember where
        this client was, so that a later assignment never moves back."""
        positions = {}
        for tp in partitions:
            progress = self.progress.pop(tp.partition, None)
            self.assignment.pop(tp.partition, None)
            self._committed_sequence.pop(tp.partition, None)
            if progress is not None:
                positions[tp.partition] = self._left_behind[tp.partition] = progress.snapshot()
        return positions

    # -- committing --------------------------------------------------------------
    def commit_groups(self, consumer: Consumer, groups: list[TrajectoryGroup]) -> None:
        """Commit, per partition, the resume position of the latest of ``groups`` yielded
        from the partition's current ownership."""
        latest: dict[int, TrajectoryGroup] = {}
        for g in groups:
            if g.resume is None or self.assignment.get(g.partition) != g.assignment:
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
        self.commit(
            consumer,
            {p: g.resume for p, g in latest.items() if g.resume is not None},
            f"{len(groups)} used groups",
        )
        for p, g in latest.items():
            self._committed_sequence[p] = g.sequence

    def commit_position(self, consumer: Consumer, position: TrainerPosition) -> None:
        """Commit ``position`` (a checkpoint's) for the partitions this client owns."""
        owned = {p: pos for p, pos in position.partitions.items() if p in self.assignment}
        self.commit(consumer, owned, "a checkpoint's position")

    def commit(
        self, consumer: Consumer, positions: dict[int, PartitionPosition], what: str
    ) -> None:
        offsets = [
            TopicPartition(self.topic, p, pos.offset, metadata=pos.commit_metadata())
            for p, pos in sorted(positions.items())
        ]
        if not offsets:
            return
        where = ", ".join(record_location(self.topic, tp.partition, tp.offset) for tp in offsets)
        with translate_kafka_errors(f"committing {what} at {where}"):
            results = consumer.commit(offsets=offsets, asynchronous=False)
        for tp in results or []:
            if tp.error is not None:
                raise broker_error(
                    tp.error,
                    f"committing {what}",
                    topic=self.topic,
                    partition=tp.partition,
                    offset=tp.offset,
                )

    def position(self) -> TrainerPosition:
        return TrainerPosition(
            topic=self.topic,
            partitions={p: prog.snapshot() for p, prog in sorted(self.progress.items())},
        )
