"""Trainer checkpoints: weights, optimizer and the trajectory position, saved together.

Layout (verl's): ``{default_local_dir}/global_step_{n}/``

* ``actor/huggingface/`` — ``save_pretrained`` (config.json + model.safetensors): the
  folder a replica reloads (``/collective_rpc reload_weights``) and a policy version names;
* ``actor/optimizer.safetensors`` — AdamW's moment tensors (``{param}.{name}``);
* ``trainer_state.json`` — :class:`TrainerState`: global step, policy version, AdamW's
  scalar state and hyper-parameters, and the trainer client's position
  (``TrainerPosition``: per partition the resume offset and the groups yielded past it).

``global_step_0`` is the step-0 checkpoint a new run writes before its first step: the
initial weights (policy version 0's ``weights_path``), the run id, and where the trajectory
topic starts; so even the first step's groups are never committed ahead of a checkpoint.

``latest_checkpointed_iteration.txt`` (verl's name) holds the newest complete step. A step
folder is written under a temporary name and renamed, then the pointer file is replaced
(write + rename), so a trainer killed at any moment leaves the previous checkpoint whole and
the pointer never names a partial folder. Restarting from it resumes the trajectory topic
exactly where the saved weights stopped: the groups trained after it are trained again on
the restored weights, none is skipped and none is trained twice into the saved weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.errors import ConfigError

log = logging.getLogger(__name__)
LATEST = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"


class TrainerState(BaseModel):
    """What ``trainer_state.json`` holds besides the tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    global_step: int = Field(ge=0)
    policy_version: int = Field(ge=0)
    position: TrainerPosition | None = None  # None: before the first group
    groups_trained: int = 0
    trainer_id: str = ""
    model_name: str = ""
    # the training run these weights belong to (rollout.control's run_id): drawn when the
    # step-0 checkpoint is written, kept across restarts; "" in checkpoints older than runs
    run_id: str = ""
    # the step whose weights are ``policy_version`` (its folder is what the version's
    # weights_path names, and is never pruned while it is current); None: unknown (older)
    version_step: int | None = Field(default=None, ge=0)
    # the prompt topic's end offsets when the run started (RunStarted.prompt_offsets)
    prompt_offsets: dict[int, int] = Field(default_factory=dict)
    saved_at: float = Field(default_factory=time.time)
    # AdamW's state_dict without its tensors: param_groups (lr, betas, ...) and the step
    # count of each parameter
    optimizer: dict[str, Any] = Field(default_factory=dict)


def step_folder(root: Path, global_step: int) -> Path:
    return root / f"global_step_{global_step}"


def weights_folder(step_dir: Path) -> Path:
    """The HF folder inside a step folder: what a policy version's ``weights_path`` names."""
    return step_dir / "actor" / "huggingface"


def save_checkpoint(
    root: Path, lm: Any, optimizer: torch.optim.Optimizer, state: TrainerState, keep: int
) -> Path:
    """Write step ``state.global_step`` whole, point ``latest`` at it, prune old ones."""
    final = step_folder(root, state.global_step)
    tmp = root / f".tmp_global_step_{state.global_step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "actor").mkdir(parents=True)
    lm.save_pretrained(str(weights_folder(tmp)), safe_serialization=True)
    tensors, scalars = _split_optimizer_state(optimizer.state_dict())
    save_file(tensors, str(tmp / "actor" / "optimizer.safetensors"))
    with_optimizer = state.model_copy(update={"optimizer": scalars})
    (tmp / STATE_FILE).write_text(with_optimizer.model_dump_json(indent=1))
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a step re-trained after a restart
    tmp.rename(final)
    _write_atomically(root / LATEST, str(state.global_step))
    _prune(root, keep, state.global_step, state.version_step)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete step folder under ``root``, or None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{pointer} holds {text!r}, not a step number")
    folder = step_folder(root, int(text))
    if not (folder / STATE_FILE).is_file():
        raise ConfigError(f"{pointer} names step {text}, but {folder / STATE_FILE} is missing")
    return folder


def load_state(step_dir: Path) -> TrainerState:
    return TrainerState.model_validate_json((step_dir / STATE_FILE).read_text())


def load_optimizer(optimizer: torch.optim.Optimizer, step_dir: Path, state: TrainerState) -> None:
    """Restore AdamW's moments and step counts saved with ``state``."""
    tensors = load_file(str(step_dir / "actor" / "optimizer.safetensors"))
    optimizer.load_state_dict(_join_optimizer_state(tensors, state.optimizer))


def _split_optimizer_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (safetensors) apart from the JSON-able rest; never a pickle."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {"param_groups": sd["param_groups"], "state": {}}
    for param, entries in sd["state"].items():
        kept: dict[str, Any] = {}
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{param}.{name}"] = value.contiguous()
            else:
                kept[name] = value.item() if isinstance(value, torch.Tensor) else value
        scalars["state"][str(param)] = kept
    return tensors, scalars


def _join_optimizer_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for param, entries in scalars.get("state", {}).items():
        # AdamW keeps ``step`` as a float32 scalar tensor (capturable off): restore the type
        state[int(param)] = {
            k: torch.tensor(v, dtype=torch.float32) if k == "step" else v
            for k, v in entries.items()
        }
    for key, value in tensors.items():
        param, name = key.split(".", 1)
        state.setdefault(int(param), {})[name] = value
    # JSON has no tuples: AdamW's betas come back as a list
    groups = [
        {**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in scalars["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fsync_tree(folder: Path) -> None:
    """Flush the files before the rename makes the folder visible: a crash after the rename
    must not leave a named checkpoint with empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def _prune(root: Path, keep: int, newest: int, current_version: int | None) -> None:
    """Delete the step folders older than the newest ``keep`` up to ``newest``, but never
    ``current_version``'s: the folder the current policy version names (a replica that
    restarts, or the trainer's next start, loads it again)."""
    steps = sorted(
        int(p.name.removeprefix("global_step_"))
        for p in root.glob("global_step_*")
        if p.name.removeprefix("global_step_").isdigit()
    )
    older = [step for step in steps if step <= newest]
    for step in older[: max(0, len(older) - keep)]:
        if step == current_version:
            continue
        shutil.rmtree(step_folder(root, step), ignore_errors=True)
        log.debug("deleted checkpoint step %d (keeping the newest %d)", step, keep)
