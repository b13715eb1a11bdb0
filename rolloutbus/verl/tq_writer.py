"""Complete groups from the trajectory topic into TransferQueue, as verl's ``AgentLoopWorkerTQ``
leaves them (layout: ``rolloutbus.verl.tq_layout``).

TransferQueue's prompt registry is the gate: a group is written only when its uid is a
prompt that TransferQueue holds as ``pending`` or ``running`` in the group's partition
(``train``, or ``val`` for a validation group). Anything else is dropped and counted
(``rolloutbus_verl_sampler_dropped_groups_total``): a re-read after a restart finds its
prompt ``finished`` (or already cleared by the sampler), a stray or an older run's group
finds no prompt. So a group reaches the trainer once however often the topic is re-read;
offsets only say where re-reading starts.

The successful outputs are written first, then the prompt's tag: ``finished``, or
``failure`` when any session failed (verl writes no output for a failed session and keeps
its siblings).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry

from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.schemas.trajectories import Trajectory, batch_to_trajectories
from rolloutbus.verl.extra import require_verl
from rolloutbus.verl.tq_layout import is_failed, output_fields, output_key, output_tag
from rolloutbus.verl.tq_metrics import BusSamplerMetrics

__all__ = ["DrainReport", "TransferQueueWriter", "WAITING_STATUSES"]

log = logging.getLogger(__name__)

WAITING_STATUSES = frozenset({"pending", "running"})  # prompts TransferQueue waits for


@dataclass
class DrainReport:
    """What drains did: (uid, prompt status) written and (uid, reason) dropped, in order."""

    written: list[tuple[str, str]] = field(default_factory=list)  # status: finished | failure
    dropped: list[tuple[str, str]] = field(default_factory=list)  # not_requested | settled

    def extend(self, other: DrainReport) -> None:
        self.written.extend(other.written)
        self.dropped.extend(other.dropped)


class TransferQueueWriter:
    """Writes groups from ``client`` (a ``TrainerClient``) through ``tq`` (the
    ``transfer_queue`` module, initialized by verl's task runner)."""

    def __init__(self, client: Any, tq: ModuleType, registry: CollectorRegistry | None = None):
        self.client = client
        self.tq = tq
        self.metrics = BusSamplerMetrics(registry)

    def drain(self, *, idle_s: float = 0.5, max_groups: int | None = None) -> DrainReport:
        """Write every complete group that arrives until none has for ``idle_s``."""
        report = DrainReport()
        prompts = self.tq.kv_list() or {}
        for group in self.client.groups(timeout_s=idle_s, max_groups=max_groups):
            self._take(group, prompts, report)
        return report

    def _take(
        self, group: TrajectoryGroup, prompts: dict[str, dict[str, Any]], report: DrainReport
    ) -> None:
        members = batch_to_trajectories(group.batch)
        partition = "val" if members[0].validate_ else "train"
        tag = prompts.get(partition, {}).get(group.uid)
        if tag is None or not tag.get("is_prompt", False):
            self._drop(group.uid, partition, "not_requested", report)
            return
        if tag.get("status") not in WAITING_STATUSES:
            self._drop(group.uid, partition, "settled", report)
            return
        status = self.write_group(members, partition, global_steps=int(tag["global_steps"]))
        tag["status"] = status  # a second copy later in this drain is a re-read
        report.written.append((group.uid, status))
        self.metrics.written_groups.labels(status).inc()

    def write_group(self, members: list[Trajectory], partition: str, *, global_steps: int) -> str:
        """Put the group's successful outputs, then tag its prompt; the status it got."""
        uid = members[0].uid
        kept = [t for t in members if not is_failed(t)]
        if kept:
            tensordict_utils = require_verl("verl.utils.tensordict_utils", what="the bus sampler")
            self.tq.kv_batch_put(
                keys=[output_key(t) for t in kept],
                partition_id=partition,
                fields=tensordict_utils.list_of_dict_to_tensordict(
                    [output_fields(t, global_steps=global_steps) for t in kept]
                ),
                tags=[output_tag(t, global_steps=global_steps) for t in kept],
            )
        status = "finished" if len(kept) == len(members) else "failure"
        self.tq.kv_put(key=uid, partition_id=partition, tag={"status": status})
        return status

    def _drop(self, uid: str, partition: str, reason: str, report: DrainReport) -> None:
        log.info("dropped group %s: %s in TransferQueue partition %r", uid, reason, partition)
        report.dropped.append((uid, reason))
        self.metrics.dropped_groups.labels(reason).inc()
