"""One start of ``rolloutbus train`` on the bus: checkpoints, versions and commits, in the
order that puts every group into the saved weights exactly once.

1. **Fence.** A :class:`~rolloutbus.kafka.control.TrainerControlWriter` (the trainer role's
   fixed transactional id) fences every earlier trainer of these topics before anything
   else: a zombie can no longer publish a version.
2. **Step 0.** A new run (no checkpoint) writes its step-0 checkpoint before its first step:
   the initial weights, a fresh ``run_id``, where the trajectory topic starts
   (:func:`~rolloutbus.consumers.position.start_position`: the consumer group's committed
   position, else the beginning) and the prompt topic's end offsets. A restart before the
   first step resumes from it, so nothing committed meanwhile can move the start.
3. **Announce.** ``RunStarted`` (run epoch = the newest on the topic + 1) and the current
   version (with the folder of its weights: ``global_step_0`` for version 0) in one
   transaction. Readers follow the newest run, so the weight sync loads this run's
   weights even into replicas that serve another run's.
4. **Save, publish, commit.** Every ``trigger_parameter_sync_step`` steps (and when stopped
   between two): the checkpoint (weights, optimizer, the client's position), then the
   version, then the consumer group's offsets at the saved position. Offsets are committed
   nowhere else, so they never run ahead of what a checkpoint holds; a kill anywhere
   resumes from the newest checkpoint and re-trains only the steps after it.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import torch

from rolloutbus.config import Config
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.position import end_offsets, start_position
from rolloutbus.consumers.training.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_state,
    save_checkpoint,
    step_folder,
    weights_folder,
)
from rolloutbus.kafka.control import TrainerControlWriter
from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.topics import Topics

__all__ = ["TrainerRun"]

log = logging.getLogger(__name__)


class TrainerRun:
    """The durable side of one trainer process: its state, checkpoints and control writes."""

    def __init__(self, cfg: Config, trainer_id: str):
        self.cfg = cfg
        self.root = Path(cfg.trainer.default_local_dir)
        self.checkpoint = latest_checkpoint(self.root)
        loaded = load_state(self.checkpoint) if self.checkpoint is not None else None
        self.state = (loaded or TrainerState(global_step=0, policy_version=0)).model_copy(
            update={"trainer_id": trainer_id, "model_name": cfg.model.name}
        )
        self.resumed = loaded is not None
        self._control: TrainerControlWriter | None = None

    def start(self, lm: Any, optimizer: torch.optim.Optimizer) -> PolicyVersionPublished:
        """Steps 1-3 of the module docstring; returns the version announced."""
        self._control = TrainerControlWriter(self.cfg)  # fences earlier trainers first
        if self.checkpoint is None:
            self._save_step_zero(lm, optimizer)
        elif not self.state.run_id:  # a checkpoint written before runs existed
            self.state = self.state.model_copy(update={"run_id": uuid.uuid4().hex})
        announced = self._control.start_run(
            self.state.run_id,
            self._version_event(self._version_weights()),
            trainer_id=self.state.trainer_id,
            prompt_offsets=self.state.prompt_offsets,
        )
        log.info(
            "%s run %s at step %d, policy version %d (%s)",
            "resuming" if self.resumed else "starting",
            self.state.run_id,
            self.state.global_step,
            announced.policy_version,
            announced.weights_path or "the replicas' initial weights",
        )
        return announced

    def save(
        self, lm: Any, optimizer: torch.optim.Optimizer, client: TrainerClient, *, publish: bool
    ) -> Path:
        """Step 4: save; with ``publish`` (a sync step) publish the state's version with
        these weights; then commit the saved position."""
        if publish:
            self.state = self.state.model_copy(update={"version_step": self.state.global_step})
        folder = self._write(lm, optimizer)
        if publish:
            event = self._version_event(str(weights_folder(folder).resolve()))
            offset = self._writer().publish(event)
            log.info(
                "published policy version %d (step %d) at offset %d: %s",
                event.policy_version,
                event.global_step,
                offset,
                event.weights_path,
            )
        if self.state.position is not None:
            client.commit_position(self.state.position)
        return folder

    def close(self) -> None:
        if self._control is not None:
            self._control.close()

    def _save_step_zero(self, lm: Any, optimizer: torch.optim.Optimizer) -> None:
        kafka = self.cfg.kafka
        self.state = self.state.model_copy(
            update={
                "run_id": uuid.uuid4().hex,
                "position": start_position(kafka, self.cfg.trainer.group_id),
                "prompt_offsets": end_offsets(kafka, Topics.from_config(kafka).prompts),
                "version_step": 0,
            }
        )
        folder = self._write(lm, optimizer)
        assert self.state.position is not None
        log.info(
            "new run %s: step-0 checkpoint %s, trajectories from %s",
            self.state.run_id,
            folder,
            self.state.position.offsets,
        )

    def _write(self, lm: Any, optimizer: torch.optim.Optimizer) -> Path:
        self.checkpoint = save_checkpoint(
            self.root, lm, optimizer, self.state, keep=self.cfg.trainer.max_checkpoints_to_keep
        )
        return self.checkpoint

    def _version_weights(self) -> str | None:
        """The folder of the current version's weights. A checkpoint older than this record
        names no step: the sync step's folder by verl's relation, if it is still there."""
        step = self.state.version_step
        if step is None:
            every = self.cfg.async_training.trigger_parameter_sync_step
            step = self.state.policy_version * every
        folder = weights_folder(step_folder(self.root, step))
        if folder.is_dir():
            return str(folder.resolve())
        if self.state.policy_version == 0:
            return None  # the replicas' initial weights: a relabel only
        assert self.checkpoint is not None
        log.warning(
            "the weights of policy version %d (step %d) are gone: announcing the newest "
            "checkpoint's (%s) under that version",
            self.state.policy_version,
            step,
            self.checkpoint,
        )
        return str(weights_folder(self.checkpoint).resolve())

    def _version_event(self, weights_path: str | None) -> PolicyVersionPublished:
        return PolicyVersionPublished(
            policy_version=self.state.policy_version,
            weights_path=weights_path,
            global_step=self.state.version_step or 0,
            trainer_id=self.state.trainer_id,
            model_name=self.cfg.model.name,
        )

    def _writer(self) -> TrainerControlWriter:
        if self._control is None:
            raise RuntimeError("TrainerRun.start must come before save")
        return self._control
