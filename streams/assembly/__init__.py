"""Turns → trajectories: fold the turn log per session and per partition, build and check
each settled group's trajectories, and release them exactly once (the replay buffer).

Import direction: ``session_fold`` ← ``partition_fold`` ← ``trajectories`` ← ``replay_buffer``.
"""

from rolloutbus.streams.assembly.partition_fold import OpenGroup, PartitionFold, ReleasedGroup
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import (
    Violation,
    build_group_trajectories,
    failed_trajectory,
    finalize_group,
    violations,
)

__all__ = ["OpenGroup", "PartitionFold", "ReleasedGroup", "SessionFold", "Violation",
           "build_group_trajectories", "failed_trajectory", "finalize_group", "violations"]
