"""Rebuild trajectories from any range of the turn log, without touching live state.

Reads rollout.turns (read_committed, no consumer group, nothing committed), folds each
partition with the same code and the same bounds (``deadlines.group_s``,
``replay_buffer.max_open_groups``, ``limits.max_n``: ``FoldLimits.from_config``) as the
live replay buffer, and returns the trajectories of every group it releases, byte for
byte as the buffer wrote them. Groups that had not settled by the end of the range are
reported, not guessed at; so are events the buffer dead-letters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import RolloutBusError, SchemaError
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.trajectories import Trajectory
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group, max_record_bytes
from rolloutbus.topics import Topics


@dataclass
class ReplayResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)  # key -> value, as the buffer writes it
    events: int = 0
    undecodable: int = 0  # events the live buffer dead-letters instead of folding
    open_groups: list[str] = field(default_factory=list)  # not settled within the range


def replay_turns(
    cfg: Config,
    *,
    partitions: list[int] | None = None,
    start_offset: int = 0,
    end_offset: int | None = None,
) -> ReplayResult:
    """Fold ``[start_offset, end_offset)`` of each partition (default: all, to the end)."""
    topic = Topics.from_config(cfg.kafka).turns
    result = ReplayResult()
    limits = FoldLimits.from_config(cfg)
    for part in partitions if partitions is not None else range(cfg.kafka.partitions):
        fold = PartitionFold(start_offset, limits=limits)
        for msg in read_partition(cfg.kafka, topic, part, start_offset, end_offset):
            _replay_record(cfg, fold, msg, result)
        result.open_groups.extend(fold.open)
    return result


def _replay_record(cfg: Config, fold: PartitionFold, msg, result: ReplayResult) -> None:
    result.events += 1
    try:
        event = decode_turn_event(msg.value() or b"")
        released = fold.fold(msg.offset(), event)
    except (ValidationError, SchemaError, RolloutBusError):
        result.undecodable += 1  # the live buffer dead-lettered it too
        return
    for group in released:
        done = finalize_group(group, cfg.rollout, max_record_bytes=max_record_bytes(cfg.kafka))
        result.trajectories.extend(done.trajectories)
        result.records.update(zip((t.key for t in done.trajectories), done.records, strict=True))
