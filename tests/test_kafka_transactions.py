"""The transaction seam (``rolloutbus/kafka/transactions.py``) and the replay buffer's use of
it, against the real broker: a fatal transaction error replaces the producer and the next
transaction commits, with nothing of the failed one visible; a live process holding the
same transactional id is told apart from a one-off fencing; a static member that restarts
takes its partitions back without waiting for the dead one's session to expire.

Fatal errors are provoked the way Kafka makes them: a second producer with the same
``transactional.id`` runs ``init_transactions`` (as a restarted process does), which fences
the first (PRODUCER_FENCED, fatal in librdkafka). A SIGKILLed broker (``INVALID_TXN_STATE``
from ``abort_transaction``) takes the same path; ``tests/test_faults.py`` kills one.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition
from helpers import unique_name
from pipeline import read_topic, running, spawn, write_config
from prometheus_client import CollectorRegistry
from synthetic import N, group_events

from rolloutbus.config import Config, KafkaConfig, with_overrides
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import (
    idempotent_producer,
    read_committed_consumer,
    transactional_producer,
)
from rolloutbus.kafka.transactions import (
    OutgoingRecord,
    TransactionAborted,
    TransactionalProducer,
    TransactionSettings,
)
from rolloutbus.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.replay_buffer import (
    ReplayBuffer,
    consumer_overrides,
    transactional_id_of,
)
from rolloutbus.topics import Topics, partition_for

WAIT_S = 120.0  # seconds for a buffer to release what was produced (two busy cores)
# seconds of replay_buffer.session_timeout_s in the takeover test: far longer than a
# restart takes, so a release before it expires can only come from static membership
LONG_SESSION_S = 120.0
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


# -- the replay buffer ---------------------------------------------------------------------


def _config(kafka: KafkaConfig, **overrides) -> Config:
    return with_overrides(
        Config(kafka=kafka), {"replay_buffer.group_id": unique_name("rb"), **overrides}
    )


def _produce(kafka: KafkaConfig, uids: list[str]) -> None:
    producer = idempotent_producer(kafka, {"linger.ms": 5})
    topic = Topics.from_config(kafka).turns
    for uid in uids:
        for _, key, value in group_events(uid):
            producer.produce(
                topic, key=key, value=value, partition=partition_for(uid, kafka.partitions)
            )
    assert producer.flush(30) == 0


def _keys(cfg: Config) -> list[str]:
    return [m.key().decode() for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories)]


def _wait_for_keys(cfg: Config, uids: list[str], alive=lambda: True) -> list[str]:
    wanted = {f"{uid}_{s}_0" for uid in uids for s in range(N)}
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        keys = _keys(cfg)
        if wanted <= set(keys):
            time.sleep(2)  # a duplicate, if any, has the time to appear
            return _keys(cfg)
        assert alive(), "the replay buffer ended"
        time.sleep(0.5)
    raise AssertionError(f"not released within {WAIT_S} s: {sorted(wanted - set(_keys(cfg)))[:5]}")


@contextmanager
def _buffer_thread(cfg: Config, metrics: ReplayBufferMetrics) -> Iterator[threading.Thread]:
    buffer = ReplayBuffer(cfg, metrics=metrics)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            buffer.run()
        except BaseException as exc:  # reported on the test's thread below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        buffer.stop()
        thread.join(60)
    assert not errors, errors


def test_the_replay_buffer_replaces_a_fenced_producer_and_releases_each_group_once(
    kafka_config: KafkaConfig,
):
    """Before the seam, a fatal transaction error ended the replay buffer's process."""
    cfg = _config(kafka_config, **{"replay_buffer.transactional_id": unique_name("pinned")})
    metrics = ReplayBufferMetrics(CollectorRegistry())
    first = [f"g{uuid.uuid4().hex[:10]}" for _ in range(4)]
    later = [f"h{uuid.uuid4().hex[:10]}" for _ in range(4)]
    with _buffer_thread(cfg, metrics) as thread:
        _produce(kafka_config, first)
        _wait_for_keys(cfg, first, thread.is_alive)
        _fence(kafka_config, cfg.replay_buffer.transactional_id)  # once, as a restart does
        _produce(kafka_config, later)
        keys = _wait_for_keys(cfg, first + later, thread.is_alive)
    assert len(keys) == len(set(keys)) == len(first + later) * N  # each exactly once
    assert metrics.producer_replacements.labels(cause="fatal")._value.get() == 1


def test_a_static_member_gets_its_transactional_id_and_membership_from_its_name():
    cfg = _config(KafkaConfig(), **{"replay_buffer.group_instance_id": "rb-3"})
    assert transactional_id_of(cfg) == f"{cfg.replay_buffer.group_id}-rb-3"  # same on restart
    overrides = consumer_overrides(cfg)
    assert overrides["group.instance.id"] == "rb-3" and overrides["session.timeout.ms"] == 10_000
    dynamic = _config(KafkaConfig())
    assert transactional_id_of(dynamic) != transactional_id_of(dynamic)  # one per process
    assert "group.instance.id" not in consumer_overrides(dynamic)


@pytest.mark.slow
def test_a_restarted_static_member_takes_over_before_the_dead_ones_session_expires(
    kafka_config: KafkaConfig, tmp_path
):
    """SIGKILL a replay buffer with an open transaction likely; restart it under the same
    ``group_instance_id``. Its partitions come back at once (no rebalance waiting for the
    dead member's session, here LONG_SESSION_S), and its init_transactions ends the dead
    process's open transaction, which would otherwise hold the released topic's readers
    for transaction_timeout_s (also long here)."""
    cfg = _config(
        kafka_config,
        **{
            "replay_buffer.group_instance_id": "rb0",
            "replay_buffer.session_timeout_s": LONG_SESSION_S,
            "replay_buffer.transaction_timeout_s": LONG_SESSION_S,
        },
    )
    config_path = write_config(cfg, tmp_path / "c.yaml")
    before = [f"g{uuid.uuid4().hex[:10]}" for _ in range(6)]
    after = [f"h{uuid.uuid4().hex[:10]}" for _ in range(6)]
    with running([spawn(["replay-buffer", "run"], config_path, tmp_path / "rb.1.log")]) as [dead]:
        _produce(kafka_config, before)
        _wait_for_keys(cfg, before, lambda: dead.poll() is None)
        dead.send_signal(signal.SIGKILL)
        dead.wait()
    killed_at = time.monotonic()
    _produce(kafka_config, after)
    with running([spawn(["replay-buffer", "run"], config_path, tmp_path / "rb.2.log")]) as [new]:
        keys = _wait_for_keys(cfg, before + after, lambda: new.poll() is None)
        took = time.monotonic() - killed_at
    assert took < LONG_SESSION_S, f"took {took:.0f} s: the dead member's session had to expire"
    assert len(keys) == len(set(keys)) == len(before + after) * N
