"""What leaves: the trainer client (complete groups as Arrow batches) and tensor conversion.

Names load on first use: ``rolloutbus replay`` (``log_replay``) and the trainer client do
not pay for torch unless they convert to tensors.
"""

from __future__ import annotations

import typing

from rolloutbus.runtime import lazy_exports

if typing.TYPE_CHECKING:
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

_LAZY = {
    "PaddedBuffers": "rolloutbus.consumers.tensors",
    "TrainerClient": "rolloutbus.consumers.client",
    "TrainerPosition": "rolloutbus.consumers.position",
    "TrajectoryGroup": "rolloutbus.consumers.groups",
    "to_jagged": "rolloutbus.consumers.tensors",
    "to_padded": "rolloutbus.consumers.tensors",
}

__getattr__ = lazy_exports(__name__, _LAZY)
