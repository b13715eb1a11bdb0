"""Read ``rollout.control``: the current policy version of the newest run.

The control topic has one partition (``admin.CONTROL_PARTITIONS``), so its records have one
order, and every reader folds them in that order through a
:class:`~rolloutbus.kafka.version_ledger.VersionLedger`: the newest run wins, and inside a
run a version only moves forward. :func:`read_control_log` reads the partition to its end
(:func:`latest_policy_version` is its current version); :class:`PolicyVersionFollower`
keeps reading as records arrive. No consumer group membership: every reader reads the
partition itself, so a restarted process learns the current version from the log.

Records the ledger refuses as errors (and records that are no control event) are logged,
counted (``rolloutbus_control_records_refused_total{reason}``), and never applied. One
reader writes them to the dead-letter topic: the follower made with ``dead_letters=True``
(the weight sync's). It remembers how far it got in a consumer group of its own
(``CONTROL_DEAD_LETTER_GROUP``), so a restart does not write the same letters again; two
such followers at once (two weight syncs) may both write one (at least once, each letter
naming the record's offset).
"""

from __future__ import annotations

import logging

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Message, TopicPartition
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError, SchemaError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    broker_error,
    committed_offsets,
    consume_records,
    message_location,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
)
from rolloutbus.kafka.control_metrics import ControlMetrics
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.kafka.version_ledger import Refusal, Verdict, VersionLedger
from rolloutbus.schemas.control import PolicyVersionPublished, decode_control_event
from rolloutbus.topics import CONTROL_PARTITION, Topics

__all__ = [
    "CONTROL_DEAD_LETTER_GROUP",
    "PolicyVersionFollower",
    "latest_policy_version",
    "read_control_log",
]

log = logging.getLogger(__name__)
CONTROL_READER_GROUP = "rolloutbus-control-reader"  # never commits: librdkafka wants an id
# commits only "dead letters written up to here" for the control topic (one per prefix)
CONTROL_DEAD_LETTER_GROUP = "rolloutbus-control-dead-letters"
DEAD_LETTER_STAGE = "control"
READ_TIMEOUT_S = 30.0  # seconds one poll may wait before a read of the topic counts as stalled
DRAIN_BATCH = 500  # records per consume() while catching up; a version record is ~300 bytes


def _kafka(cfg: Config | KafkaConfig) -> KafkaConfig:
    return cfg.kafka if isinstance(cfg, Config) else cfg


def fold_record(ledger: VersionLedger, msg: Message) -> Verdict:
    """Decode one record and fold it; a record that is no control event is refused."""
    try:
        event = decode_control_event(msg.value() or b"")
    except ValidationError as exc:
        errors = exc.errors()
        return ledger.malformed(str(errors[0]["msg"]) if errors else str(exc))
    except SchemaError as exc:  # a schema version this reader cannot read
        return ledger.malformed(str(exc))
    return ledger.fold(event)


def read_control_log(cfg: Config | KafkaConfig) -> VersionLedger:
    """The whole control topic, folded: the newest run, its current version, and what was
    refused on the way.

    Reads the (compacted, one-partition) topic to its end with an assigned consumer, which
    waits out a partition that has no leader yet (a topic created a moment ago).
    """
    kafka = _kafka(cfg)
    topic = Topics.from_config(kafka).control
    consumer = read_committed_consumer(kafka, CONTROL_READER_GROUP, partition_eof=True)
    ledger = VersionLedger()
    try:
        with translate_kafka_errors("assigning", topic=topic, partition=CONTROL_PARTITION):
            consumer.assign([TopicPartition(topic, CONTROL_PARTITION, OFFSET_BEGINNING)])
        while True:
            msg = poll_record(consumer, READ_TIMEOUT_S)
            if msg is None:
                raise BrokerError(f"reading {topic} stalled for {READ_TIMEOUT_S} s")
            if isinstance(msg, PartitionEnd):
                break
            verdict = fold_record(ledger, msg)
            if verdict.refusal is not None:
                log.debug("%s: %s", message_location(msg), verdict.detail)
    finally:
        consumer.close()
    errors = {r.value: n for r, n in ledger.refused.items() if r is not Refusal.OLDER_RUN}
    if errors:
        log.warning("%s holds records no reader applies: %s", topic, errors)
    return ledger


def latest_policy_version(cfg: Config | KafkaConfig) -> PolicyVersionPublished | None:
    """The current policy version of the newest run on the control topic, or None if that
    run (or the topic) has none."""
    return read_control_log(cfg).current


class PolicyVersionFollower:
    """Follows the control topic: :meth:`poll` returns the newest run's current version
    when it changed since the last one it returned (versions published in between are
    skipped: whoever follows only ever needs the current one), or None.

    The first poll returns the version current at start, if any, so a follower that starts
    after a publish still sees it. ``dead_letters``: write the records refused as errors
    to the dead-letter topic (one follower per deployment should: the weight sync's).
    """

    def __init__(
        self,
        cfg: Config | KafkaConfig,
        *,
        dead_letters: bool = False,
        registry: CollectorRegistry | None = None,
    ):
        self.kafka = _kafka(cfg)
        self.topic = Topics.from_config(self.kafka).control
        self.ledger = VersionLedger()
        self._metrics = ControlMetrics(registry)
        self._returned: PolicyVersionPublished | None = None
        group = CONTROL_DEAD_LETTER_GROUP if dead_letters else CONTROL_READER_GROUP
        self._consumer = read_committed_consumer(self.kafka, group, partition_eof=True)
        self._caught_up = False
        self._letters = (
            DeadLetterWriter(self.kafka, stage=DEAD_LETTER_STAGE) if dead_letters else None
        )
        self._lettered_until = self._committed_offset() if dead_letters else 0
        with translate_kafka_errors("assigning", topic=self.topic, partition=CONTROL_PARTITION):
            # the whole (compacted) partition, so the current version is seen even when it
            # was published long before this follower started
            self._consumer.assign([TopicPartition(self.topic, CONTROL_PARTITION, OFFSET_BEGINNING)])

    @property
    def current(self) -> PolicyVersionPublished | None:
        """The newest run's current version, as far as this follower has read."""
        return self.ledger.current

    def poll(self, timeout_s: float) -> PolicyVersionPublished | None:
        """Waits up to ``timeout_s`` for a record, then reads whatever else is there. The
        first poll reads the partition to its end, however long that takes."""
        if not self._caught_up:
            self._catch_up()
        # poll() returns with the first record; consume(n, t) would wait for n records or t
        first = poll_record(self._consumer, timeout_s)
        records = [first] if isinstance(first, Message) else []
        while records:
            for msg in records:
                self._take(msg)
            records = consume_records(self._consumer, DRAIN_BATCH, 0)
        current = self.ledger.current
        if current is None or current is self._returned:
            return None
        self._returned = current
        return current

    def _catch_up(self) -> None:
        """Everything committed when the follower started: its first answer is the version
        current then, never one the log has already left behind."""
        while True:
            msg = poll_record(self._consumer, READ_TIMEOUT_S)
            if msg is None:
                raise BrokerError(f"reading {self.topic} stalled for {READ_TIMEOUT_S} s")
            if isinstance(msg, PartitionEnd):
                self._caught_up = True
                return
            self._take(msg)

    def _take(self, msg: Message) -> None:
        verdict = fold_record(self.ledger, msg)
        self._metrics.run_epoch.set(self.ledger.run_epoch)
        if verdict.refusal is None:
            return
        self._metrics.refused.labels(verdict.refusal.value).inc()
        where = message_location(msg)
        if not verdict.dead_letter:
            log.info("ignoring %s: %s", where, verdict.detail)
            return
        log.error("refusing %s (%s): %s", where, verdict.refusal.value, verdict.detail)
        self._dead_letter(msg, verdict)

    def _dead_letter(self, msg: Message, verdict: Verdict) -> None:
        offset = record_position(msg)[1]
        if self._letters is None or offset < self._lettered_until:
            return
        where = message_location(msg)
        self._letters.write(
            msg.value() or b"",
            f"{verdict.refusal}: {verdict.detail}",
            source=where,
            key=where,
        )
        self._lettered_until = offset + 1
        self._commit_lettered()

    def _committed_offset(self) -> int:
        tp = TopicPartition(self.topic, CONTROL_PARTITION)
        with translate_kafka_errors(
            "reading the dead-lettered offset", topic=self.topic, partition=CONTROL_PARTITION
        ):
            [committed] = committed_offsets(self._consumer, [tp], READ_TIMEOUT_S)
        return max(committed.offset, 0)

    def _commit_lettered(self) -> None:
        tp = TopicPartition(self.topic, CONTROL_PARTITION, self._lettered_until)
        try:
            self._consumer.commit(offsets=[tp], asynchronous=False)
        except KafkaException as exc:  # the letter is written; a restart may write it again
            log.warning(
                "%s", broker_error(exc, "recording a dead letter's offset", topic=self.topic)
            )

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> PolicyVersionFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
