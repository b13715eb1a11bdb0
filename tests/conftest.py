"""Shared fixtures: one real Kafka broker per test session, fresh topics per test.

- ``kafka_bootstrap`` (session): ``$ROLLOUTBUS_TEST_BOOTSTRAP`` if set (an external broker,
  as CI may provide), else the project's embedded broker started on free ports with its
  data in a temporary folder, stopped at the end of the session. It never skips: a
  broker that cannot start fails the tests that need it, with the reason.
- ``embedded_broker`` (session): the embedded broker's Config, or None when external.
- ``kafka_config``: a KafkaConfig with a unique topic prefix, partitions=2, and the five
  rollout topics created (deleted again after the test).
- ``make_producer`` / ``make_consumer``: confluent-kafka client factories, cleaned up at
  teardown; each consumer gets a unique group.id and reads from the earliest offset.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from helpers import free_port, unique_name

from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.kafka.broker import broker_status, start_broker, stop_broker
from rolloutbus.topics import Topics

BOOTSTRAP_ENV = "ROLLOUTBUS_TEST_BOOTSTRAP"
TEST_PARTITIONS = 2  # enough to catch partitioning bugs, cheap to create per test
PORT_RETRIES = 3  # a free port can be taken by another process before the JVM binds it
PRODUCER_FLUSH_S = 10.0  # seconds a producer may take to deliver at teardown
WATCHDOG_EXIT_S = 10.0  # seconds; the watchdog polls once a second
BROKER_FIXTURES = frozenset({"embedded_broker", "kafka_bootstrap"})  # every Kafka fixture needs one


@pytest.hookimpl(tryfirst=True)  # before the mark plugin applies -m to the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``kafka`` every test whose fixture closure reaches the session broker, so
    ``-m "not kafka"`` runs the fast suite without ever starting one. Tests that reach
    Kafka some other way (a JVM of their own) carry the marker explicitly."""
    for item in items:
        if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def embedded_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config | None]:
    if os.environ.get(BOOTSTRAP_ENV):
        yield None
        return
    cfg = _start_on_free_ports(tmp_path_factory)
    _watch_for_killed_session(broker_status(cfg).pid)
    try:
        yield cfg
    finally:
        stop_broker(cfg)
        _reap_watchdogs()


def _start_on_free_ports(tmp_path_factory: pytest.TempPathFactory) -> Config:
    # A free port can be taken by another process before the JVM binds it: retry then,
    # with fresh ports and a fresh data dir (KRaft storage records the controller port).
    for _ in range(PORT_RETRIES - 1):
        cfg = _embedded_config(tmp_path_factory)
        try:
            start_broker(cfg)
        except BrokerError as exc:
            if "already in use" not in str(exc):
                raise
            continue
        return cfg
    cfg = _embedded_config(tmp_path_factory)
    start_broker(cfg)
    return cfg


def _embedded_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    port = controller_port = free_port()
    while controller_port == port:  # the OS may hand out a just-released port again
        controller_port = free_port()
    broker = BrokerConfig(
        data_dir=tmp_path_factory.mktemp("kafka"),
        port=port,
        controller_port=controller_port,
        start_timeout_s=120.0,  # seconds; two cores shared with other test sessions
    )
    return Config(broker=broker, kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"))


# The broker runs detached, so a test session killed with SIGKILL (a CI timeout, the OOM
# killer) would leave it behind. This watchdog, a detached Python process of its own,
# sends it SIGTERM once the session's pid is gone; it exits when the broker does.
_WATCHDOG = """
import os, signal, sys, time
session, jvm = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
while alive(jvm):
    if not alive(session):
        os.kill(jvm, signal.SIGTERM)
        break
    time.sleep(1.0)
"""


_watchdogs: list[subprocess.Popen[bytes]] = []  # referenced, so never collected while running


def _watch_for_killed_session(jvm_pid: int | None) -> None:
    if jvm_pid is None:
        return
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(jvm_pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _watchdogs.append(watchdog)


def _reap_watchdogs() -> None:
    """The broker is stopped, so each watchdog exits at its next poll: wait for it (a
    process never waited for is a ResourceWarning, an error in this suite)."""
    for watchdog in _watchdogs:
        try:
            watchdog.wait(timeout=WATCHDOG_EXIT_S)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()


@pytest.fixture(scope="session")
def kafka_bootstrap(embedded_broker: Config | None) -> str:
    if embedded_broker is None:
        return os.environ[BOOTSTRAP_ENV]
    return embedded_broker.kafka.bootstrap_servers


@pytest.fixture
def kafka_config(kafka_bootstrap: str) -> Iterator[KafkaConfig]:
    kafka = KafkaConfig(
        bootstrap_servers=kafka_bootstrap, topic_prefix=unique_name("t"), partitions=TEST_PARTITIONS
    )
    ensure_topics(kafka)
    yield kafka
    delete_topics(kafka, Topics.from_config(kafka).all())


@pytest.fixture
def make_producer(kafka_bootstrap: str) -> Iterator[Callable[..., Producer]]:
    """``make_producer(extra=None, kafka=None)``: a Producer for the test broker.

    Large records are allowed up to KafkaConfig's max_message_bytes (librdkafka's own
    default is 1 MB); ``extra`` overrides or adds librdkafka settings.
    """
    producers: list[Producer] = []

    def make(extra: dict[str, Any] | None = None, kafka: KafkaConfig | None = None) -> Producer:
        kafka = kafka or KafkaConfig(bootstrap_servers=kafka_bootstrap)
        conf = {
            **kafka.client_settings(),
            "message.max.bytes": kafka.max_message_bytes,
            **(extra or {}),
        }
        producer = Producer(conf)
        producers.append(producer)
        return producer

    yield make
    for producer in producers:
        producer.flush(PRODUCER_FLUSH_S)


@pytest.fixture
def make_consumer(kafka_bootstrap: str) -> Iterator[Callable[..., Consumer]]:
    """``make_consumer(extra=None, topics=None, kafka=None)``: a Consumer with a fresh group.

    Subscribes to ``topics`` when given; closed at teardown.
    """
    consumers: list[Consumer] = []

    def make(
        extra: dict[str, Any] | None = None,
        topics: list[str] | None = None,
        kafka: KafkaConfig | None = None,
    ) -> Consumer:
        kafka = kafka or KafkaConfig(bootstrap_servers=kafka_bootstrap)
        conf = {
            **kafka.client_settings(),
            "group.id": unique_name("g"),
            "auto.offset.reset": "earliest",
            **(extra or {}),
        }
        consumer = Consumer(conf)
        consumers.append(consumer)
        if topics:
            consumer.subscribe(topics)
        return consumer

    yield make
    for consumer in consumers:
        consumer.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault-injection table (tests/faults_harness.py), when fault scenarios ran."""
    harness = sys.modules.get("faults_harness")
    rows = getattr(harness, "ROWS", None)
    if not rows:
        return
    terminalreporter.section("fault injection")
    for line in harness.format_table(rows):
        terminalreporter.write_line(line)
