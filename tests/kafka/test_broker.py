"""The embedded broker and topic administration, against a real Kafka broker."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from rolloutbus.broker import embedded as broker
from rolloutbus.broker import jars
from rolloutbus.broker.embedded import (
    broker_status,
    server_properties,
    start_broker,
    stop_broker,
)
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.admin import delete_topics, ensure_topics, topic_partitions
from rolloutbus.topics import Topics
from tests.helpers import free_port, run_cli, unique_name

LARGE_RECORD_BYTES = 2 * 1024 * 1024  # over every 1 MB Kafka/librdkafka default
POLL_TIMEOUT_S = 30.0  # seconds to wait for a record that was just produced
BROKER_CLI_S = 300.0  # seconds for `rolloutbus broker start` of three nodes on two cores


def _describe_topic_configs(kafka: KafkaConfig, name: str) -> dict[str, str]:
    admin = AdminClient(kafka.client_settings())
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, name)])
    (entries,) = (f.result() for f in futures.values())
    return {key: entry.value for key, entry in entries.items()}


def _partition_counts(kafka: KafkaConfig) -> dict[str, int]:
    topics = AdminClient(kafka.client_settings()).list_topics(timeout=10).topics
    return {name: len(meta.partitions) for name, meta in topics.items()}


def _consume_one(consumer, timeout_s: float = POLL_TIMEOUT_S):
    msg = consumer.poll(timeout_s)
    assert msg is not None, f"no record within {timeout_s} s"
    assert msg.error() is None, msg.error()
    return msg


# --- the running broker -------------------------------------------------------------------


def test_status_reports_running(embedded_broker: Config | None, kafka_bootstrap: str) -> None:
    if embedded_broker is None:  # external broker: all we can check is that it answers
        AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
        return
    status = broker_status(embedded_broker)
    assert status.running
    assert status.pid is not None
    assert status.bootstrap == kafka_bootstrap
    assert status.data_dir == embedded_broker.broker.data_dir.resolve()
    assert (status.data_dir / "logs" / "server.log").exists()


def test_start_when_running_returns_the_same_broker(embedded_broker: Config | None) -> None:
    if embedded_broker is None:
        return
    before = broker_status(embedded_broker)
    again = start_broker(embedded_broker)
    assert again.running and again.pid == before.pid


# --- topics ---------------------------------------------------------------------------------


def test_ensure_topics_creates_all_five(kafka_bootstrap: str) -> None:
    kafka = KafkaConfig(
        bootstrap_servers=kafka_bootstrap, topic_prefix=unique_name("t"), partitions=3
    )
    topics = Topics.from_config(kafka)
    try:
        assert ensure_topics(kafka) == topics.all()
        counts = _partition_counts(kafka)
        assert {name: counts[name] for name in topics.all()} == topic_partitions(kafka)
        assert counts[topics.turns] == 3 and counts[topics.control] == 1
    finally:
        delete_topics(kafka, topics.all())


FRESH_TOPIC_ROUNDS = 6  # fresh topic sets per run: 5 topics each, about 3 s a set


def test_the_first_records_to_fresh_topics_are_all_kept(
    kafka_bootstrap: str, make_producer
) -> None:
    """ensure_topics returns only once every new partition's leader answers. Before that,
    metadata can name a leader that does not lead yet, and an idempotent producer's first
    batch there came back "delivered" with no offset and was lost (about one fresh topic in
    150 under load: every producer of the bus writes a fresh topic on a first run)."""
    for _ in range(FRESH_TOPIC_ROUNDS):
        kafka = KafkaConfig(
            bootstrap_servers=kafka_bootstrap, topic_prefix=unique_name("fresh"), partitions=3
        )
        topics = Topics.from_config(kafka)
        try:
            ensure_topics(kafka)
            offsets = _produce_first_records(make_producer, kafka, topics.turns)
            assert all(offset is not None and offset >= 0 for offset in offsets), offsets
            assert _count_records(kafka, topics.turns, 3) == len(offsets)
        finally:
            delete_topics(kafka, topics.all())


def _produce_first_records(make_producer, kafka: KafkaConfig, topic: str) -> list[int | None]:
    """Two records per partition right after creation, one per batch, from an idempotent
    producer (the turn log's settings); their delivered offsets."""
    producer = make_producer(
        {"enable.idempotence": True, "linger.ms": 0, "batch.num.messages": 1}, kafka
    )
    offsets: list[int | None] = []

    def delivered(err, msg) -> None:
        assert err is None, err
        offsets.append(msg.offset())

    for partition in range(3):
        for i in range(2):
            producer.produce(
                topic, f"{partition}-{i}".encode(), partition=partition, on_delivery=delivered
            )
    assert producer.flush(POLL_TIMEOUT_S) == 0
    return offsets


def _count_records(kafka: KafkaConfig, topic: str, partitions: int) -> int:
    consumer = Consumer(
        {**kafka.client_settings(), "group.id": unique_name("count"), "enable.partition.eof": True}
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    records, ends = 0, 0
    while ends < partitions:
        msg = consumer.poll(POLL_TIMEOUT_S)
        assert msg is not None, f"{topic} not read to its end within {POLL_TIMEOUT_S} s"
        if msg.error() is None:
            records += 1
        elif msg.error().code() == KafkaError._PARTITION_EOF:
            ends += 1
        else:
            raise AssertionError(msg.error())
    consumer.close()
    return records


def test_ensure_topics_is_idempotent(kafka_config: KafkaConfig) -> None:
    assert ensure_topics(kafka_config) == []  # the fixture already created them
    assert ensure_topics(kafka_config) == []


def test_topics_carry_size_retention_and_cleanup(kafka_config: KafkaConfig) -> None:
    released = Topics.from_config(kafka_config).released
    control = Topics.from_config(kafka_config).control
    for name in Topics.from_config(kafka_config).all():
        configs = _describe_topic_configs(kafka_config, name)
        assert configs["max.message.bytes"] == str(kafka_config.max_message_bytes), name
        if name == released:  # one record per uid, kept longer than the turns it names
            assert configs["cleanup.policy"] == "compact,delete"
            assert int(configs["retention.ms"]) > kafka_config.retention_ms
        else:
            assert configs["retention.ms"] == str(kafka_config.retention_ms), name
            # control: one record per event type, the latest policy version kept forever
            assert configs["cleanup.policy"] == ("compact" if name == control else "delete"), name


def test_partition_count_mismatch_names_topic(kafka_config: KafkaConfig) -> None:
    other = kafka_config.model_copy(update={"partitions": 3})
    with pytest.raises(BrokerError) as info:
        ensure_topics(other)
    message = str(info.value)
    assert Topics.from_config(kafka_config).prompts in message
    assert "2 partitions" in message and "asks for 3" in message


def test_delete_topics_ignores_missing(kafka_bootstrap: str) -> None:
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap)
    delete_topics(kafka, [unique_name("missing")])


def test_unreachable_bootstrap_gives_broker_error() -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=unique_name("t"))
    with pytest.raises(BrokerError, match=bootstrap) as info:
        ensure_topics(kafka, timeout_s=2.0)
    assert kafka.topic_prefix in str(info.value)


# --- records ------------------------------------------------------------------------------


def test_two_megabyte_record_round_trip(
    kafka_config: KafkaConfig, make_producer, make_consumer
) -> None:
    topic = Topics.from_config(kafka_config).turns
    payload = bytes(range(256)) * (LARGE_RECORD_BYTES // 256)
    producer = make_producer(kafka=kafka_config)
    errors = []
    producer.produce(
        topic,
        key=b"u1_0",
        value=payload,
        partition=1,
        on_delivery=lambda err, msg: errors.append(err),
    )
    assert producer.flush(POLL_TIMEOUT_S) == 0
    assert errors == [None]
    consumer = make_consumer(kafka=kafka_config)
    consumer.assign([TopicPartition(topic, 1, 0)])
    msg = _consume_one(consumer)
    assert msg.key() == b"u1_0"
    assert msg.value() == payload


# --- start-up checks that need no JVM -------------------------------------------------------


@pytest.mark.parametrize("busy", ["port", "controller_port"])
def test_busy_port_is_named_before_any_jvm_starts(tmp_path: Path, busy: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy_port = listener.getsockname()[1]
        ports = {"port": free_port(), "controller_port": free_port(), busy: busy_port}
        cfg = Config(broker=BrokerConfig(data_dir=tmp_path, **ports))
        with pytest.raises(BrokerError) as info:
            start_broker(cfg)
    message = str(info.value)
    assert f"port {busy_port}" in message and f"broker.{busy}" in message
    assert "rolloutbus broker stop" in message
    assert not (tmp_path / "server.properties").exists()  # failed before writing or launching
    assert broker_status(cfg).pid is None


def test_server_properties_allow_large_records(tmp_path: Path) -> None:
    cfg = Config(
        kafka=KafkaConfig(max_message_bytes=32 * 1024 * 1024),
        broker=BrokerConfig(port=29092, controller_port=29093),
    )
    props = dict(
        line.split("=", 1)
        for line in server_properties(cfg, tmp_path).splitlines()
        if line and not line.startswith("#")
    )
    assert int(props["message.max.bytes"]) >= 32 * 1024 * 1024
    assert int(props["replica.fetch.max.bytes"]) >= 32 * 1024 * 1024
    assert int(props["socket.request.max.bytes"]) > 32 * 1024 * 1024
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["log.dirs"] == str(tmp_path / "kraft-logs")
    assert props["auto.create.topics.enable"] == "false"
    assert props["transaction.state.log.replication.factor"] == "1"


def test_missing_tools_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_which = shutil.which
    monkeypatch.setattr(jars, "kafka_libs_dir", lambda: tmp_path / "libs")  # not fetched
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "mvn" else real_which(name))
    with pytest.raises(BrokerError, match="`mvn` not found"):
        jars.fetch_kafka_jars()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(BrokerError, match="`java` not found.*Java 17"):
        jars.fetch_kafka_jars()


def test_java_version_parsing() -> None:
    assert jars.parse_java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert jars.parse_java_major('openjdk version "21" 2023-09-19') == 21
    assert jars.parse_java_major('java version "1.8.0_392"') == 8
    assert jars.parse_java_major("no version here") is None


@pytest.mark.kafka  # launches a Kafka JVM of its own (it exits at start-up)
def test_jvm_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    # A heap too small for the JVM to initialise: it exits at once, after formatting.
    cfg = Config(
        broker=BrokerConfig(
            data_dir=tmp_path, port=free_port(), controller_port=free_port(), heap="1k"
        )
    )
    with pytest.raises(BrokerError, match="exited during start-up") as info:
        start_broker(cfg)
    assert "stdout.log" in str(info.value) and "heap" in str(info.value).lower()
    assert not (tmp_path / "broker.pid").exists()


# --- a second broker of its own: restart keeps the data -------------------------------------


@pytest.mark.slow
@pytest.mark.kafka  # a second broker of its own
def test_restart_keeps_topics_and_records(tmp_path: Path, make_producer) -> None:
    port = free_port()
    cfg = Config(
        broker=BrokerConfig(
            data_dir=tmp_path / "kafka",
            port=port,
            controller_port=free_port(),
            heap="256m",
            start_timeout_s=120.0,
        ),
        kafka=KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="r", partitions=1),
    )
    try:
        assert start_broker(cfg).running
        assert ensure_topics(cfg.kafka) == Topics.from_config(cfg.kafka).all()
        producer = make_producer(kafka=cfg.kafka)
        producer.produce("r.turns", key=b"k", value=b"survives")
        assert producer.flush(POLL_TIMEOUT_S) == 0

        assert stop_broker(cfg) is True
        assert broker_status(cfg) == broker.BrokerStatus(
            False, None, cfg.kafka.bootstrap_servers, cfg.broker.data_dir.resolve()
        )
        assert stop_broker(cfg) is False

        assert start_broker(cfg).running
        assert ensure_topics(cfg.kafka) == []
        # Not the make_consumer fixture: this consumer must close before its broker stops.
        consumer = Consumer({**cfg.kafka.client_settings(), "group.id": unique_name("g")})
        try:
            consumer.assign([TopicPartition("r.turns", 0, 0)])
            assert _consume_one(consumer).value() == b"survives"
        finally:
            consumer.close()
    finally:
        stop_broker(cfg)


# --- a cluster of three nodes ---------------------------------------------------------------


def _props(cfg: Config, data_dir: Path, node_index: int = 0) -> dict[str, str]:
    from rolloutbus.broker.properties import broker_nodes

    nodes = broker_nodes(cfg, data_dir)
    text = server_properties(cfg, data_dir, nodes[node_index], nodes)
    return dict(line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")


def test_three_nodes_have_their_own_ports_data_and_one_static_quorum(tmp_path: Path) -> None:
    cfg = Config(broker=BrokerConfig(port=29092, controller_port=29093, nodes=3))
    second = _props(cfg, tmp_path, 1)
    assert second["node.id"] == "2"
    assert second["listeners"] == "PLAINTEXT://127.0.0.1:29094,CONTROLLER://127.0.0.1:29095"
    assert second["log.dirs"] == str(tmp_path / "node2" / "kraft-logs")
    assert second["controller.quorum.voters"] == (
        "1@127.0.0.1:29093,2@127.0.0.1:29095,3@127.0.0.1:29097"
    )
    assert "controller.quorum.bootstrap.servers" not in second
    # internal topics survive a broker: three replicas, two in sync for a write
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "default.replication.factor",
    ):
        assert second[key] == "3", key
    assert second["transaction.state.log.min.isr"] == second["min.insync.replicas"] == "2"
    assert second["unclean.leader.election.enable"] == "false"
    single = _props(Config(broker=BrokerConfig(port=29092, controller_port=29093)), tmp_path)
    assert single["transaction.state.log.min.isr"] == single["min.insync.replicas"] == "1"
    assert single["controller.quorum.bootstrap.servers"] == "127.0.0.1:29093"


def test_overlapping_node_ports_are_refused_before_any_jvm(tmp_path: Path) -> None:
    cfg = Config(broker=BrokerConfig(data_dir=tmp_path, port=free_port(), nodes=3))
    cfg = cfg.model_copy(
        update={"broker": cfg.broker.model_copy(update={"controller_port": cfg.broker.port + 2})}
    )
    with pytest.raises(BrokerError, match="overlapping ports"):
        start_broker(cfg)
    assert not any(tmp_path.glob("node*/server.properties"))


def test_a_data_dir_keeps_its_node_count(tmp_path: Path) -> None:
    (tmp_path / "node1" / "kraft-logs").mkdir(parents=True)
    (tmp_path / "node1" / "kraft-logs" / "meta.properties").write_text("cluster.id=x\n")
    cfg = Config(broker=BrokerConfig(data_dir=tmp_path, port=free_port()))
    with pytest.raises(BrokerError, match="holds a 1-node cluster, but broker.nodes is 1"):
        start_broker(cfg)


def test_replication_follows_the_cluster_size() -> None:
    from rolloutbus.kafka.admin import min_insync_replicas, replication_factor, topic_configs

    kafka = KafkaConfig()
    assert [replication_factor(kafka, n) for n in (1, 2, 3, 5)] == [1, 2, 3, 3]
    assert [min_insync_replicas(kafka, r) for r in (1, 2, 3)] == [None, None, 2]
    assert "min.insync.replicas" not in topic_configs(kafka, None, 1)
    assert topic_configs(kafka, None, 3)["min.insync.replicas"] == "2"
    pinned = KafkaConfig(replication_factor=2, min_insync_replicas=1)
    assert replication_factor(pinned, 3) == 2
    assert topic_configs(pinned, None, 2)["min.insync.replicas"] == "1"


def _replicas(kafka: KafkaConfig, topic: str) -> dict[int, tuple[int, list[int], list[int]]]:
    meta = AdminClient(kafka.client_settings()).list_topics(topic, timeout=10).topics[topic]
    return {p: (m.leader, list(m.replicas), list(m.isrs)) for p, m in meta.partitions.items()}


@pytest.mark.slow
@pytest.mark.kafka  # a cluster of its own: three JVMs
def test_a_three_node_cluster_replicates_and_survives_its_leader(
    tmp_path: Path, make_producer
) -> None:
    """`rolloutbus broker start --nodes 3`: three nodes, rollout topics with three replicas
    and min.insync.replicas 2, internal topics alike; an acks=all write goes on after the
    leader of its partition is SIGKILLed, and the node comes back with `start`."""
    from tests.cluster import cluster_config

    cfg = cluster_config(tmp_path / "kafka")
    config_path = tmp_path / "config.yaml"
    raw = {"broker": cfg.broker.model_dump(mode="json"), "kafka": {"topic_prefix": "c3"}}
    raw["broker"]["nodes"] = 1  # the command line says 3; stop and status find it on disk
    raw["kafka"]["bootstrap_servers"] = cfg.kafka.bootstrap_servers
    config_path.write_text(yaml.safe_dump(raw))
    kafka = cfg.kafka.model_copy(update={"topic_prefix": "c3"})
    try:
        started = run_cli(
            "broker", "start", "--nodes", "3", "--config", str(config_path), timeout=BROKER_CLI_S
        )
        assert started.returncode == 0, started.stderr[-3000:]
        assert "3 nodes" in started.stdout and "topics ready (6 created)" in started.stdout
        status = run_cli("broker", "status", "--config", str(config_path), timeout=BROKER_CLI_S)
        assert status.returncode == 0 and cfg.kafka.bootstrap_servers in status.stdout

        turns = Topics.from_config(kafka).turns
        for name in Topics.from_config(kafka).all():
            for _, replicas, isrs in _replicas(kafka, name).values():
                assert sorted(replicas) == [1, 2, 3] and sorted(isrs) == [1, 2, 3], name
            assert _describe_topic_configs(kafka, name)["min.insync.replicas"] == "2", name

        producer = make_producer({"acks": "all", "enable.idempotence": True}, kafka=kafka)
        producer.produce(turns, key=b"k", value=b"before", partition=0)
        assert producer.flush(POLL_TIMEOUT_S) == 0
        # the internal topics exist once used: a group's offsets, a transaction's state
        consumer = Consumer({**kafka.client_settings(), "group.id": unique_name("g")})
        try:
            consumer.commit(offsets=[TopicPartition(turns, 0, 1)], asynchronous=False)
        finally:
            consumer.close()
        for internal in ("__consumer_offsets",):
            for _, replicas, _ in _replicas(kafka, internal).values():
                assert sorted(replicas) == [1, 2, 3], internal

        leader = _replicas(kafka, turns)[0][0]
        broker.kill_node(cfg, leader)
        producer.produce(turns, key=b"k", value=b"after", partition=0)
        assert producer.flush(POLL_TIMEOUT_S) == 0  # a new leader, two replicas in sync
        assert _replicas(kafka, turns)[0][0] != leader
        assert start_broker(cfg).running  # the killed node alone starts again

        reader = Consumer({**kafka.client_settings(), "group.id": unique_name("g")})
        try:
            reader.assign([TopicPartition(turns, 0, 0)])
            assert [_consume_one(reader).value() for _ in range(2)] == [b"before", b"after"]
        finally:
            reader.close()
    finally:
        stopped = run_cli("broker", "stop", "--config", str(config_path), timeout=BROKER_CLI_S)
    assert stopped.returncode == 0 and "broker stopped" in stopped.stdout, stopped.stderr
    assert not any(broker_status(cfg).node_pids)
