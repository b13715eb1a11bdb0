"""The one boundary to confluent-kafka: client factories, polling, and error translation.

Every producer, consumer and admin client in Rollout Bus is made here, starting from
:meth:`KafkaConfig.client_settings` (bootstrap plus SASL/SSL) so a secured cluster needs
its settings in one place. Every ``KafkaException``/``KafkaError`` that reaches a caller
becomes a :class:`BrokerError` naming ``topic[partition]@offset`` where known.

Settings are built by pure ``*_settings`` functions (tested without a broker); the
factories only hand them to confluent-kafka. Extra librdkafka settings go in
``overrides``, which win over everything else.

librdkafka's own log lines go to the Python logger ``librdkafka`` (confluent-kafka's
``logger`` setting, added by every factory here): one format with the rest, and quiet
below WARNING unless the command runs with -v. confluent-kafka hands them over inside
``poll()``/``flush()``/``consume()`` calls, never from librdkafka's threads. A line
repeated by one client is shown once per 30 s with a count (``repeated_lines.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.repeated_lines import RepeatedLines

__all__ = [
    "LIBRDKAFKA_LOGGER",
    "PartitionEnd",
    "admin_client",
    "admin_settings",
    "broker_error",
    "consume_records",
    "idempotent_producer",
    "idempotent_producer_settings",
    "iter_records",
    "kafka_error",
    "kafka_error_code",
    "message_location",
    "poll_record",
    "read_committed_consumer",
    "read_committed_consumer_settings",
    "record_location",
    "record_or_partition_end",
    "record_position",
    "transactional_producer",
    "transactional_producer_settings",
    "translate_kafka_errors",
]

Overrides = Mapping[str, Any] | None
LIBRDKAFKA_LOGGER = logging.getLogger("librdkafka")
LIBRDKAFKA_LOGGER.addFilter(RepeatedLines())  # a broker outage: a line per client per 30 s


# -- settings (pure) ---------------------------------------------------------------------


def idempotent_producer_settings(kafka: KafkaConfig, overrides: Overrides = None) -> dict[str, Any]:
    """No duplicates on retry, and a record counts as written only once every in-sync
    replica has it; records up to ``kafka.max_message_bytes`` (librdkafka's default is 1 MB)."""
    return {
        **kafka.client_settings(),
        "enable.idempotence": True,
        "acks": "all",
        "message.max.bytes": kafka.max_message_bytes,
        **(overrides or {}),
    }


def transactional_producer_settings(
    kafka: KafkaConfig, transactional_id: str, overrides: Overrides = None
) -> dict[str, Any]:
    """An idempotent producer with a ``transactional.id``: one live writer per id (a
    restarted one fences the old), for consume-transform-produce exactly once."""
    return idempotent_producer_settings(
        kafka, {"transactional.id": transactional_id, **(overrides or {})}
    )


def read_committed_consumer_settings(
    kafka: KafkaConfig, group_id: str, *, partition_eof: bool = False, overrides: Overrides = None
) -> dict[str, Any]:
    """Sees only committed transactions; offsets are committed by the caller, never on a
    timer, so a crash re-reads what was not yet used. ``partition_eof`` reports the end of
    each assigned partition (see :class:`PartitionEnd`)."""
    return {
        **kafka.client_settings(),
        "group.id": group_id,
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
        "enable.partition.eof": partition_eof,
        # one record may be as large as the topics allow
        "fetch.max.bytes": kafka.max_message_bytes,
        "max.partition.fetch.bytes": kafka.max_message_bytes,
        **(overrides or {}),
    }


def admin_settings(kafka: KafkaConfig, overrides: Overrides = None) -> dict[str, Any]:
    return {**kafka.client_settings(), **(overrides or {})}


# -- factories ---------------------------------------------------------------------------


def idempotent_producer(kafka: KafkaConfig, overrides: Overrides = None) -> Producer:
    with translate_kafka_errors(f"creating a producer for {kafka.bootstrap_servers}"):
        return Producer(_logging_to_python(idempotent_producer_settings(kafka, overrides)))


def transactional_producer(
    kafka: KafkaConfig, transactional_id: str, overrides: Overrides = None
) -> Producer:
    with translate_kafka_errors(
        f"creating transactional producer {transactional_id!r} for {kafka.bootstrap_servers}"
    ):
        return Producer(
            _logging_to_python(transactional_producer_settings(kafka, transactional_id, overrides))
        )


def read_committed_consumer(
    kafka: KafkaConfig, group_id: str, *, partition_eof: bool = False, overrides: Overrides = None
) -> Consumer:
    with translate_kafka_errors(
        f"creating consumer of group {group_id!r} for {kafka.bootstrap_servers}"
    ):
        return Consumer(
            _logging_to_python(
                read_committed_consumer_settings(
                    kafka, group_id, partition_eof=partition_eof, overrides=overrides
                )
            )
        )


def admin_client(kafka: KafkaConfig, overrides: Overrides = None) -> AdminClient:
    with translate_kafka_errors(f"creating an admin client for {kafka.bootstrap_servers}"):
        return AdminClient(_logging_to_python(admin_settings(kafka, overrides)))


def _logging_to_python(settings: dict[str, Any]) -> dict[str, Any]:
    """librdkafka logs through Python logging instead of its own stderr lines (unless the
    caller's overrides name a logger of their own)."""
    return {"logger": LIBRDKAFKA_LOGGER, **settings}


# -- polling -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionEnd:
    """The consumer has read everything committed in one partition (``enable.partition.eof``)."""

    topic: str
    partition: int
    offset: int


def poll_record(consumer: Consumer, timeout_s: float) -> Message | PartitionEnd | None:
    """One poll: a record, the end of a partition, or None if nothing came within timeout_s."""
    msg = consumer.poll(timeout_s)
    return None if msg is None else record_or_partition_end(msg)


def consume_records(consumer: Consumer, max_records: int, timeout_s: float) -> list[Message]:
    """One ``consume()`` batch, records only: partition ends are dropped."""
    batch = (record_or_partition_end(msg) for msg in consumer.consume(max_records, timeout_s))
    return [msg for msg in batch if not isinstance(msg, PartitionEnd)]


def iter_records(
    consumer: Consumer, poll_s: float, *, idle_timeout_s: float | None = None
) -> Iterator[Message]:
    """Records as they arrive, skipping partition ends; stops after ``idle_timeout_s``
    seconds without any (None: never)."""
    idle_since = time.monotonic()
    while True:
        msg = poll_record(consumer, poll_s)
        if msg is None:
            if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                return
            continue
        idle_since = time.monotonic()
        if not isinstance(msg, PartitionEnd):
            yield msg


def record_or_partition_end(msg: Message) -> Message | PartitionEnd:
    """The record itself, or a PartitionEnd; any other error raises BrokerError."""
    err = msg.error()
    if err is None:
        return msg
    if err.code() == KafkaError._PARTITION_EOF:
        return PartitionEnd(msg.topic() or "", *record_position(msg))
    raise broker_error(
        err, "consuming", topic=msg.topic(), partition=msg.partition(), offset=msg.offset()
    )


def record_position(msg: Message) -> tuple[int, int]:
    """``(partition, offset)`` of a consumed record, a partition end or a delivery report:
    librdkafka sets both on those, though its types allow None (an error event may lack them)."""
    partition, offset = msg.partition(), msg.offset()
    if partition is None or offset is None:
        raise BrokerError(
            f"a record without partition or offset: {message_location(msg) or msg.error()}"
        )
    return partition, offset


# -- errors ------------------------------------------------------------------------------


def record_location(
    topic: str | None, partition: int | None = None, offset: int | None = None
) -> str:
    """``topic[partition]@offset``, leaving out what is unknown (None or librdkafka's
    negative placeholders such as -1 for "any partition" or -1001 for "no offset")."""
    if not topic:
        return ""
    if partition is None or partition < 0:
        return topic
    if offset is None or offset < 0:
        return f"{topic}[{partition}]"
    return f"{topic}[{partition}]@{offset}"


def message_location(msg: Message) -> str:
    return record_location(msg.topic(), msg.partition(), msg.offset())


def broker_error(
    exc: KafkaException | KafkaError,
    action: str,
    *,
    topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    hint: str = "",
) -> BrokerError:
    """The BrokerError for a confluent-kafka failure; use as ``raise broker_error(...) from exc``.

    ``action`` says what was being done ("committing offsets"); ``hint`` what to check.
    """
    where = record_location(topic, partition, offset)
    message = f"{action} failed" + (f" at {where}" if where else "") + f": {_describe(exc)}"
    return BrokerError(f"{message}; {hint}" if hint else message)


@contextmanager
def translate_kafka_errors(
    action: str,
    *,
    topic: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    hint: str = "",
) -> Iterator[None]:
    """Re-raise a ``KafkaException`` from the block, bare or under confluent-kafka's
    ``SystemError`` (:func:`bare_kafka_exceptions`), as :func:`broker_error`."""
    try:
        with bare_kafka_exceptions():
            yield
    except KafkaException as exc:
        raise broker_error(
            exc, action, topic=topic, partition=partition, offset=offset, hint=hint
        ) from exc


@contextmanager
def bare_kafka_exceptions() -> Iterator[None]:
    """A ``KafkaException`` pending under confluent-kafka's ``SystemError`` re-raised as
    itself, so that an ``except KafkaException`` around the block classifies it.

    confluent-kafka may hand librdkafka's log lines to the ``logger`` while a call's
    ``KafkaException`` is pending; the handler's first C call then raises ``SystemError``
    caused by that exception (seen in CI: a test's log capture appending a record). A
    ``SystemError`` that no ``KafkaException`` caused is a bug of its own: it passes."""
    try:
        yield
    except SystemError as raised:
        cause = raised.__cause__
        if not isinstance(cause, KafkaException):
            raise
        raise cause from None  # the SystemError is the logger's, and cause the call's


# Errors a partition's leader gives while leadership settles (a topic just created, a broker
# restarting, a leader moving): a watermark query retries them until its timeout.
LEADERSHIP_SETTLING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TRANSPORT,
    }
)
SETTLING_BACKOFF_S = 0.2  # seconds between those retries


def watermark_offsets(consumer: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    """``(low, high)`` of ``tp`` from its leader (a read_committed consumer's high is the
    last stable offset). An error of leadership still settling is retried within
    ``timeout_s`` in all; any other, or one that outlasts it, is a :class:`BrokerError`
    naming the partition."""
    deadline = time.monotonic() + timeout_s
    with translate_kafka_errors("reading watermarks", topic=tp.topic, partition=tp.partition):
        while True:
            try:
                left = max(SETTLING_BACKOFF_S, deadline - time.monotonic())
                low, high = consumer.get_watermark_offsets(tp, timeout=left, cached=False)
                return int(low), int(high)
            except KafkaException as exc:
                if kafka_error_code(exc) not in LEADERSHIP_SETTLING or (
                    time.monotonic() + SETTLING_BACKOFF_S >= deadline
                ):
                    raise
                time.sleep(SETTLING_BACKOFF_S)


# Errors a group coordinator gives while it settles (a broker just started or restarted, the
# __consumer_offsets partition moving): a committed-offsets read retries them until its timeout.
COORDINATOR_SETTLING = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
    }
)


def committed_offsets(
    consumer: Consumer, partitions: list[TopicPartition], timeout_s: float
) -> list[TopicPartition]:
    """``consumer.committed(partitions)``, retrying a coordinator that is still settling
    within ``timeout_s`` in all (a trainer started right after its broker got
    NOT_COORDINATOR and exited); any other error, or one that outlasts it, is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            left = max(SETTLING_BACKOFF_S, deadline - time.monotonic())
            return list(consumer.committed(partitions, timeout=left))
        except KafkaException as exc:
            if kafka_error_code(exc) not in COORDINATOR_SETTLING or (
                time.monotonic() + SETTLING_BACKOFF_S >= deadline
            ):
                raise
            time.sleep(SETTLING_BACKOFF_S)


def kafka_error_code(exc: KafkaException | KafkaError) -> int | None:
    err = kafka_error(exc)
    return err.code() if err is not None else None


def kafka_error(exc: KafkaException | KafkaError) -> KafkaError | None:
    """The ``KafkaError`` an exception carries (None if it carries none)."""
    if isinstance(exc, KafkaError):
        return exc
    first = exc.args[0] if exc.args else None
    return first if isinstance(first, KafkaError) else None


def _describe(exc: KafkaException | KafkaError) -> str:
    err = kafka_error(exc)
    if err is None:
        return str(exc)
    # the name (e.g. _TRANSPORT, TOPIC_AUTHORIZATION_FAILED) is what one searches for
    return f"{err.str()} ({err.name()})"
