"""The Kafka client boundary without a broker: factory settings, error translation,
partition-end handling, and the dead-letter record every stage writes."""

from __future__ import annotations

import itertools
import json

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    admin_settings,
    broker_error,
    committed_offsets,
    idempotent_producer,
    idempotent_producer_settings,
    kafka_error_code,
    read_committed_consumer_settings,
    record_location,
    record_or_partition_end,
    record_position,
    transactional_producer_settings,
    translate_kafka_errors,
    watermark_offsets,
)
from rolloutbus.kafka.dead_letters import dead_letter_record
from rolloutbus.schemas.dlq import DeadLetter

SECURED = KafkaConfig(
    bootstrap_servers="kafka-1:9093,kafka-2:9093",
    security_protocol="SASL_SSL",
    sasl_mechanism="SCRAM-SHA-512",
    sasl_username="rollout",
    sasl_password="s3cret",
    ssl_ca_location="/etc/ssl/ca.pem",
    max_message_bytes=8 * 1024 * 1024,
)
SECURITY_SETTINGS = {
    "bootstrap.servers": "kafka-1:9093,kafka-2:9093",
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "rollout",
    "sasl.password": "s3cret",
    "ssl.ca.location": "/etc/ssl/ca.pem",
}


# --- factory settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        idempotent_producer_settings(SECURED),
        transactional_producer_settings(SECURED, "tx-0"),
        read_committed_consumer_settings(SECURED, "g"),
        admin_settings(SECURED),
    ],
    ids=["idempotent", "transactional", "consumer", "admin"],
)
def test_every_factory_carries_the_security_settings(settings):
    assert SECURITY_SETTINGS.items() <= settings.items()


def test_idempotent_producer_waits_for_all_replicas_and_allows_large_records():
    settings = idempotent_producer_settings(SECURED)
    assert settings["enable.idempotence"] is True and settings["acks"] == "all"
    assert settings["message.max.bytes"] == 8 * 1024 * 1024


def test_transactional_producer_is_idempotent_with_its_id():
    settings = transactional_producer_settings(SECURED, "rb-3", {"linger.ms": 5})
    assert settings["transactional.id"] == "rb-3"
    assert settings["enable.idempotence"] is True and settings["acks"] == "all"
    assert settings["linger.ms"] == 5


def test_read_committed_consumer_commits_only_when_told():
    settings = read_committed_consumer_settings(SECURED, "trainer")
    assert settings["group.id"] == "trainer"
    assert settings["isolation.level"] == "read_committed"
    assert settings["enable.auto.commit"] is False
    assert settings["enable.partition.eof"] is False
    assert settings["max.partition.fetch.bytes"] == 8 * 1024 * 1024
    assert (
        read_committed_consumer_settings(SECURED, "r", partition_eof=True)["enable.partition.eof"]
        is True
    )


def test_overrides_win_over_defaults():
    settings = read_committed_consumer_settings(
        SECURED, "g", overrides={"auto.offset.reset": "latest", "fetch.max.bytes": 1}
    )
    assert settings["auto.offset.reset"] == "latest" and settings["fetch.max.bytes"] == 1
    assert admin_settings(SECURED, {"log_level": 2})["log_level"] == 2


def test_plain_config_adds_no_security_settings():
    settings = admin_settings(KafkaConfig(bootstrap_servers="127.0.0.1:9092"))
    assert settings == {"bootstrap.servers": "127.0.0.1:9092"}


def test_a_bad_setting_is_a_broker_error_naming_the_client():
    # librdkafka rejects an unknown property in the constructor, before any connection
    with pytest.raises(BrokerError, match="creating a producer for 127.0.0.1:1.*no.such.setting"):
        idempotent_producer(KafkaConfig(bootstrap_servers="127.0.0.1:1"), {"no.such.setting": 1})


# --- error translation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "where"),
    [
        (("rollout.turns", 2, 15), "rollout.turns[2]@15"),
        (("rollout.turns", 2, None), "rollout.turns[2]"),
        (("rollout.turns", 2, -1001), "rollout.turns[2]"),  # librdkafka's "no offset"
        (("rollout.dlq", -1, None), "rollout.dlq"),  # "any partition"
        (("rollout.dlq", None, 7), "rollout.dlq"),
        ((None, 0, 0), ""),
    ],
)
def test_record_location(args, where):
    assert record_location(*args) == where


def test_broker_error_names_topic_partition_offset_and_the_kafka_error():
    exc = KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))
    error = broker_error(exc, "consuming", topic="rollout.turns", partition=3, offset=42)
    assert isinstance(error, BrokerError)
    assert (
        str(error)
        == "consuming failed at rollout.turns[3]@42: Broker transport failure (_TRANSPORT)"
    )


def test_broker_error_without_location_and_with_a_hint():
    error = broker_error(
        KafkaError(KafkaError._FENCED, "fenced"),
        "replay buffer transaction",
        hint="is another worker using the id?",
    )
    assert (
        str(error)
        == "replay buffer transaction failed: fenced (_FENCED); is another worker using the id?"
    )


def test_translate_kafka_errors_chains_the_original():
    original = KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    with pytest.raises(
        BrokerError, match=r"committing offsets failed at rollout.trajectories\[1\]"
    ) as info:
        with translate_kafka_errors(
            "committing offsets", topic="rollout.trajectories", partition=1
        ):
            raise original
    assert info.value.__cause__ is original
    assert kafka_error_code(original) == KafkaError.UNKNOWN_TOPIC_OR_PART


def test_translate_kafka_errors_unwraps_confluent_kafkas_system_error():
    """A log line handed to Python while a KafkaException is pending raises SystemError
    caused by it: that is the Kafka failure. A SystemError of its own is a bug: as is."""
    original = KafkaException(KafkaError(KafkaError._TIMED_OUT, "late"))
    with pytest.raises(BrokerError, match=r"flushing failed: late \(_TIMED_OUT\)") as info:
        with translate_kafka_errors("flushing"):
            raise SystemError("returned a result with an error set") from original
    assert info.value.__cause__ is original
    with pytest.raises(SystemError, match="of its own"):
        with translate_kafka_errors("flushing"):
            raise SystemError("of its own")


def test_kafka_exception_without_a_kafka_error_is_still_described():
    assert (
        str(broker_error(KafkaException("odd"), "listing topics")) == "listing topics failed: odd"
    )
    assert kafka_error_code(KafkaException("odd")) is None


# --- partition end and consume errors -------------------------------------------------------


def test_a_record_passes_through():
    msg = Message(topic="t", partition=0, offset=5, value=b"v")
    assert record_or_partition_end(msg) is msg


def test_partition_eof_becomes_a_partition_end():
    msg = Message(topic="t", partition=1, offset=9, error=KafkaError(KafkaError._PARTITION_EOF))
    assert record_or_partition_end(msg) == PartitionEnd("t", 1, 9)


def test_any_other_consume_error_is_a_broker_error_with_its_location():
    msg = Message(
        topic="t",
        partition=1,
        offset=9,
        error=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not allowed"),
    )
    with pytest.raises(BrokerError, match=r"consuming failed at t\[1\]@9: not allowed"):
        record_or_partition_end(msg)


def test_record_position_of_a_record_and_of_a_message_without_one():
    assert record_position(Message(topic="t", partition=1, offset=9, value=b"v")) == (1, 9)
    with pytest.raises(BrokerError, match="without partition or offset: t"):
        record_position(Message(topic="t", value=b"v"))


# --- dead letters ---------------------------------------------------------------------------


def test_dead_letter_record_wraps_the_original_bytes_in_the_schema():
    record = dead_letter_record(
        "rollout.dlq",
        b"\x00raw",
        stage="replay_buffer",
        reason="bad event",
        source=record_location("rollout.turns", 0, 3),
        key="u1_0",
    )
    assert (record.topic, record.key) == ("rollout.dlq", "u1_0")
    letter = DeadLetter.model_validate(json.loads(record.value))
    assert letter.original == b"\x00raw"
    assert (letter.stage, letter.reason, letter.source) == (
        "replay_buffer",
        "bad event",
        "rollout.turns[0]@3",
    )


class _SettlingLeader:
    """Test double for a consumer whose partition leader is still being elected: its first
    ``failures`` watermark queries fail with ``code``, then it answers (5, 9)."""

    def __init__(self, failures: int, code: int = KafkaError.NOT_LEADER_FOR_PARTITION):
        self.failures, self.code, self.calls = failures, code, 0
        self.timeouts: list[float] = []

    def get_watermark_offsets(self, tp, timeout, cached):
        self.calls += 1
        self.timeouts.append(timeout)
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code, "Broker: Not leader for partition"))
        return 5, 9


def test_a_watermark_query_rides_out_a_leader_election():
    """A topic just created (or a leader moving) answers NOT_LEADER_FOR_PARTITION for a
    moment: the query retries it (seen failing a test in CI, right after topic creation)."""
    consumer = _SettlingLeader(failures=3)
    assert watermark_offsets(consumer, TopicPartition("t", 0), timeout_s=5.0) == (5, 9)
    assert consumer.calls == 4


def test_a_watermark_query_gives_up_at_its_timeout_and_on_other_errors_at_once():
    stuck = _SettlingLeader(failures=10**6)
    with pytest.raises(BrokerError, match=r"reading watermarks failed at t\[1\].*NOT_LEADER"):
        watermark_offsets(stuck, TopicPartition("t", 1), timeout_s=0.5)
    denied = _SettlingLeader(failures=1, code=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(BrokerError, match="TOPIC_AUTHORIZATION_FAILED"):
        watermark_offsets(denied, TopicPartition("t", 1), timeout_s=5.0)
    assert denied.calls == 1


def test_each_watermark_attempt_gets_only_the_time_left():
    """The timeout bounds the whole query: a retry waits at most what is left of it (a
    broker that hangs each attempt would otherwise make it last about twice as long)."""
    consumer = _SettlingLeader(failures=3)
    watermark_offsets(consumer, TopicPartition("t", 0), timeout_s=5.0)
    assert consumer.timeouts[0] <= 5.0
    assert all(later < first for first, later in itertools.pairwise(consumer.timeouts))
    assert consumer.timeouts[-1] <= 5.0 - 3 * 0.2 + 0.05


class _SettlingCoordinator:
    """Test double for a consumer whose group coordinator is still loading (a broker just
    started): its first ``failures`` committed-offset reads fail with ``code``."""

    def __init__(self, failures: int, code: int = KafkaError.NOT_COORDINATOR):
        self.failures, self.code, self.calls = failures, code, 0

    def committed(self, partitions, timeout):
        self.calls += 1
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code, "Broker: Not coordinator"))
        return [TopicPartition(tp.topic, tp.partition, 7) for tp in partitions]


def test_a_committed_offsets_read_rides_out_a_settling_coordinator():
    """A trainer started right after its broker read NOT_COORDINATOR and exited 1 (seen in
    tests/cli/test_cli_console.py): the read now retries it, and only it."""
    consumer = _SettlingCoordinator(failures=3)
    [tp] = committed_offsets(consumer, [TopicPartition("t", 0)], timeout_s=5.0)
    assert tp.offset == 7 and consumer.calls == 4
    loading = _SettlingCoordinator(failures=1, code=KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    committed_offsets(loading, [TopicPartition("t", 0)], timeout_s=5.0)
    assert loading.calls == 2
    denied = _SettlingCoordinator(failures=1, code=KafkaError.GROUP_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        committed_offsets(denied, [TopicPartition("t", 0)], timeout_s=5.0)
    assert denied.calls == 1
    stuck = _SettlingCoordinator(failures=10**6)
    with pytest.raises(KafkaException):
        committed_offsets(stuck, [TopicPartition("t", 0)], timeout_s=0.5)
