"""verl's gathered weights as a policy version of the bus: an HF folder, then
``PolicyVersionPublished`` through the trainer's fenced control writer. Needs no verl (torch
and safetensors only); ``rolloutbus.verl.weights`` is the checkpoint-engine backend that
verl loads and that calls this.

* :class:`ShardWriter` writes ``(name, tensor)`` pairs as they come (verl's per-tensor
  generator) into safetensors shards of at most ``shard_bytes`` each, so rank 0 holds one
  shard at a time, never the whole model; a folder of several shards gets HF's
  ``model.safetensors.index.json``. The model's ``config.json``, generation config and
  tokenizer files are copied from verl's ``actor_rollout_ref.model.path``. The folder is
  written under a temporary name and renamed, so a replica never reads half of it.
* :class:`BusWeightPublisher` publishes ``policy_version = global_steps``. Its first publish
  fences every earlier trainer of these topics (``TrainerControlWriter``) and starts a run
  (``RunStarted`` and this version in one transaction), as ``rolloutbus train`` does at
  start; later ones publish in that run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rolloutbus.config import Config
from rolloutbus.kafka.control import TrainerControlWriter
from rolloutbus.schemas.control import PolicyVersionPublished

__all__ = [
    "MODEL_FILES",
    "BusWeightPublisher",
    "ShardWriter",
    "copy_model_files",
    "drain",
    "publish_folder",
    "temporary_folder",
    "write_folder",
]

log = logging.getLogger(__name__)
# what a replica or a reader of the folder needs besides the tensors (those present are copied)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
INDEX = "model.safetensors.index.json"


class ShardWriter:
    """Safetensors shards of at most ``shard_bytes`` (one tensor above it gets a shard of its
    own) in ``folder``; :meth:`close` names them as ``save_pretrained`` does."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.shard_bytes = folder, shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor {name!r} given twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        # a copy on the CPU: the gathered tensor may be on the GPU, and two names may share
        # storage (tied embeddings), which one safetensors file refuses
        self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self._pending_bytes += nbytes
        self.tensors += 1
        self.bytes += nbytes

    def _flush(self) -> None:
        path = self.folder / f"part-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            self._shards[0][0].rename(self.folder / "model.safetensors")
            return
        total, weight_map = len(self._shards), {}
        for i, (path, names) in enumerate(self._shards, start=1):
            final = f"model-{i:05d}-of-{total:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.bytes}, "weight_map": weight_map}
        (self.folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


async def drain(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    """The pairs of a generator or an async generator (verl's engines give either)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def copy_model_files(model_path: str | None, folder: Path) -> list[str]:
    """The model's config and tokenizer files that ``model_path`` holds, copied into
    ``folder``; returns their names."""
    if not model_path:
        return []
    source = Path(model_path)
    copied = [name for name in MODEL_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    if "config.json" not in copied:
        log.warning("%s has no config.json: the weights folder has none either", source)
    return copied


def temporary_folder(folder: Path) -> Path:
    """An empty folder beside ``folder`` to write it in."""
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish_folder(tmp: Path, folder: Path) -> Path:
    """Rename the written ``tmp`` to ``folder``. The same step again (verl's ``on_init_end``
    after a restart re-sends the restored step) replaces the folder of that step."""
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(folder)
    return folder


def write_folder(
    weights: Any, folder: Path, *, model_path: str | None = None, shard_bytes: int = 2 << 30
) -> Path:
    """``(name, tensor)`` pairs from ``weights`` (an iterable) as an HF folder at ``folder``."""
    tmp = temporary_folder(folder)
    shards = ShardWriter(tmp, shard_bytes)
    for name, tensor in weights:
        shards.add(name, tensor)
    shards.close()
    copy_model_files(model_path, tmp)
    return publish_folder(tmp, folder)


class BusWeightPublisher:
    """Publishes verl's steps as policy versions; see the module docstring."""

    def __init__(self, cfg: Config, *, run_id: str = "", trainer_id: str = ""):
        self.cfg = cfg
        self.run_id = run_id or uuid.uuid4().hex
        self.trainer_id = trainer_id
        self._writer: TrainerControlWriter | None = None

    def publish(self, global_steps: int, folder: Path) -> PolicyVersionPublished:
        """``policy_version = global_steps`` with the weights in ``folder``; the first call
        fences earlier trainers and starts the run. Returns the version as written."""
        event = PolicyVersionPublished(
            policy_version=global_steps,
            weights_path=str(folder.resolve()),
            global_step=global_steps,
            trainer_id=self.trainer_id,
            model_name=self.cfg.model.name,
        )
        if self._writer is None:
            self._writer = TrainerControlWriter(self.cfg)  # fences earlier trainers first
            written = self._writer.start_run(self.run_id, event, trainer_id=self.trainer_id)
            log.info("run %s started at policy version %d", self.run_id, global_steps)
            return written
        self._writer.publish(event)
        assert self._writer.run is not None
        run = self._writer.run
        return event.model_copy(update={"run_id": run.run_id, "run_epoch": run.run_epoch})

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
