"""Turns → trajectories: fold the turn log per session and per partition, build and check
each settled group's trajectories, and release them exactly once (the replay buffer).

Import direction: ``session_fold`` ← ``partition_fold`` ← ``trajectories`` ← ``released``
← ``replay_buffer``.
"""

from rolloutbus.streams.assembly.partition_fold import (
    FoldLimits,
    OpenGroup,
    PartitionFold,
    ReleasedGroup,
)
from rolloutbus.streams.assembly.released import ReleasedRecord
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import (
    FinalizedGroup,
    Letter,
    build_group_trajectories,
    failed_trajectory,
    finalize_group,
    violations,
)

__all__ = [
    "FinalizedGroup",
    "FoldLimits",
    "Letter",
    "OpenGroup",
    "PartitionFold",
    "ReleasedGroup",
    "ReleasedRecord",
    "SessionFold",
    "build_group_trajectories",
    "failed_trajectory",
    "finalize_group",
    "violations",
]
