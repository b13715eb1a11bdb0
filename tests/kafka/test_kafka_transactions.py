"""The Kafka seams that outlive fatal errors, against the real broker.

- ``rolloutbus/kafka/transactions.py``: a fatal transaction error replaces the producer and
  the next transaction commits, with nothing of the failed one visible; a live process
  holding the same transactional id is told apart from a one-off fencing.
- a producer whose calls keep failing (a fault injector, below: the wedge after a broker
  restart cannot be made on demand) is replaced after ``stall_s``, and the transaction it
  held never shows;
- ``rolloutbus/kafka/group_member.py``: a consumer fenced by a member with its
  ``group.instance.id`` (what a lone static member can do to itself after a broker restart)
  is replaced and goes on consuming.

Fatal errors are provoked the way Kafka makes them: a second producer with the same
``transactional.id`` runs ``init_transactions`` (as a restarted process does), which fences
the first (PRODUCER_FENCED, fatal in librdkafka); a second consumer joins with the same
``group.instance.id`` (FENCED_INSTANCE_ID, fatal). A SIGKILLed broker (``INVALID_TXN_STATE``
from ``abort_transaction``) takes the first path; ``tests/faults/test_faults.py`` kills one.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    idempotent_producer,
    read_committed_consumer,
    transactional_producer,
)
from rolloutbus.kafka.group_member import GroupMember
from rolloutbus.kafka.transactions import (
    OutgoingRecord,
    TransactionAborted,
    TransactionalProducer,
    TransactionSettings,
)
from rolloutbus.topics import Topics
from tests.helpers import unique_name
from tests.pipeline import read_topic

FAST_RETRY = TransactionSettings(retry_backoff_s=0.1, call_timeout_s=20.0)


def _fence(kafka: KafkaConfig, transactional_id: str):
    """What a restarted process does first: its init_transactions fences every earlier
    producer with the id. Returns the new producer (kept alive by the caller)."""
    newer = transactional_producer(kafka, transactional_id)
    newer.init_transactions(30)
    return newer


def _input_consumer(kafka: KafkaConfig) -> Consumer:
    consumer = read_committed_consumer(kafka, unique_name("tx"))
    consumer.assign([TopicPartition(Topics.from_config(kafka).turns, 0, 0)])
    return consumer


def _record(kafka: KafkaConfig, key: str) -> OutgoingRecord:
    return OutgoingRecord(Topics.from_config(kafka).trajectories, key, key.encode(), 0)


def _offsets(kafka: KafkaConfig, offset: int) -> list[TopicPartition]:
    return [TopicPartition(Topics.from_config(kafka).turns, 0, offset)]


def test_a_fatal_error_replaces_the_producer_and_nothing_of_its_transaction_shows(
    kafka_config: KafkaConfig,
):
    tid = unique_name("tx")
    consumer = _input_consumer(kafka_config)
    writer = TransactionalProducer(kafka_config, tid, FAST_RETRY)
    writer.init()
    writer.commit([_record(kafka_config, "a")], _offsets(kafka_config, 1), consumer)
    newer = _fence(kafka_config, tid)
    with pytest.raises(TransactionAborted) as aborted:
        writer.commit([_record(kafka_config, "b")], _offsets(kafka_config, 2), consumer)
    assert (aborted.value.cause, aborted.value.replaced) == ("fatal", True)
    writer.commit([_record(kafka_config, "c")], _offsets(kafka_config, 3), consumer)
    cfg = Config(kafka=kafka_config)
    keys = [
        m.key().decode() for m in read_topic(cfg, Topics.from_config(kafka_config).trajectories)
    ]
    assert keys == ["a", "c"]  # "b" was aborted with its producer: never visible
    [committed] = consumer.committed(_offsets(kafka_config, 0), timeout=30)
    assert committed.offset == 3
    newer.begin_transaction()  # the replacement fenced the one that fenced us
    newer.produce(Topics.from_config(kafka_config).trajectories, key="z", value=b"z")
    with pytest.raises(KafkaException) as fenced:
        newer.commit_transaction(30)
    assert fenced.value.args[0].fatal()
    consumer.close()


def test_a_live_process_with_the_same_id_ends_the_older_after_repeated_fencing(
    kafka_config: KafkaConfig,
):
    """A restart fences once and the new producer commits; a second live process fences
    again after every replacement: that is a misconfiguration, told apart and named."""
    tid = unique_name("tx")
    consumer = _input_consumer(kafka_config)
    settings = TransactionSettings(retry_backoff_s=0.1, fenced_limit=2, fenced_hint="the hint")
    writer = TransactionalProducer(kafka_config, tid, settings)
    writer.init()
    _fence(kafka_config, tid)
    with pytest.raises(TransactionAborted):
        writer.commit([_record(kafka_config, "a")], _offsets(kafka_config, 1), consumer)
    _fence(kafka_config, tid)  # the other process fences again, before any commit here
    with pytest.raises(BrokerError, match="fenced 2 times in a row.*the hint"):
        writer.commit([_record(kafka_config, "b")], _offsets(kafka_config, 1), consumer)
    consumer.close()


# -- a stalled producer ----------------------------------------------------------------------


class FailingSendOffsets:
    """Fault injector (a test double): a real producer whose ``send_offsets_to_transaction``
    raises ``error`` instead of calling the broker, as librdkafka does when a producer's
    requests stop leaving the client after a broker restart ("Timed out 0 in-flight, 0
    retry-queued, 1 out-queue"). Everything else is the real producer's. ``quirk``: the
    error arrives as confluent-kafka's SystemError caused by it (a log line handed to Python
    while the KafkaException was pending, seen in CI)."""

    def __init__(self, producer: Producer, error: KafkaError, quirk: bool = False):
        self._producer, self._error, self._quirk = producer, error, quirk
        self.calls = 0

    def send_offsets_to_transaction(self, *args, **kwargs):
        self.calls += 1
        if not self._quirk:
            raise KafkaException(self._error)
        try:
            raise KafkaException(self._error)
        except KafkaException as exc:
            raise SystemError("<built-in method> returned a result with an error set") from exc

    def __getattr__(self, name: str):
        return getattr(self._producer, name)


class FirstProducerFails(TransactionalProducer):
    """The first producer made fails every send_offsets call; its replacements are real."""

    def __init__(self, *args, error: KafkaError, quirk: bool = False, **kwargs):
        self.injected: list[FailingSendOffsets] = []
        self._error, self._quirk = error, quirk
        super().__init__(*args, **kwargs)

    def _new_producer(self):
        producer = super()._new_producer()
        if self.injected:
            return producer
        self.injected.append(FailingSendOffsets(producer, self._error, self._quirk))
        return self.injected[0]


TIMED_OUT = KafkaError(KafkaError._TIMED_OUT, "Timed out 0 in-flight, 1 out-queue", retriable=True)
ABORTABLE = KafkaError(KafkaError._TIMED_OUT, "injected: requires abort", txn_requires_abort=True)


def _committed_keys(kafka: KafkaConfig) -> list[str]:
    cfg = Config(kafka=kafka)
    return [m.key().decode() for m in read_topic(cfg, Topics.from_config(kafka).trajectories)]


def test_a_producer_that_keeps_timing_out_is_replaced_after_the_stall_limit(
    kafka_config: KafkaConfig,
):
    """Retried on one producer, the call would time out until broker_retry_s (minutes);
    after stall_s the producer is replaced, and the new one commits."""
    consumer = _input_consumer(kafka_config)
    settings = TransactionSettings(retry_backoff_s=0.1, retry_backoff_max_s=0.2, stall_s=1.5)
    writer = FirstProducerFails(kafka_config, unique_name("tx"), settings, error=TIMED_OUT)
    writer.init()
    started = time.monotonic()
    with pytest.raises(TransactionAborted) as aborted:
        writer.commit([_record(kafka_config, "a")], _offsets(kafka_config, 1), consumer)
    stalled_for = time.monotonic() - started
    assert (aborted.value.cause, aborted.value.replaced) == ("stalled", True)
    assert "stall limit" in str(aborted.value)
    assert writer.injected[0].calls >= 3  # retried on the one producer first
    assert stalled_for < settings.broker_retry_s  # not retried until the broker limit
    writer.commit([_record(kafka_config, "b")], _offsets(kafka_config, 2), consumer)
    assert _committed_keys(kafka_config) == ["b"]  # "a" went with the stalled producer
    [committed] = consumer.committed(_offsets(kafka_config, 0), timeout=30)
    assert committed.offset == 2
    consumer.close()


@pytest.mark.parametrize("quirk", [False, True], ids=["bare", "under-a-system-error"])
def test_a_transaction_aborted_cleanly_still_hands_the_next_to_a_new_producer(
    kafka_config: KafkaConfig, quirk: bool
):
    """After a broker restart a producer that aborted cleanly wedged its next call (the
    broker-restart row): an abortable failure is aborted, and the next transaction runs on
    a new producer, whose commit is the only one visible. The same when the error comes
    under confluent-kafka's SystemError (before, that ended the worker unclassified)."""
    consumer = _input_consumer(kafka_config)
    writer = FirstProducerFails(
        kafka_config, unique_name("tx"), FAST_RETRY, error=ABORTABLE, quirk=quirk
    )
    writer.init()
    with pytest.raises(TransactionAborted) as aborted:
        writer.commit([_record(kafka_config, "a")], _offsets(kafka_config, 1), consumer)
    assert (aborted.value.cause, aborted.value.replaced) == ("abortable", True)
    assert writer.injected[0].calls == 1  # not retried: it requires an abort
    writer.commit([_record(kafka_config, "b")], _offsets(kafka_config, 2), consumer)
    assert _committed_keys(kafka_config) == ["b"]
    consumer.close()


# -- a fenced consumer ---------------------------------------------------------------------


def _static_consumer(kafka: KafkaConfig, group: str, instance: str) -> Consumer:
    return read_committed_consumer(
        kafka,
        group,
        overrides={"group.instance.id": instance, "auto.offset.reset": "earliest"},
    )


def _produce_keys(kafka: KafkaConfig, keys: list[str]) -> None:
    producer = idempotent_producer(kafka)
    for key in keys:
        producer.produce(Topics.from_config(kafka).turns, key=key, value=b"v", partition=0)
    assert producer.flush(30) == 0


def _consume_keys(member: GroupMember, wanted: set[str], timeout_s: float = 60.0) -> set[str]:
    got: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not wanted <= got and time.monotonic() < deadline:
        got |= {m.key().decode() for m in member.consume(100, 0.5)}
    return got


def test_a_consumer_fenced_by_its_instance_id_is_replaced_and_consumes_on(
    kafka_config: KafkaConfig,
):
    """Before GroupMember, the fatal FENCED_INSTANCE_ID was logged as a transient error and
    the consumer, dead for good, was polled on: the process consumed nothing, silently."""
    group, topic = unique_name("gm"), Topics.from_config(kafka_config).turns
    replaced: list[int] = []
    member = GroupMember(
        kafka_config,
        group,
        [topic],
        overrides={"group.instance.id": "m0", "auto.offset.reset": "earliest"},
        on_assign=lambda consumer, parts: None,
        on_revoke=lambda consumer, parts: None,
        on_replaced=lambda: replaced.append(1),
    )
    member.subscribe()
    _produce_keys(kafka_config, ["a"])
    assert _consume_keys(member, {"a"}) == {"a"}
    intruder = _static_consumer(kafka_config, group, "m0")  # the same name joins
    intruder.subscribe([topic])
    deadline = time.monotonic() + 30
    while not intruder.assignment() and time.monotonic() < deadline:
        intruder.poll(0.5)
    intruder.close()  # a static member leaves no group: "m0" is the intruder's until rejoined
    deadline = time.monotonic() + 60
    while not replaced and time.monotonic() < deadline:  # fenced at its next heartbeat
        member.consume(100, 0.5)
    assert replaced == [1], "the fenced consumer was not replaced"
    _produce_keys(kafka_config, ["b", "c"])
    assert {"b", "c"} <= _consume_keys(member, {"b", "c"})  # the new consumer's
    member.close()
