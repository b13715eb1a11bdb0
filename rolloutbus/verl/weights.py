"""The ``rolloutbus`` checkpoint-engine backend: verl's new weights reach the replicas through
the bus's weight sync (docs/verl-trainer.md, "Weights").

verl 0.9.1 imports ``rollout.checkpoint_engine.custom_backend_module`` in every actor
worker, in each ``CheckpointEngineWorker`` and in the manager, then builds the backend with
``CheckpointEngineRegistry.new(backend, is_master=(rank == 0), bucket_size=, **engine_kwargs)``
(``verl/workers/engine_workers.py:679-688``; ``verl/checkpoint_engine/base.py:320-330``
without ``is_master``). Importing this module registers ``rolloutbus``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=rolloutbus
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=rolloutbus.verl.weights
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rolloutbus.model_path=...

``engine_kwargs.rolloutbus`` (all optional): ``config`` (the bus config file or files; else
``ROLLOUTBUS_CONFIG``), ``weights_root`` (where version folders go; else
``{trainer.default_local_dir of the bus config}/rolloutbus_weights``; the replicas must read
the same path), ``model_path`` (verl's ``actor_rollout_ref.model.path``: its config and
tokenizer files are copied into each folder), ``run_id`` (the bus run; use the sampler's
``sampler_kwargs.rolloutbus.run_id``; else a fresh one), ``trainer_id``, and
``wait_applied_s`` (the rollout side: how long ``receive_weights`` waits for
``PolicyVersionApplied``; 0, the default, does not wait).

``send_weights(weights, global_steps)`` (``CheckpointEngineManager.update_weights``, which
verl calls at ``on_init_end`` with the restored step and at each ``on_step_end``): every
rank drains ``weights``, since FSDP's full-tensor gather behind it is collective; rank 0
writes ``{weights_root}/global_step_{global_steps}/`` and publishes it as policy version
``global_steps`` (``rolloutbus.verl.weights_publish``). The first publish of the process
fences earlier trainers and starts a run. Nothing travels to the rollout side:
``prepare``, the topology and ``finalize`` are empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from rolloutbus.config import Config, load_config
from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.settings import config_paths
from rolloutbus.verl.weights_publish import (
    BusWeightPublisher,
    ShardWriter,
    copy_model_files,
    drain,
    publish_folder,
    temporary_folder,
)

__all__ = ["BACKEND", "BusCheckpointEngine", "bus_engine_config"]

log = logging.getLogger(__name__)
BACKEND = "rolloutbus"
require_verl("verl.checkpoint_engine.base", what="the rolloutbus checkpoint engine")

# verl is not in the checked environment (the side env has it): no types to find
from verl.checkpoint_engine.base import (  # type: ignore[import-not-found]  # noqa: E402
    CheckpointEngine,
    CheckpointEngineRegistry,
)


def bus_engine_config(options: Mapping[str, Any]) -> Config:
    """The bus config named by ``engine_kwargs.rolloutbus.config``, else the environment's."""
    named = options.get("config")
    tree = {"rolloutbus": {"config": named}} if named else {}
    return load_config(config_paths(tree) or None)


@CheckpointEngineRegistry.register(BACKEND)
class BusCheckpointEngine(CheckpointEngine):
    """See the module docstring. Cheap to build: rank 0 reads the bus config and opens the
    control writer at its first ``send_weights``; other ranks never do."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any):
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.options = dict(engine_kwargs)  # verl passes engine_kwargs.rolloutbus
        self._publisher: BusWeightPublisher | None = None
        self._weights_root: Path | None = None

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        step = int(global_steps or 0)
        if not self.is_master:
            async for _ in drain(weights):  # the gather is collective: every rank takes part
                pass
            return {}
        started = time.monotonic()
        publisher, root = self._open()
        folder = root / f"global_step_{step}"
        tmp = temporary_folder(folder)
        shards = ShardWriter(tmp, self.bucket_size)
        async for name, tensor in drain(weights):
            shards.add(name, tensor)
        shards.close()
        copy_model_files(self.options.get("model_path"), tmp)
        publish_folder(tmp, folder)
        event = await asyncio.to_thread(publisher.publish, step, folder)
        seconds = time.monotonic() - started
        log.info(
            "policy version %d: %d tensors (%.1f MB) in %s, published in run %s (%.2f s)",
            step,
            shards.tensors,
            shards.bytes / 1e6,
            folder,
            event.run_id,
            seconds,
        )
        return {"rolloutbus/weights_publish_s": seconds}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:
        """Nothing travels here: the replicas load the folder themselves. With
        ``wait_applied_s`` this waits until ``rolloutbus weight-sync`` says every replica
        serves ``global_steps`` (on-policy modes)."""
        wait_s = float(self.options.get("wait_applied_s", 0) or 0)
        if wait_s > 0 and global_steps is not None:
            from rolloutbus.verl.applied import wait_for_applied

            cfg = bus_engine_config(self.options)
            await asyncio.to_thread(wait_for_applied, cfg, int(global_steps), timeout_s=wait_s)
        nothing: tuple[tuple[str, Any], ...] = ()
        for item in nothing:
            yield item

    def _open(self) -> tuple[BusWeightPublisher, Path]:
        if self._publisher is None or self._weights_root is None:
            cfg = bus_engine_config(self.options)
            root = self.options.get("weights_root")
            default = Path(cfg.trainer.default_local_dir) / "rolloutbus_weights"
            self._weights_root = Path(root) if root else default
            self._weights_root.mkdir(parents=True, exist_ok=True)
            self._publisher = BusWeightPublisher(
                cfg,
                run_id=str(self.options.get("run_id") or ""),
                trainer_id=str(self.options.get("trainer_id") or ""),
            )
        return self._publisher, self._weights_root


# the GPU-less replica and its server adapter (rollout.name=rolloutbus), registered with the
# backend: verl imports custom_backend_module in each CheckpointEngineWorker before it looks
# up the server adapter
import rolloutbus.verl.replica  # noqa: E402, F401
