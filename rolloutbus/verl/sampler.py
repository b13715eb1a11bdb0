"""verl 0.9.1's V1 replay buffer on the bus: ``trainer.v1.sampler.custom_sampler``.

    trainer.v1.sampler.custom_sampler.path=pkg://rolloutbus.verl.sampler
    trainer.v1.sampler.custom_sampler.name=BusReplayBuffer        # trainer_mode=sync
                                           BusReplayBufferAsync   # separate_async

``BusReplayBuffer`` and ``BusReplayBufferAsync`` are verl's own ``ReplayBuffer`` and
``ReplayBufferAsync`` with one change: each poll of TransferQueue
(``_sync_metadata_from_transfer_queue``, a private method, hence the verl pin) first drains
the trajectory topic into TransferQueue (``rolloutbus.verl.tq_writer``). verl's sampling,
staleness and failure-refill logic then run unchanged. verl hands a custom sampler no DAPO
filter (``filter_groups_metric``, ``trainer_base.py:163``), so DAPO filtering is off here.

The bus config comes from ``sampler_kwargs.rolloutbus.config`` (a path or a list), else
``ROLLOUTBUS_CONFIG`` (``rolloutbus.verl.settings``); ``sampler_kwargs.rolloutbus.run_id``
names the run whose id ``rolloutbus.json`` records. The sampler exposes its trainer client
as ``rolloutbus_source``, which ``BusCheckpointCallback`` reads through verl's
``trainer.replay_buffer``.

**Resume.** verl builds the sampler (``_build_replay_buffer``) with ``sampler_kwargs``, a node
of its whole config, just before ``_load_checkpoint``. The sampler reads from that config the
folder verl resumes from (``rolloutbus.verl.checkpoint.resume_state``) and starts its trainer
client at the position that folder's ``rolloutbus.json`` saved, whatever the consumer group
has committed (``resumed_from``). verl's TransferQueue registry, restored from the same
folder, then gates each re-read group. ``sampler_kwargs`` given as a plain mapping has no
such config: the client starts from the group's commits.

The classes subclass verl's, so they are built on first access: importing this module
needs no verl.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.verl.checkpoint import BusCheckpointState, resume_state
from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.settings import bus_config
from rolloutbus.verl.tq_writer import DrainReport, TransferQueueWriter

# also BusReplayBuffer and BusReplayBufferAsync, built on first access (__getattr__ below)
__all__ = ["BusPosition", "bus_sampler_class"]

log = logging.getLogger(__name__)

DRAIN_IDLE_S = 0.5  # one drain ends once no group has arrived for this long


class BusPosition:
    """What ``BusCheckpointCallback`` reads: the run id and the trainer client's position."""

    def __init__(self, client: TrainerClient, run_id: str):
        self.client = client
        self.run_id = run_id

    def position(self) -> TrainerPosition:
        return self.client.position()

    def commit_position(self, position: TrainerPosition) -> None:
        self.client.commit_position(position)


def _saved_state(sampler_kwargs: Any) -> BusCheckpointState | None:
    """The bus state of the folder verl resumes from, read from the whole config that
    ``sampler_kwargs`` (verl's ``trainer.v1.sampler.sampler_kwargs`` node) belongs to."""
    if not isinstance(sampler_kwargs, DictConfig):
        return None
    root = sampler_kwargs._get_root()  # OmegaConf keeps each node's parent: verl's config
    if OmegaConf.select(root, "trainer.resume_mode", default=None) is None:
        return None  # not inside verl's trainer config
    return resume_state(root)


def _bus_mixin(base: type) -> type:
    class BusSampler(base):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            given = kwargs.get("sampler_kwargs") or {}
            options = OmegaConf.create(dict(given))
            bus = bus_config(options)
            self.resumed_from = _saved_state(given)
            if self.resumed_from is not None:
                log.info(
                    "verl resumes from step %d: reading the trajectory topic from %s",
                    self.resumed_from.global_step,
                    self.resumed_from.position.model_dump_json(),
                )
            self.bus_client = TrainerClient(
                bus.kafka,
                bus.trainer.group_id,
                config=bus.trainer,
                commit_on_revoke=False,
                resume_from=self.resumed_from.position if self.resumed_from else None,
            )
            tq = require_verl("transfer_queue", what="the bus sampler")
            self.bus_writer = TransferQueueWriter(self.bus_client, tq)
            run_id = OmegaConf.select(options, "rolloutbus.run_id", default="") or ""
            self.rolloutbus_source = BusPosition(self.bus_client, str(run_id))
            self.drained = DrainReport()  # every drain so far

        def drain_bus(self) -> DrainReport:
            report = self.bus_writer.drain(idle_s=DRAIN_IDLE_S)
            self.drained.extend(report)
            return report

        def _sync_metadata_from_transfer_queue(self) -> None:
            self.drain_bus()
            super()._sync_metadata_from_transfer_queue()

        def close(self) -> None:
            self.bus_client.close()

    return BusSampler


def bus_sampler_class(asynchronous: bool) -> type:
    """verl's ``ReplayBuffer`` (or ``ReplayBufferAsync``) fed from the bus."""
    module = require_verl("verl.trainer.ppo.v1.replay_buffer", what="the bus sampler")
    base = module.ReplayBufferAsync if asynchronous else module.ReplayBuffer
    cls = _bus_mixin(base)
    cls.__name__ = cls.__qualname__ = "BusReplayBuffer" + ("Async" if asynchronous else "")
    cls.__module__ = __name__
    return cls


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    if name not in ("BusReplayBuffer", "BusReplayBufferAsync"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        _BUILT[name] = bus_sampler_class(asynchronous=name.endswith("Async"))
    return _BUILT[name]
