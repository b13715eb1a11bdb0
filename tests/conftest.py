"""Shared fixtures: one real Kafka broker per test session (per xdist worker), fresh topics.

- ``kafka_bootstrap`` (session): ``$ROLLOUTBUS_TEST_BOOTSTRAP`` if set (an external broker,
  as CI may provide), else the project's embedded broker started on free ports with its
  data in a temporary folder, stopped at the end of the session. It never skips: a
  broker that cannot start fails the tests that need it, with the reason.
- ``embedded_broker`` (session): the embedded broker's Config, or None when external.
- ``kafka_config``: a KafkaConfig with a unique topic prefix, partitions=2, and the five
  rollout topics created (deleted again after the test).
- ``tok`` (session): the real Qwen3 tokenizer, for tests that render prompts or count tokens.
- ``seed0`` / ``seed1`` (session): tiny-qwen3's weights at seeds 0 (what an embedded
  tiny-qwen3 replica starts with) and 1 (other weights of the same architecture);
  ``seed0_folder`` / ``seed1_folder``: the same saved as a trainer saves them, for reloads.
- ``make_producer`` / ``make_consumer``: confluent-kafka client factories, cleaned up at
  teardown; each consumer gets a unique group.id and reads from the earliest offset.

A fixture that only one area's tests use lives in that area's ``conftest.py``
(``verl_compat/``: the verl side environment; ``assembly/``: a replay buffer run in a thread).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer

from rolloutbus.broker.embedded import broker_status, stop_broker
from rolloutbus.config import Config, KafkaConfig
from rolloutbus.kafka.admin import delete_topics, ensure_topics
from rolloutbus.topics import Topics
from tests.helpers import unique_name
from tests.processes_left import name_processes_left_running
from tests.session_broker import (
    reap_watchdogs,
    start_on_free_ports,
    watch_for_killed_session,
)

atexit.register(name_processes_left_running, "at exit")

BOOTSTRAP_ENV = "ROLLOUTBUS_TEST_BOOTSTRAP"
TEST_PARTITIONS = 2  # enough to catch partitioning bugs, cheap to create per test
PRODUCER_FLUSH_S = 10.0  # seconds a producer may take to deliver at teardown
BROKER_FIXTURES = frozenset({"embedded_broker", "kafka_bootstrap"})  # every Kafka fixture needs one


@pytest.hookimpl(tryfirst=True)  # before the mark plugin applies -m to the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``kafka`` every test whose fixture closure reaches the session broker, so
    ``-m "not kafka"`` runs the fast suite without ever starting one. Tests that reach
    Kafka some other way (a JVM of their own) carry the marker explicitly."""
    for item in items:
        if BROKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # in one process, the files' own order
        heaviest_files_first(items)


# The order in which pytest-xdist's workers take files (``TEST_WORKERS=2 bash ops/test.sh``
# runs ``-n 2 --dist loadfile``): a worker takes the next whole file when it is free, so
# the longest files start first and the short ones fill the gaps at the end. Seconds per
# file come from a recent run (file_seconds.json, written by ops/file_seconds.py); a file
# not in it is estimated from its tests' markers.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
COST_S = {"slow": 40.0, "vllm": 60.0, "kafka": 3.0}  # rough seconds per test, by marker


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` by the cost of their file, most first, keeping each file's tests
    together and in order (module fixtures rely on it)."""
    measured = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    estimated: dict[str, float] = {}
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        each = max((COST_S[m] for m in marks & COST_S.keys()), default=0.1)
        path = _file_of(item)
        estimated[path] = estimated.get(path, 0.0) + each
    cost = {path: measured.get(path, guess) for path, guess in estimated.items()}
    items.sort(key=lambda item: -cost[_file_of(item)])  # stable: a file's order is kept


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session")
def embedded_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config | None]:
    if os.environ.get(BOOTSTRAP_ENV):
        yield None
        return
    cfg = start_on_free_ports(tmp_path_factory)
    watch_for_killed_session(broker_status(cfg).pid)
    try:
        yield cfg
    finally:
        stop_broker(cfg)
        reap_watchdogs()


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


@pytest.fixture(scope="session")
def tok() -> Any:
    """The real Qwen3 tokenizer with its chat template (``tiny-qwen3``'s), loaded once: the
    agent-loop, gateway, reward and Continuous Token tests render and count with it."""
    from tests.scripted_server import qwen3_tokenizer

    return qwen3_tokenizer()


@pytest.fixture(scope="session")
def seed0() -> Any:
    """tiny-qwen3 at seed 0: the weights an embedded tiny-qwen3 replica starts with."""
    return _tiny_qwen3(seed=0)


@pytest.fixture(scope="session")
def seed1() -> Any:
    """tiny-qwen3 at seed 1: other weights for the same architecture, as after a train step."""
    return _tiny_qwen3(seed=1)


@pytest.fixture(scope="module")
def tiny_replica() -> Iterator[Any]:
    """An embedded tiny-qwen3 replica at seed 0 in a thread of this process (port chosen
    free), for the tests that load weights into one and read what it serves."""
    from rolloutbus.config import ModelConfig, ReplicaServerConfig
    from rolloutbus.replica.server import replica_in_thread

    cfg = Config(
        model=ModelConfig(name="tiny-qwen3", seed=0),
        replica_server=ReplicaServerConfig(port=0, max_batch_size=4, torch_threads=1),
    )
    with replica_in_thread(cfg) as handle:
        yield handle


@pytest.fixture(scope="session")
def seed0_folder(seed0: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed 0's weights saved as the trainer saves them: puts a replica's first weights back."""
    folder = tmp_path_factory.mktemp("seed0")
    seed0.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def seed1_folder(seed1: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed 1's weights saved as the trainer saves them: what a weight sync loads."""
    folder = tmp_path_factory.mktemp("seed1")
    seed1.save_pretrained(str(folder))
    return folder


def _tiny_qwen3(seed: int) -> Any:
    from rolloutbus.config import ModelConfig
    from rolloutbus.models.causal_lm import load_causal_lm

    return load_causal_lm(ModelConfig(name="tiny-qwen3", seed=seed))[0]


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
    """The fault-injection table (the harness package tests/faults/), when fault scenarios
    ran: here, or in pytest-xdist's workers (``pytest_testnodedown`` gathered theirs)."""
    rows = [*_rows_measured_here(), *_ROWS_FROM_WORKERS]
    if not rows:
        return
    from tests.faults.table import format_table

    terminalreporter.section("fault injection")
    for line in format_table(rows):
        terminalreporter.write_line(line)


# Rows measured by pytest-xdist's workers, sent back when each one ends (workeroutput).
_ROWS_FROM_WORKERS: list[Any] = []


def _rows_measured_here() -> list[Any]:
    harness = sys.modules.get("tests.faults.table")
    return list(getattr(harness, "ROWS", []))


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the table
        workeroutput["fault_rows"] = [dataclasses.asdict(row) for row in _rows_measured_here()]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_testnodedown(node: Any, error: Any) -> None:
    """Called in the xdist controller when a worker ends (pytest-xdist's hook)."""
    from tests.faults.table import FaultRow

    rows = getattr(node, "workeroutput", {}).get("fault_rows", [])
    _ROWS_FROM_WORKERS.extend(FaultRow(**row) for row in rows)
