"""What leaves: the trainer client (complete groups as Arrow batches) and tensor conversion."""

from rolloutbus.consumers.tensors import to_jagged, to_padded
from rolloutbus.consumers.trainer import TrainerClient, TrajectoryGroup

__all__ = ["TrainerClient", "TrajectoryGroup", "to_jagged", "to_padded"]
