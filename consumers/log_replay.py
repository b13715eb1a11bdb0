"""Rebuild trajectories from any range of the turn log, without touching live state.

Reads rollout.turns (read_committed, no consumer group, nothing committed), folds each
partition with the same code as the live replay buffer, and returns the trajectories of
every group whose events lie wholly inside the range. Groups that started before the
range or had not settled by its end are reported, not guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.trajectories import Trajectory, encode_trajectories
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.partition_fold import PartitionFold
from rolloutbus.streams.assembly.trajectories import finalize_group
from rolloutbus.topics import Topics


@dataclass
class ReplayResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)  # key -> value, as the buffer writes it
    events: int = 0
    undecodable: int = 0
    open_groups: list[str] = field(default_factory=list)  # not settled within the range


def replay_turns(cfg: Config, *, partitions: list[int] | None = None, start_offset: int = 0,
                 end_offset: int | None = None) -> ReplayResult:
    """Fold ``[start_offset, end_offset)`` of each partition (default: all, to the end)."""
    topic = Topics.from_config(cfg.kafka).turns
    result = ReplayResult()
    for part in partitions if partitions is not None else range(cfg.kafka.partitions):
        fold = PartitionFold(next_offset=start_offset, traj_next_offset=0)
        for msg in read_partition(cfg.kafka, topic, part, start_offset, end_offset):
            _replay_record(cfg, fold, msg, result)
        result.open_groups.extend(fold.open)
    return result


def _replay_record(cfg: Config, fold: PartitionFold, msg, result: ReplayResult) -> None:
    result.events += 1
    try:
        event = decode_turn_event(msg.value())
    except ValidationError:
        result.undecodable += 1  # the live buffer dead-lettered it too
        return
    released = fold.apply(msg.offset(), event)
    if released is not None:
        trajectories, _ = finalize_group(released, cfg.rollout)
        result.trajectories.extend(trajectories)
        result.records.update(zip((t.key for t in trajectories),
                                  encode_trajectories(trajectories), strict=True))
