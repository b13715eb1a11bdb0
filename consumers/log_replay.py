"""Rebuild trajectories from any range of the turn log, without touching live state.

Reads rollout.turns (read_committed, no consumer group, nothing committed), folds each
partition with the same code and the same bounds (``deadlines.group_s``,
``replay_buffer.max_open_groups``, ``limits.max_n``: ``FoldLimits.from_config``) as the
live replay buffer, and returns the trajectories of every group it releases, byte for
byte as the buffer wrote them. Each group is checked against the budgets its
``group_started`` recorded, so the replaying config's ``rollout`` lengths do not matter
(only a log written before groups recorded them falls back to the config, with a warning).
Groups that had not settled by the end of the range are reported, not guessed at; so are
events the buffer dead-letters.

A replay may select groups by uid (only their partitions are read, each until its selected
groups are released) or by the time their ``group_started`` was written (Kafka's record
timestamps, found with offsets-for-times): a partition is read from the first record at or
after ``since``, and a group whose head lies at or after ``until`` is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import RolloutBusError, SchemaError
from rolloutbus.kafka.clients import record_position
from rolloutbus.kafka.partition_reader import offset_for_time, read_partition
from rolloutbus.schemas.trajectories import Trajectory
from rolloutbus.streams.assembly.fold_events import decode_fold_event
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold, ReleasedGroup
from rolloutbus.streams.assembly.trajectories import finalize_group, max_record_bytes
from rolloutbus.topics import Topics, partition_for


@dataclass
class ReplayResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)  # key -> value, as the buffer writes it
    batches: list[pa.RecordBatch] = field(default_factory=list)  # the records' rows, per group
    released: int = 0  # trajectories released (kept in ``trajectories`` unless asked not to)
    events: int = 0
    undecodable: int = 0  # events the live buffer dead-letters instead of folding
    open_groups: list[str] = field(default_factory=list)  # not settled within the range
    # groups logged before group_started recorded their settings: folded with the config's
    groups_without_settings: int = 0
    missing_uids: list[str] = field(default_factory=list)  # asked for, not released in range


@dataclass
class _PartitionRange:
    """What one partition's replay reads and keeps."""

    partition: int
    start: int  # first offset read
    head_before: int | None = None  # keep groups whose group_started is before this offset
    uids: set[str] | None = None  # keep only these (those of this partition)
    by_time: bool = False  # selected by time: a group whose head is not in range is left out

    def keeps(self, released: ReleasedGroup) -> bool:
        if self.uids is not None and released.group.uid not in self.uids:
            return False
        if self.by_time and released.kind == "head_missing":
            return False  # its group_started is before `since`
        return self.head_before is None or released.first_offset < self.head_before

    def settled(self, fold: PartitionFold, offset: int, pending: set[str]) -> bool:
        """Whether nothing read after ``offset`` can add to what this replay keeps."""
        if self.uids is not None and not pending:
            return True
        if self.head_before is None or offset < self.head_before:
            return False
        return not any(
            g.started is not None and g.first_offset < self.head_before for g in fold.open.values()
        )


def replay_turns(
    cfg: Config,
    *,
    partitions: list[int] | None = None,
    start_offset: int = 0,
    end_offset: int | None = None,
    uids: Iterable[str] | None = None,
    since: float | None = None,
    until: float | None = None,
    keep_trajectories: bool = True,
    batch_sink: Callable[[pa.RecordBatch], None] | None = None,
) -> ReplayResult:
    """Fold ``[start_offset, end_offset)`` of each partition (default: all, to the end).

    ``uids``: only these groups. ``since``/``until`` (seconds since the epoch): only groups
    whose ``group_started`` was written in ``[since, until)``. ``keep_trajectories=False``:
    keep only the batches (what ``replay --out`` writes), not a model and a record per
    trajectory: a long replay then holds no Python list per token, which the garbage
    collector would scan again and again (a third of ``replay``'s CPU, P5). ``batch_sink``:
    each group's batch goes to it as the group is released, none is kept in the result
    (``replay --out`` writes them to its file as it goes: its memory stays flat).
    """
    topic = Topics.from_config(cfg.kafka).turns
    result = ReplayResult()
    limits = FoldLimits.from_config(cfg)
    wanted = set(uids) if uids is not None else None
    released_uids: set[str] = set()
    for part in _partitions(cfg, partitions, wanted):
        span = _partition_range(cfg, topic, part, start_offset, wanted, since, until)
        if span is None:
            continue  # no record that recent
        fold = PartitionFold(span.start, limits=limits)
        pending = set(span.uids or ())
        for msg in read_partition(cfg.kafka, topic, part, span.start, end_offset):
            offset = record_position(msg)[1]
            for group in _replay_record(fold, offset, msg.value(), result):
                if span.keeps(group):
                    _finalize(cfg, group, result, keep_trajectories, batch_sink)
                    pending.discard(group.group.uid)
                    released_uids.add(group.group.uid)
            if span.settled(fold, offset, pending):
                break
        result.open_groups.extend(
            uid
            for uid, g in fold.open.items()
            if (span.uids is None or uid in span.uids)
            and not (span.by_time and g.started is None)
            and (span.head_before is None or g.first_offset < span.head_before)
        )
    if wanted is not None:
        result.missing_uids = sorted(wanted - released_uids - set(result.open_groups))
    return result


def _partitions(cfg: Config, partitions: list[int] | None, uids: set[str] | None) -> list[int]:
    chosen = list(partitions) if partitions is not None else list(range(cfg.kafka.partitions))
    if uids is None:
        return chosen
    theirs = {partition_for(uid, cfg.kafka.partitions) for uid in uids}
    return [p for p in chosen if p in theirs]


def _partition_range(
    cfg: Config,
    topic: str,
    part: int,
    start_offset: int,
    uids: set[str] | None,
    since: float | None,
    until: float | None,
) -> _PartitionRange | None:
    start = start_offset
    if since is not None:
        found = offset_for_time(cfg.kafka, topic, part, since)
        if found is None:
            return None
        start = max(start, found)
    head_before = offset_for_time(cfg.kafka, topic, part, until) if until is not None else None
    mine = {u for u in uids if partition_for(u, cfg.kafka.partitions) == part} if uids else None
    return _PartitionRange(
        part, start, head_before, mine, by_time=since is not None or until is not None
    )


def _replay_record(
    fold: PartitionFold, offset: int, value: bytes | None, result: ReplayResult
) -> list[ReleasedGroup]:
    result.events += 1
    try:
        event = decode_fold_event(value or b"")  # the wire decoder, pydantic behind it
        return fold.fold(offset, event)
    except (ValidationError, SchemaError, RolloutBusError):
        result.undecodable += 1  # the live buffer dead-lettered it too
        return []


def _finalize(
    cfg: Config,
    group: ReleasedGroup,
    result: ReplayResult,
    keep: bool,
    batch_sink: Callable[[pa.RecordBatch], None] | None,
) -> None:
    if group.group.settings is None and group.kind not in ("head_missing", "rejected"):
        result.groups_without_settings += 1
    done = finalize_group(
        group,
        cfg.rollout,
        max_record_bytes=max_record_bytes(cfg.kafka),
        token_lists=keep,
        records=keep,  # a file holds the batches: a record per row only to check it fits
    )
    result.released += len(done.trajectories)
    if keep:
        result.trajectories.extend(done.trajectories)
        result.records.update(zip((t.key for t in done.trajectories), done.records, strict=True))
    if done.batch.num_rows:
        (batch_sink or result.batches.append)(done.batch)
