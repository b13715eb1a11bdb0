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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rolloutbus.consumers.position import COMMIT_METADATA_MAX_BYTES, PartitionPosition
from rolloutbus.schemas.trajectories import (
    TRAJECTORY_SCHEMA,
    TrajectoryStatus,
    decode_trajectory_batch,
)
from rolloutbus.topics import uid_of_key

__all__ = ["PartitionProgress", "PendingGroup", "TrajectoryGroup", "SUCCESSFUL"]

log = logging.getLogger(__name__)
# the members a trainer learns from (trainer.min_successful_per_group counts them)
SUCCESSFUL = frozenset({TrajectoryStatus.COMPLETED.value, TrajectoryStatus.TRUNCATED.value})
_GROUP_SIZE = TRAJECTORY_SCHEMA.get_field_index("group_size")  # every decoded row's schema


class TrajectoryGroup:
    """All trajectories of one prompt group, as one ragged Arrow RecordBatch.

    ``batch`` may be given as the group's rows, one-row batches of one schema (what the
    trainer client decodes): they are concatenated on the first read of ``batch``, so a
    reader that never needs the whole group (``build_train_batch`` concatenates the rows
    of all its groups at once, see :attr:`parts`) never pays for it. Every value read
    from the group is the same either way.
    """

    def __init__(
        self,
        uid: str,
        batch: pa.RecordBatch | Sequence[pa.RecordBatch],
        partition: int,
        last_offset: int,
        resume: PartitionPosition | None = None,
        assignment: int = 0,
        sequence: int = 0,
        staleness: int | None = None,
        loss_weight: float = 1.0,
    ):
        self.uid = uid
        self._batch = batch if isinstance(batch, pa.RecordBatch) else None
        self._rows = None if isinstance(batch, pa.RecordBatch) else list(batch)
        self.partition = partition
        self.last_offset = last_offset
        # where the partition resumes once this group, and every group yielded before it
        # from the same partition, is used: what ``commit`` writes
        self.resume = resume
        self.assignment = assignment  # which ownership of the partition it came from
        self.sequence = sequence  # yield order within the client
        # the staleness filter's verdict (``async_training``): versions between the
        # trainer's current policy version and the group's oldest (None: no filter, or no
        # versions), and the factor for this group's loss (below 1 when down-weighted)
        self.staleness = staleness
        self.loss_weight = loss_weight

    @property
    def batch(self) -> pa.RecordBatch:
        if self._batch is None:
            assert self._rows is not None
            self._batch = pa.concat_batches(self._rows)  # one schema: the decoder's
            self._rows = None
        return self._batch

    @property
    def parts(self) -> list[pa.RecordBatch]:
        """Batches whose rows, in order, are the group's: its rows while ``batch`` has not
        been read, else ``[batch]``. Concatenating several groups' parts at once costs
        pyarrow's price per column once, not once per group and again for the train batch."""
        return [self._batch] if self._rows is None else list(self._rows)

    @property
    def min_policy_version(self) -> int | None:
        """The oldest policy version that sampled any token of the group (verl's
        ``min_global_steps``, over its trajectories)."""
        versions = [v for v in self._values("min_global_steps") if v is not None]
        return min(versions) if versions else None

    @property
    def max_policy_version(self) -> int | None:
        versions = [v for v in self._values("max_global_steps") if v is not None]
        return max(versions) if versions else None

    @property
    def keys(self) -> list[str]:
        return self._values("key")

    @property
    def successful(self) -> int:
        """Members that completed or were truncated (not failed)."""
        return sum(1 for status in self._values("status") if status in SUCCESSFUL)

    def _values(self, column: str) -> list[Any]:
        """One column's values, row by row, read without concatenating the rows."""
        return [value for part in self.parts for value in part.column(column).to_pylist()]

    def __len__(self) -> int:
        return sum(part.num_rows for part in self.parts)

    def __repr__(self) -> str:
        return (
            f"TrajectoryGroup(uid={self.uid!r}, rows={len(self)}, partition={self.partition}, "
            f"last_offset={self.last_offset}, staleness={self.staleness}, "
            f"loss_weight={self.loss_weight})"
        )


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
        self.group_size = row.column(_GROUP_SIZE)[0].as_py()

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
        group = self.pending.get(uid)
        if group is None:
            group = self.pending[uid] = PendingGroup(first_offset=offset)
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
