"""``BusCheckpointCallback``: verl's ``trainer.checkpoint_callback_class``, writing the bus's
state beside verl's checkpoint.

verl 0.9.1's V1 trainer builds the class named by ``trainer.checkpoint_callback_class``
with ``cls(config=config)`` and calls ``on_save(trainer=, global_step=, checkpoint_dir=,
async_save=)`` on the driver after each save (``verl/trainer/ppo/checkpoint_callback.py``;
called from ``trainer_base.py:1014,1027``). verl's V0 ``RayPPOTrainer`` never calls it.

On each save it does two things, in this order:

1. It writes ``{checkpoint_dir}/rolloutbus.json``: the bus run id, the step, and the
   consumer position on the trajectory topic (``BusCheckpointState``). The file is written
   under a temporary name and then renamed.
2. It commits that position to the consumer group, only for a synchronous save. An
   ``async_save`` checkpoint may not be durable yet when verl calls the hook, so committing
   then could run ahead of it.

A crash between the two steps leaves the group's committed offsets older than the file.
That only means more re-reading on restart.

The run id and position come from the object verl's trainer holds as
``trainer.rolloutbus_source`` (``BusPositionSource``: a ``TrainerClient`` with its run id).
The bus sampler is meant to set it, and that sampler is not built yet
(docs/verl-trainer.md). Without a source the hook raises, and verl aborts the run, since a
checkpoint without the bus's position cannot be resumed exactly once.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.errors import RolloutBusError

__all__ = [
    "SOURCE_ATTRIBUTE",
    "STATE_FILE",
    "BusCheckpointCallback",
    "BusCheckpointState",
    "BusPositionSource",
    "read_bus_state",
    "write_bus_state",
]

log = logging.getLogger(__name__)

STATE_FILE = "rolloutbus.json"
SOURCE_ATTRIBUTE = "rolloutbus_source"  # the attribute of verl's trainer the bus sampler sets


class BusPositionSource(Protocol):
    """What the callback reads at save time: the run's id and the trainer client's position."""

    run_id: str

    def position(self) -> TrainerPosition: ...

    def commit_position(self, position: TrainerPosition) -> None: ...


class BusCheckpointState(BaseModel):
    """What ``rolloutbus.json`` holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str  # rollout.control's run these groups belong to
    global_step: int = Field(ge=0)  # verl's step that was checkpointed
    position: TrainerPosition  # where re-reading the trajectory topic starts
    committed: bool  # whether the position was committed to the consumer group
    saved_at: float = Field(default_factory=time.time)  # seconds since the epoch


def write_bus_state(checkpoint_dir: str | os.PathLike[str], state: BusCheckpointState) -> Path:
    """Write ``rolloutbus.json`` in ``checkpoint_dir`` (a temporary name, then a rename)."""
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / STATE_FILE
    partial = folder / f".{STATE_FILE}.partial"
    partial.write_text(state.model_dump_json(indent=2))
    partial.replace(path)
    return path


def read_bus_state(checkpoint_dir: str | os.PathLike[str]) -> BusCheckpointState | None:
    """The bus's state saved beside verl's checkpoint; None when the folder has none."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.exists():
        return None
    return BusCheckpointState.model_validate_json(path.read_text())


class BusCheckpointCallback:
    """verl's checkpoint callback for the bus (see the module docstring)."""

    def __init__(self, config: Any = None):
        self.config = config

    def on_save(
        self,
        trainer: Any,
        global_step: int,
        checkpoint_dir: str,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        source: BusPositionSource | None = getattr(trainer, SOURCE_ATTRIBUTE, None)
        if source is None:
            raise RolloutBusError(
                f"checkpoint {checkpoint_dir}: the trainer has no {SOURCE_ATTRIBUTE!r} (the bus "
                "sampler sets it; it is not built yet, docs/verl-trainer.md), so the bus's "
                "position cannot be saved with it"
            )
        position = source.position()
        state = BusCheckpointState(
            run_id=source.run_id,
            global_step=global_step,
            position=position,
            committed=not async_save,
        )
        path = write_bus_state(checkpoint_dir, state)
        if async_save:
            log.info("wrote %s; not committed: verl's async save may not be durable yet", path)
            return
        source.commit_position(position)
        log.info("wrote %s and committed the position (step %d)", path, global_step)
