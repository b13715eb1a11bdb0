"""Wait until the replicas serve a policy version: the reader of ``PolicyVersionApplied``,
which ``rolloutbus weight-sync`` writes once every replica serves a version.

On-policy modes (verl's ``sync``, or a ``separate_async`` run that wants no lag) call
:func:`wait_for_applied` after publishing ``global_steps``, before they sample again;
asynchronous modes do not wait (the trajectories' ``min_global_steps`` /
``max_global_steps`` say which version sampled each token either way).
"""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from rolloutbus.config import Config
from rolloutbus.errors import RolloutBusError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    poll_record,
    read_committed_consumer,
    translate_kafka_errors,
)
from rolloutbus.kafka.control_reader import fold_record
from rolloutbus.kafka.version_ledger import VersionLedger
from rolloutbus.schemas.control import PolicyVersionApplied, decode_control_event
from rolloutbus.topics import CONTROL_PARTITION, Topics

__all__ = ["WeightsNotAppliedError", "applied_version", "wait_for_applied"]

APPLIED_READER_GROUP = "rolloutbus-applied-reader"  # never commits: librdkafka wants an id
POLL_S = 0.5  # seconds one poll waits: how late a deadline may be noticed


class WeightsNotAppliedError(RolloutBusError, TimeoutError):
    """No ``PolicyVersionApplied`` for the version came within the wait."""


def applied_version(
    ledger: VersionLedger, event: PolicyVersionApplied, policy_version: int, run_id: str
) -> bool:
    """Whether ``event`` says ``policy_version`` (or a later one) serves everywhere in the
    run ``run_id`` (any run: the newest run ``ledger`` has read so far)."""
    if run_id:
        if event.run_id != run_id:
            return False
    elif event.run_epoch != ledger.run_epoch:
        return False
    return event.policy_version >= policy_version


def wait_for_applied(
    cfg: Config, policy_version: int, *, run_id: str = "", timeout_s: float = 600.0
) -> PolicyVersionApplied:
    """The first ``PolicyVersionApplied`` of ``policy_version`` or later (of ``run_id``, else
    of the newest run) on the control topic, read from its start; raises
    :class:`WeightsNotAppliedError` after ``timeout_s`` seconds."""
    topic = Topics.from_config(cfg.kafka).control
    consumer = read_committed_consumer(cfg.kafka, APPLIED_READER_GROUP, partition_eof=True)
    ledger = VersionLedger()
    deadline = time.monotonic() + timeout_s
    try:
        with translate_kafka_errors("assigning", topic=topic, partition=CONTROL_PARTITION):
            consumer.assign([TopicPartition(topic, CONTROL_PARTITION, OFFSET_BEGINNING)])
        while time.monotonic() < deadline:
            msg = poll_record(consumer, POLL_S)
            if msg is None or isinstance(msg, PartitionEnd):
                continue
            fold_record(ledger, msg)  # follows RunStarted: which run is the newest
            event = _applied(msg.value() or b"")
            if event is not None and applied_version(ledger, event, policy_version, run_id):
                return event
    finally:
        consumer.close()
    raise WeightsNotAppliedError(
        f"no replica fleet reported policy version {policy_version} applied on {topic} "
        f"within {timeout_s:g} s (is `rolloutbus weight-sync` running, every replica up?)"
    )


def _applied(value: bytes) -> PolicyVersionApplied | None:
    try:
        event = decode_control_event(value)
    except (ValueError, RolloutBusError):  # refused and counted by fold_record already
        return None
    return event if isinstance(event, PolicyVersionApplied) else None
