"""Complete prompt groups, assembled from one partition's trajectory records (pure: no Kafka).

The replay buffer writes a group's trajectories together, in one transaction, but a
partition may still hold two groups' records interleaved (a0 b0 b1 a1). A
:class:`PartitionProgress` collects each group's records until all ``group_size`` arrived,
then hands out the group; it also knows where the partition would resume (the position in
``consumers/position.py``): before the oldest group still incomplete, skipping the groups
yielded past it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pyarrow as pa

from rolloutbus.consumers.position import COMMIT_METADATA_MAX_BYTES, PartitionPosition
from rolloutbus.schemas.trajectories import (
    TrajectoryStatus,
    decode_trajectory_batch,
)
from rolloutbus.topics import uid_of_key

__all__ = ["PartitionProgress", "PendingGroup", "TrajectoryGroup", "SUCCESSFUL"]

log = logging.getLogger(__name__)
# the members a trainer learns from (trainer.min_successful_per_group counts them)
SUCCESSFUL = frozenset({TrajectoryStatus.COMPLETED.value, TrajectoryStatus.TRUNCATED.value})


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
        return column_min(self.batch, "min_global_steps")

    @property
    def max_policy_version(self) -> int | None:
        column = self.batch.column("max_global_steps").to_pylist()
        versions = [v for v in column if v is not None]
        return max(versions) if versions else None

    @property
    def keys(self) -> list[str]:
        return self.batch.column("key").to_pylist()

    @property
    def successful(self) -> int:
        """Members that completed or were truncated (not failed)."""
        return sum(1 for status in self.batch.column("status").to_pylist() if status in SUCCESSFUL)

    def __len__(self) -> int:
        return self.batch.num_rows


@dataclass
class PendingGroup:
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
        self.pending: dict[str, PendingGroup] = {}
        self.yielded: dict[str, int] = dict(start.yielded)
        self.max_interleaved = max_interleaved
        self.where = where  # topic[partition], for log lines

    def consumed(self, offset: int) -> None:
        self.next_offset = max(self.next_offset, offset + 1)

    def add(self, offset: int, key: str, value: bytes) -> PendingGroup | None:
        """Take one record; returns its group once every trajectory of it has arrived."""
        self.consumed(offset)
        uid = uid_of_key(key)
        if uid in self.yielded:
            return None  # yielded by this client or by the one whose position it resumed
        row = decode_trajectory_batch(value)  # before the group exists: junk opens none
        group = self.pending.setdefault(uid, PendingGroup(first_offset=offset))
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


def column_min(batch: pa.RecordBatch, name: str) -> int | None:
    versions = [v for v in batch.column(name).to_pylist() if v is not None]
    return min(versions) if versions else None
