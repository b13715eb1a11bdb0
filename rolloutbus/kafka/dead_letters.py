"""Write dead letters to rollout.dlq, synchronously: a record that is dropped must land."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException, Producer

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.schemas.dlq import DeadLetter
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 30.0  # seconds; a dead letter is rare and must not be lost


class DeadLetterWriter:
    def __init__(self, kafka: KafkaConfig, *, stage: str, producer: Producer | None = None):
        self._topic = Topics.from_config(kafka).dlq
        self._stage = stage
        self._producer = producer or Producer({**kafka.client_settings(), "acks": "all",
                                               "enable.idempotence": True})
        self.count = 0

    def write(self, original: bytes, reason: str, *, source: str = "", key: str | None = None) -> None:
        letter = DeadLetter.of(original, stage=self._stage, reason=reason, source=source)
        log.warning("dead letter (%s) from %s: %s", self._stage, source or "?", reason)
        try:
            self._producer.produce(self._topic, key=key, value=letter.model_dump_json().encode())
            remaining = self._producer.flush(FLUSH_TIMEOUT_S)
        except KafkaException as exc:
            raise BrokerError(f"could not write a dead letter to {self._topic}: {exc}") from exc
        if remaining:
            raise BrokerError(f"dead letter to {self._topic} not delivered within {FLUSH_TIMEOUT_S} s")
        self.count += 1
