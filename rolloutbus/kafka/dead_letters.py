"""Dead letters to rollout.dlq: one record format (``schemas/dlq.py``), one writer.

Every stage uses :class:`DeadLetterWriter`. The publisher and the session worker call
``write`` (produce and wait: a record that is dropped must land). The replay buffer calls
``record`` and produces the letter itself inside its Kafka transaction, so the letter
commits or aborts with the trajectories and offsets of the same batch.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from confluent_kafka import Producer

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import idempotent_producer, translate_kafka_errors
from rolloutbus.schemas.dlq import DeadLetter
from rolloutbus.topics import Topics

__all__ = ["DeadLetterRecord", "DeadLetterWriter", "dead_letter_record"]

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 30.0  # seconds; a dead letter is rare and must not be lost


class DeadLetterRecord(NamedTuple):
    """A dead letter ready to produce: ``producer.produce(topic, key=key, value=value)``."""

    topic: str
    key: str | None
    value: bytes


def dead_letter_record(
    topic: str,
    original: bytes,
    *,
    stage: str,
    reason: str,
    source: str = "",
    key: str | None = None,
) -> DeadLetterRecord:
    """Wrap ``original`` (exactly as received) in a :class:`DeadLetter` and log why."""
    log.warning("dead letter (%s) from %s: %s", stage, source or "?", reason)
    letter = DeadLetter.of(original, stage=stage, reason=reason, source=source)
    return DeadLetterRecord(topic, key, letter.model_dump_json().encode())


class DeadLetterWriter:
    """Dead letters of one stage; produced on ``producer`` (a new idempotent one if None)."""

    def __init__(self, kafka: KafkaConfig, *, stage: str, producer: Producer | None = None):
        self.topic = Topics.from_config(kafka).dlq
        self.stage = stage
        self._producer = producer or idempotent_producer(kafka)
        self.count = 0  # letters written (and acknowledged) by ``write``

    def record(
        self, original: bytes, reason: str, *, source: str = "", key: str | None = None
    ) -> DeadLetterRecord:
        """The letter, not yet produced: for a caller that produces it in a transaction."""
        return dead_letter_record(
            self.topic, original, stage=self.stage, reason=reason, source=source, key=key
        )

    def write(
        self, original: bytes, reason: str, *, source: str = "", key: str | None = None
    ) -> None:
        """Produce the letter and wait until the broker has it."""
        letter = self.record(original, reason, source=source, key=key)
        with translate_kafka_errors("writing a dead letter", topic=self.topic):
            self._producer.produce(letter.topic, key=letter.key, value=letter.value)
            remaining = self._producer.flush(FLUSH_TIMEOUT_S)
        if remaining:
            raise BrokerError(
                f"dead letter to {self.topic} not delivered within {FLUSH_TIMEOUT_S} s"
            )
        self.count += 1
