"""Write ``rollout.control``: the trainer's runs and policy versions.

:class:`TrainerControlWriter` is the trainer's writer. It is a transactional producer with
one fixed ``transactional.id`` for the trainer role on these topics
(:func:`trainer_transactional_id`), so each trainer that starts fences the one before it:
``init_transactions`` aborts the old writer's open transaction and refuses its later ones
(a zombie trainer cannot publish after a new one started). Then it reads the topic to its
end, takes ``run_epoch`` = the newest epoch + 1, and writes ``RunStarted`` together with
the version it starts from in one transaction: readers see the new run and its current
version at once, or neither.

:class:`PolicyVersionPublisher` writes events as given (idempotent, no fencing): for tests
and for trainers that label their own versions; readers still apply the run rules to them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError, TrainerFencedError
from rolloutbus.kafka.clients import (
    bare_kafka_exceptions,
    broker_error,
    idempotent_producer,
    kafka_error,
    record_position,
    transactional_producer,
    translate_kafka_errors,
)
from rolloutbus.kafka.control_reader import read_control_log
from rolloutbus.schemas.control import (
    PolicyVersionPublished,
    RunStarted,
    encode_control_event,
)
from rolloutbus.topics import CONTROL_PARTITION, Topics, control_key

__all__ = [
    "PolicyVersionPublisher",
    "TrainerControlWriter",
    "publish_policy_version",
    "trainer_transactional_id",
]

log = logging.getLogger(__name__)
DELIVERY_TIMEOUT_S = 30.0  # seconds to wait for the broker to acknowledge a version
# seconds for init_transactions: it waits until a fenced writer's open transaction is
# aborted, which takes up to the broker's transaction timeout after a crash
INIT_TIMEOUT_S = 120.0
FENCED = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)

ControlRecord = PolicyVersionPublished | RunStarted


def _kafka(cfg: Config | KafkaConfig) -> KafkaConfig:
    return cfg.kafka if isinstance(cfg, Config) else cfg


def _key(event: ControlRecord) -> str:
    return control_key(event.type, event.run_epoch if event.run_epoch else None)


def trainer_transactional_id(kafka: KafkaConfig) -> str:
    """The trainer role's one id on these topics: a new trainer fences the old."""
    return f"rolloutbus-trainer.{Topics.from_config(kafka).control}"


class TrainerControlWriter:
    """The fenced writer of one trainer process; see the module docstring.

    Construction fences every earlier trainer of these topics. :meth:`start_run` must come
    before :meth:`publish`. A write after a newer trainer started raises
    :class:`TrainerFencedError`.
    """

    def __init__(self, cfg: Config | KafkaConfig, *, transactional_id: str | None = None):
        self.kafka = _kafka(cfg)
        self.topic = Topics.from_config(self.kafka).control
        self.transactional_id = transactional_id or trainer_transactional_id(self.kafka)
        self._producer = transactional_producer(self.kafka, self.transactional_id)
        with translate_kafka_errors(
            f"fencing earlier trainers (init_transactions of {self.transactional_id!r})",
            topic=self.topic,
        ):
            self._producer.init_transactions(INIT_TIMEOUT_S)
        self.run: RunStarted | None = None

    def start_run(
        self,
        run_id: str,
        version: PolicyVersionPublished,
        *,
        trainer_id: str = "",
        prompt_offsets: Mapping[int, int] | None = None,
    ) -> PolicyVersionPublished:
        """Write ``RunStarted`` (the next run epoch) and ``version``, its current version,
        in one transaction; returns the version as written (with its run)."""
        # fenced first (in __init__), read second: no earlier writer can land after this
        newest = read_control_log(self.kafka).run_epoch
        self.run = RunStarted(
            run_id=run_id,
            run_epoch=newest + 1,
            trainer_id=trainer_id,
            prompt_offsets=dict(prompt_offsets or {}),
        )
        stamped = self._stamp(version)
        self._write([self.run, stamped], f"run epoch {self.run.run_epoch} of run {run_id!r}")
        log.info(
            "run %s started as run epoch %d at policy version %d",
            run_id,
            self.run.run_epoch,
            stamped.policy_version,
        )
        return stamped

    def publish(self, version: PolicyVersionPublished) -> int:
        """Write one version of this run; returns its offset on the control topic."""
        stamped = self._stamp(version)
        return self._write([stamped], f"policy version {stamped.policy_version}")[0]

    def _stamp(self, version: PolicyVersionPublished) -> PolicyVersionPublished:
        if self.run is None:
            raise BrokerError("TrainerControlWriter.start_run must come before publish")
        return version.model_copy(
            update={"run_id": self.run.run_id, "run_epoch": self.run.run_epoch}
        )

    def _write(self, events: list[ControlRecord], what: str) -> list[int]:
        """One transaction; the offsets of ``events``."""
        delivered: list[Any] = []
        try:
            with bare_kafka_exceptions():
                self._producer.begin_transaction()
                for event in events:
                    _produce(self._producer, self.topic, event, delivered)
                self._producer.commit_transaction(DELIVERY_TIMEOUT_S)
        except KafkaException as exc:
            raise self._failed(exc, what) from exc
        return [_offset(err, msg, f"writing {what}", self.topic) for err, msg in delivered]

    def _failed(self, exc: KafkaException, what: str) -> BrokerError:
        err = kafka_error(exc)
        if err is not None and _fenced(err):
            return TrainerFencedError(
                f"writing {what} to {self.topic}: another trainer started on these topics "
                f"(transactional id {self.transactional_id!r}) and fenced this one: "
                f"{err.str()} ({err.name()})"
            )
        if err is not None and err.txn_requires_abort():
            with translate_kafka_errors("aborting the control transaction", topic=self.topic):
                self._producer.abort_transaction(DELIVERY_TIMEOUT_S)
        return broker_error(exc, f"writing {what}", topic=self.topic)

    def close(self) -> None:
        """Deliver what is queued. A fenced writer closes quietly: its producer is in a fatal
        state that ``flush`` raises again, and the fence was reported where it happened."""
        try:
            with bare_kafka_exceptions():
                self._producer.flush(DELIVERY_TIMEOUT_S)
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is None or not _fenced(err):
                raise broker_error(exc, "flushing the control writer", topic=self.topic) from exc
            log.info("closed a fenced control writer (%s): %s", self.transactional_id, err.str())


def _produce(producer: Producer, topic: str, event: ControlRecord, delivered: list[Any]) -> None:
    """Queue ``event`` on the control partition; its delivery report lands in ``delivered``."""
    producer.produce(
        topic,
        key=_key(event),
        value=encode_control_event(event),
        partition=CONTROL_PARTITION,
        on_delivery=lambda err, msg: delivered.append((err, msg)),
    )


def _fenced(err: KafkaError) -> bool:
    """A newer trainer's writer took the transactional id: librdkafka reports it as one of
    ``FENCED`` or as a fatal error."""
    return err.code() in FENCED or err.fatal()


def _offset(err: KafkaError | None, msg: Message, action: str, topic: str) -> int:
    if err is not None:
        raise broker_error(err, action, topic=topic)
    return record_position(msg)[1]


class PolicyVersionPublisher:
    """Writes versions as given: idempotent, and :meth:`publish` returns only once the
    broker has the record, so a version is never announced before it is durable. No
    fencing: ``rolloutbus train`` uses :class:`TrainerControlWriter`."""

    def __init__(self, cfg: Config | KafkaConfig):
        self.kafka = _kafka(cfg)
        self.topic = Topics.from_config(self.kafka).control
        self._producer = idempotent_producer(self.kafka)

    def publish(self, event: ControlRecord) -> int:
        """Write ``event``; returns its offset on the control topic."""
        what = f"control event {event.type} (run epoch {event.run_epoch})"
        delivered: list[Any] = []
        try:
            _produce(self._producer, self.topic, event, delivered)
        except KafkaException as exc:
            raise broker_error(exc, f"publishing {what}", topic=self.topic) from exc
        if self._producer.flush(DELIVERY_TIMEOUT_S) or not delivered:
            raise BrokerError(
                f"{what} not acknowledged by {self.topic} within {DELIVERY_TIMEOUT_S} s"
            )
        err, msg = delivered[0]
        return _offset(err, msg, f"publishing {what}", self.topic)


def publish_policy_version(cfg: Config | KafkaConfig, event: ControlRecord) -> int:
    """One-off publish (a fresh producer); returns the record's offset."""
    return PolicyVersionPublisher(cfg).publish(event)
