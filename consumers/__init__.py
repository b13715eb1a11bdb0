"""What leaves: the trainer client (complete groups as Arrow batches) and tensor conversion."""

from rolloutbus.consumers.tensors import PaddedBuffers, to_jagged, to_padded
from rolloutbus.consumers.trainer import TrainerClient, TrajectoryGroup

__all__ = ["PaddedBuffers", "TrainerClient", "TrajectoryGroup", "to_jagged", "to_padded"]
