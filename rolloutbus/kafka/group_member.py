"""A read_committed consumer-group member that outlives a fatal consumer error.

A consumer with a fatal error (librdkafka's ``_FATAL``) consumes nothing ever again: a
process that only logs it and polls on hangs silently. The one fatal consumer error is
``FENCED_INSTANCE_ID``, a static member fenced by a newer member with its
``group.instance.id``, and a lone static member can be fenced by *itself*: after a broker
restart or a coordinator stall, a rejoin it gave up on still reaches the coordinator, which
then takes the newer join for a second process (KAFKA-20985; seen here after a broker
restart). So :meth:`GroupMember.consume` replaces the consumer: the old one is closed off
this thread, a new one with the same settings subscribes, and ``on_replaced`` tells the
processor that its assignment is gone (the new consumer's assignment comes through
``on_assign`` as usual). Fencing still holds: the new member gets a new member id, so a
transaction carrying the old one's group metadata is refused (KIP-447).

A second live process with the same ``group.instance.id`` fences this one again and again;
after ``FENCED_LIMIT`` replacements with no commit between (:meth:`committed` resets the
count) that ends in :class:`BrokerError` naming the setting. A consumer that is not fatal
but stuck (its coordinator requests time out after a broker restart) is replaced the same
way when its processor says so (:meth:`GroupMember.replace_stalled`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    read_committed_consumer,
    record_or_partition_end,
    translate_kafka_errors,
)

log = logging.getLogger(__name__)

FENCED_LIMIT = 3  # replacements in a row (no commit between) that mean a second live process
# consumer errors no retry can fix; every other non-fatal one is retried by librdkafka itself
PERMANENT_CONSUMER_ERRORS = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError._UNKNOWN_TOPIC,
    }
)
Rebalance = Callable[[Consumer, list[TopicPartition]], None]


class GroupMember:
    """One member of ``group_id`` subscribed to ``topics``; see the module docstring."""

    def __init__(
        self,
        kafka: KafkaConfig,
        group_id: str,
        topics: list[str],
        *,
        overrides: Mapping[str, Any],
        on_assign: Rebalance,
        on_revoke: Rebalance,
        on_replaced: Callable[[], None],
        fenced_hint: str = "",
    ):
        self.kafka, self.group_id, self.topics = kafka, group_id, topics
        self._overrides = dict(overrides)
        self._on_assign, self._on_revoke, self._on_replaced = on_assign, on_revoke, on_replaced
        self._fenced_hint = fenced_hint
        self._replaced_in_a_row = 0
        self.consumer = self._new_consumer()

    def subscribe(self) -> None:
        with translate_kafka_errors(f"subscribing to {self.topics}"):
            self.consumer.subscribe(
                self.topics,
                on_assign=self._current_only(self._on_assign),
                on_revoke=self._current_only(self._on_revoke),
                on_lost=self._current_only(self._on_revoke),
            )

    def _current_only(self, callback: Rebalance) -> Rebalance:
        """A replaced consumer's callbacks (its close, on another thread) are not passed on:
        its assignment was dropped when it was replaced."""

        def call(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            if consumer is self.consumer:
                callback(consumer, partitions)

        return call

    def consume(self, max_records: int, timeout_s: float) -> list[Message]:
        """Records only; a transient error (the broker restarting) is logged and left to
        librdkafka's retries, a permanent one raises BrokerError, a fatal one replaces the
        consumer (this call then returns what came before it)."""
        with translate_kafka_errors("consuming", topic=",".join(self.topics)):
            batch = self.consumer.consume(max_records, timeout_s)
        records = []
        for msg in batch:
            err = msg.error()
            if err is None:
                records.append(msg)
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal() or err.code() == KafkaError._FATAL:
                self._replace(err)
                break
            elif err.code() in PERMANENT_CONSUMER_ERRORS:
                record_or_partition_end(msg)  # raises the BrokerError
            else:
                log.warning("consumer: %s (%s); the client retries", err.str(), err.name())
        return records

    def committed(self) -> None:
        """A transaction with this member's offsets committed: it is not being fenced."""
        self._replaced_in_a_row = 0

    def close(self) -> None:
        self.consumer.close()

    def _replace(self, err: KafkaError) -> None:
        self._replaced_in_a_row += 1
        if self._replaced_in_a_row > FENCED_LIMIT:
            raise BrokerError(
                f"consumer of group {self.group_id!r}: fatal error {self._replaced_in_a_row} "
                f"times in a row with no commit between ({err.str()}): another live process "
                f"has this group.instance.id; {self._fenced_hint}"
            )
        log.warning(
            "consumer of group %r: fatal error (%s): replacing the consumer",
            self.group_id,
            err.str(),
        )
        self._swap()

    def replace_stalled(self, reason: str) -> None:
        """Replace a consumer that is alive but stuck: after a broker restart its requests
        to the group coordinator can time out for minutes while a new client's are answered
        at once. Replaced as for a fatal error, not counted toward the fencing limit."""
        log.warning("consumer of group %r: %s: replacing the consumer", self.group_id, reason)
        self._swap()

    def _swap(self) -> None:
        old, self.consumer = self.consumer, self._new_consumer()
        threading.Thread(target=_close_quietly, args=(old,), daemon=True).start()
        self._on_replaced()
        self.subscribe()

    def _new_consumer(self) -> Consumer:
        return read_committed_consumer(self.kafka, self.group_id, overrides=self._overrides)


def _close_quietly(consumer: Consumer) -> None:
    """Close a consumer in a fatal state off the processor's thread (it leaves no group:
    a static member never does, and a fenced one is not a member any more)."""
    try:
        consumer.close()
    except (KafkaException, RuntimeError) as exc:  # best effort on an abandoned client
        log.debug("closing a replaced consumer failed: %s", exc)


__all__ = ["FENCED_LIMIT", "PERMANENT_CONSUMER_ERRORS", "GroupMember"]
