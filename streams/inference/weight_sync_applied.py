"""``PolicyVersionApplied``: the weight sync says on ``rollout.control`` when the current
version serves on every replica.

A version counts as served everywhere when every replica in ``replicas.urls`` was moved to
it (a replica that is down holds the announcement back until it is back and synced: an
on-policy trainer must not sample from a replica that may still serve the old weights).
It is announced once per version and folder; a restarted weight sync announces the current
version again when it has applied it, and the record's key (``policy_version_applied@epoch``)
keeps only the newest per run on the compacted topic. The record is written idempotently,
not fenced: the weight sync is no trainer.

The weight sync's role must be allowed to write the control topic. Where ACLs refuse it
(``rolloutbus broker acls`` grants ``weight_sync`` only a read of it today), the announcer
logs the refusal once and stops announcing; the weight sync itself goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import bare_kafka_exceptions, broker_error, idempotent_producer
from rolloutbus.schemas.control import (
    PolicyVersionApplied,
    PolicyVersionPublished,
    encode_control_event,
)
from rolloutbus.topics import CONTROL_PARTITION, Topics, control_key

__all__ = ["AppliedAnnouncer", "served_everywhere"]

log = logging.getLogger(__name__)
DELIVERY_TIMEOUT_S = 30.0  # seconds to wait for the broker to acknowledge the record
REFUSED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


def served_everywhere(
    current: PolicyVersionPublished | None, applied: Iterable[int | None]
) -> bool:
    """Whether every replica (its last applied version in ``applied``) serves ``current``."""
    versions = list(applied)
    if current is None or not versions:
        return False
    return all(v == current.policy_version for v in versions)


class AppliedAnnouncer:
    """Writes ``PolicyVersionApplied`` once per version and folder (see the module docstring)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.topic = Topics.from_config(cfg.kafka).control
        self._producer: Any = None  # opened at the first announcement
        self._last: tuple[int, int, str | None] | None = None
        self.refused = False  # the broker's ACLs refuse this role a write of the topic

    def announce_if_served(
        self, current: PolicyVersionPublished | None, applied: dict[str, int | None]
    ) -> PolicyVersionApplied | None:
        """The record written, if ``current`` now serves on every replica of ``applied``
        (url → version) and was not announced yet; else None."""
        if self.refused or current is None or not served_everywhere(current, applied.values()):
            return None
        key = (current.run_epoch, current.policy_version, current.weights_path)
        if key == self._last:
            return None
        event = PolicyVersionApplied(
            policy_version=current.policy_version,
            weights_path=current.weights_path,
            run_id=current.run_id,
            run_epoch=current.run_epoch,
            replicas=sorted(applied),
        )
        if not self._write(event):
            return None
        self._last = key
        log.info(
            "policy version %d serves on all %d replicas: announced",
            event.policy_version,
            len(applied),
        )
        return event

    def _write(self, event: PolicyVersionApplied) -> bool:
        """Whether the record was written (False: the ACLs refuse it)."""
        what = f"policy version {event.policy_version} applied (run epoch {event.run_epoch})"
        if self._producer is None:
            self._producer = idempotent_producer(self.cfg.kafka)
        delivered: list[Any] = []
        try:
            with bare_kafka_exceptions():
                self._producer.produce(
                    self.topic,
                    key=control_key(event.type, event.run_epoch or None),
                    value=encode_control_event(event),
                    partition=CONTROL_PARTITION,
                    on_delivery=lambda err, msg: delivered.append(err),
                )
                left = self._producer.flush(DELIVERY_TIMEOUT_S)
        except KafkaException as exc:
            if self._refused(exc.args[0] if exc.args else None):
                return False
            raise broker_error(exc, f"writing {what}", topic=self.topic) from exc
        if delivered and self._refused(delivered[0]):
            return False
        if left or not delivered:
            raise BrokerError(f"{what} not acknowledged by {self.topic} in {DELIVERY_TIMEOUT_S} s")
        if delivered[0] is not None:
            raise broker_error(delivered[0], f"writing {what}", topic=self.topic)
        return True

    def _refused(self, err: object) -> bool:
        if not isinstance(err, KafkaError) or err.code() not in REFUSED:
            return False
        log.error(
            "the broker refuses this weight sync a write of %s (%s): PolicyVersionApplied "
            "is not announced; grant the weight_sync role WRITE on it to announce versions",
            self.topic,
            err.str(),
        )
        self.refused = True
        return True

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(DELIVERY_TIMEOUT_S)
