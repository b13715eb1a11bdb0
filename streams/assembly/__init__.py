"""Turns → trajectories: fold the turn log per session and per partition, build and check
each settled group's trajectories, and release them exactly once (the replay buffer).

Import direction: ``session_fold`` ← ``partition_fold`` ← ``trajectories`` ← ``released``
← ``replay_buffer``.
"""

from __future__ import annotations

import importlib
import typing

from rolloutbus.streams.assembly.partition_fold import (
    FoldLimits,
    OpenGroup,
    PartitionFold,
    ReleasedGroup,
)
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

if typing.TYPE_CHECKING:
    from rolloutbus.streams.assembly.released import ReleasedRecord

# Imported on first use: ``released`` reads the turn log through Kafka, and importing the pure
# folds must not load confluent-kafka.
_LAZY = {"ReleasedRecord": "rolloutbus.streams.assembly.released"}


def __getattr__(name: str) -> typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rolloutbus.streams.assembly' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
