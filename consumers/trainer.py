"""Deprecated: the trainer client moved to ``rolloutbus.consumers.client`` (and its seams to
``consumers.position``, ``consumers.groups``, ``consumers.ownership``,
``consumers.staleness``). This path keeps working for one release, with a warning.
"""

from __future__ import annotations

import warnings

from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import PartitionProgress, PendingGroup, TrajectoryGroup
from rolloutbus.consumers.position import (
    COMMIT_METADATA_MAX_BYTES,
    PartitionPosition,
    TrainerPosition,
    checked_position,
    later_position,
)
from rolloutbus.consumers.staleness import StaleGroupReport, StalenessFilter

__all__ = [
    "COMMIT_METADATA_MAX_BYTES",
    "PartitionPosition",
    "PartitionProgress",
    "StaleGroupReport",
    "StalenessFilter",
    "TrainerClient",
    "TrainerPosition",
    "TrajectoryGroup",
]

# the old private names, for code that reached into the module
_PendingGroup = PendingGroup
_later = later_position
_checked_position = checked_position

warnings.warn(
    "rolloutbus.consumers.trainer is deprecated and will be removed in the next release: "
    "import TrainerClient from rolloutbus.consumers (or rolloutbus.consumers.client)",
    DeprecationWarning,
    stacklevel=2,
)
