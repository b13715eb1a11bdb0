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

The run id and position come from ``trainer.rolloutbus_source``, else from
``trainer.replay_buffer.rolloutbus_source``, which the bus sampler
(``rolloutbus.verl.sampler``) sets (``BusPositionSource``: its ``TrainerClient`` with the
run id). Without a source the hook raises, and verl aborts the run, since a checkpoint
without the bus's position cannot be resumed exactly once.
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
from rolloutbus.verl.extra import require_verl

__all__ = [
    "SOURCE_ATTRIBUTE",
    "STATE_FILE",
    "BusCheckpointCallback",
    "BusCheckpointState",
    "BusPositionSource",
    "read_bus_state",
    "resume_folder",
    "resume_state",
    "write_bus_state",
]

log = logging.getLogger(__name__)

STATE_FILE = "rolloutbus.json"
SOURCE_ATTRIBUTE = "rolloutbus_source"  # set by the bus sampler (verl's trainer.replay_buffer)


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


def resume_folder(config: Any) -> Path | None:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumes from for ``config``
    (verl's whole trainer config), or None when it starts from scratch."""
    from omegaconf import OmegaConf

    mode = OmegaConf.select(config, "trainer.resume_mode", default="disable")
    if mode == "disable":
        return None
    if mode == "auto":
        local_dir = OmegaConf.select(config, "trainer.default_local_dir", default=None)
        if local_dir is None:
            return None
        checkpoints = require_verl("verl.utils.checkpoint.checkpoint_manager", what="resuming")
        found = checkpoints.find_latest_ckpt_path(os.path.abspath(local_dir))
        return Path(found) if found else None
    if mode == "resume_path":
        return Path(os.path.abspath(str(OmegaConf.select(config, "trainer.resume_from_path"))))
    raise RolloutBusError(f"trainer.resume_mode {mode!r} is not one verl 0.9.1 knows")


def resume_state(config: Any) -> BusCheckpointState | None:
    """The bus state saved in the folder verl resumes from, or None when verl starts from
    scratch. A folder without ``rolloutbus.json`` raises: it was saved without the bus's
    callback, and where to re-read the trajectory topic is unknown."""
    folder = resume_folder(config)
    if folder is None:
        return None
    state = read_bus_state(folder)
    if state is None:
        raise RolloutBusError(
            f"verl resumes from {folder}, which has no {STATE_FILE}: it was saved without "
            "trainer.checkpoint_callback_class=rolloutbus.verl.BusCheckpointCallback"
        )
    step = int(folder.name.split("global_step_")[-1])  # as _load_checkpoint reads it
    if state.global_step != step:
        raise RolloutBusError(
            f"{folder / STATE_FILE} is for step {state.global_step}, not {step}: "
            "it was copied from another checkpoint"
        )
    return state


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
        source: BusPositionSource | None = getattr(trainer, SOURCE_ATTRIBUTE, None) or getattr(
            getattr(trainer, "replay_buffer", None), SOURCE_ATTRIBUTE, None
        )
        if source is None:
            raise RolloutBusError(
                f"checkpoint {checkpoint_dir}: neither the trainer nor its replay_buffer has "
                f"{SOURCE_ATTRIBUTE!r} (rolloutbus.verl.sampler's samplers set it), so the "
                "bus's position cannot be saved with it"
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
