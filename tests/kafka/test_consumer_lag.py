"""Lag in records counts what a read_committed reader would get (rolloutbus/kafka/consumer_lag.py),
against the real broker: a transactional topic's markers and aborted records take offsets
but are no records, so a caught-up reader lags 0 and one with 3 records left lags 3."""

from __future__ import annotations

from confluent_kafka import Consumer, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.kafka.clients import transactional_producer
from rolloutbus.kafka.consumer_lag import EXACT_COUNT_OFFSETS, LagReader
from rolloutbus.topics import Topics
from tests.helpers import unique_name

PARTITION = 1


def _write_transactions(kafka: KafkaConfig, topic: str, sizes: list[int], abort: set[int]) -> None:
    producer = transactional_producer(kafka, unique_name("lag-tx"))
    producer.init_transactions(30)
    for i, size in enumerate(sizes):
        producer.begin_transaction()
        for j in range(size):
            producer.produce(topic, key=f"k{i}-{j}".encode(), value=b"v", partition=PARTITION)
        if i in abort:
            # delivered first: an abort racing the first produce's AddPartitionsToTxn can
            # reach the coordinator while the transaction is still Empty, and librdkafka
            # makes that INVALID_TXN_STATE fatal (confluentinc/librdkafka#4849); it also
            # makes the aborted records take their offsets, as the test counts them
            producer.flush(30)
            producer.abort_transaction(30)
        else:
            producer.commit_transaction(30)
    producer.flush(30)


def _commit(kafka: KafkaConfig, group: str, topic: str, offset: int) -> None:
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    try:
        consumer.commit(offsets=[TopicPartition(topic, PARTITION, offset)], asynchronous=False)
    finally:
        consumer.close()


def _lag(kafka: KafkaConfig, group: str, topic: str) -> int:
    reader = LagReader(kafka)
    try:
        [row] = reader.read({group: topic})
    finally:
        reader.close()
    [part] = [p for p in row.partitions if p.partition == PARTITION]
    return part.lag_records


def test_markers_and_aborted_records_are_not_lag(kafka_config: KafkaConfig):
    topic = Topics.from_config(kafka_config).trajectories
    # offsets: 3 records + marker (0-3), 2 aborted + marker (4-6), 3 records + marker (7-10)
    _write_transactions(kafka_config, topic, [3, 2, 3], abort={1})
    group = unique_name("lag-group")
    _commit(kafka_config, group, topic, 1)  # read the first record only
    assert _lag(kafka_config, group, topic) == 5  # 2 + 3 committed records; the offsets are 10
    _commit(kafka_config, group, topic, 4)  # read the whole first transaction
    assert _lag(kafka_config, group, topic) == 3
    _commit(kafka_config, group, topic, 10)  # read everything: only the last marker follows
    assert _lag(kafka_config, group, topic) == 0


def test_past_the_exact_count_the_offsets_stand(kafka_config: KafkaConfig):
    topic = Topics.from_config(kafka_config).trajectories
    many = EXACT_COUNT_OFFSETS + 10
    _write_transactions(kafka_config, topic, [many, 1], abort=set())
    group = unique_name("lag-group")
    _commit(kafka_config, group, topic, 0)
    assert _lag(kafka_config, group, topic) == many + 3  # records and both markers
    _commit(kafka_config, group, topic, many)  # the first marker, one record, a marker left
    assert _lag(kafka_config, group, topic) == 1
