"""What leaves: the trainer client (complete groups as Arrow batches) and tensor conversion."""

from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.consumers.tensors import PaddedBuffers, to_jagged, to_padded

__all__ = [
    "PaddedBuffers",
    "TrainerClient",
    "TrainerPosition",
    "TrajectoryGroup",
    "to_jagged",
    "to_padded",
]
