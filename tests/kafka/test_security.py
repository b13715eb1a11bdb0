"""Who can reach what: listeners bind to loopback by default, and the embedded broker can
require SASL (PLAIN) logins.

The SASL test starts a second embedded broker of its own (``kafka``, ``slow``), on free
ports in a temporary data dir like the session broker of ``conftest.py``, and checks that a
client without credentials and one with a wrong password are refused with an error (not a
hang), and that one with credentials creates the topics, publishes a prompt group and
reads it back read-committed.
"""

from __future__ import annotations

import inspect
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from rolloutbus.broker.acls import apply_acls
from rolloutbus.broker.embedded import broker_status, server_properties, start_broker, stop_broker
from rolloutbus.config import LOOPBACK, BrokerConfig, Config, KafkaConfig, with_overrides
from rolloutbus.errors import BrokerError, ConfigError
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.kafka.clients import admin_client
from rolloutbus.metrics import start_metrics_server
from rolloutbus.producers.datasets import make_arithmetic_rows
from rolloutbus.producers.publish import PromptPublisher, build_group
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.topics import Topics
from tests.helpers import unique_name
from tests.pipeline import read_topic
from tests.session_broker import embedded_config, watch_for_killed_session

ADMIN = "rolloutbus-admin"
# the admin first (the broker's own identity, the only super user), then one login per role
USERS = {
    ADMIN: "admin-pw-1",
    "trainer": "tr41ner!pw",
    "publisher": "pub-pw-2",
    "sessions": "sess-pw-3",
    "replay_buffer": "rb-pw-4",
    "weight_sync": "ws-pw-5",
}
REFUSAL_TIMEOUT_S = 5.0  # seconds a refused client may take to give up (librdkafka retries)
PORT_RETRIES = 3  # as conftest: a free port may be taken before the JVM binds it


def _properties(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def _hosts(listeners: str) -> set[str]:
    """{'127.0.0.1'} from 'PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093'."""
    return {url.split("://", 1)[1].rsplit(":", 1)[0] for url in listeners.split(",")}


# -- loopback by default (pure) -----------------------------------------------------------


def test_every_listener_binds_to_loopback_by_default(tmp_path: Path) -> None:
    cfg = Config()
    assert LOOPBACK == "127.0.0.1"
    assert cfg.broker.host == LOOPBACK
    assert cfg.replica_server.host == LOOPBACK
    assert cfg.sessions.metrics_host == LOOPBACK
    assert cfg.replay_buffer.metrics_host == LOOPBACK
    assert inspect.signature(start_metrics_server).parameters["addr"].default == LOOPBACK
    props = _properties(server_properties(cfg, tmp_path))
    assert _hosts(props["listeners"]) == _hosts(props["advertised.listeners"]) == {LOOPBACK}
    assert (
        props["controller.quorum.bootstrap.servers"] == f"{LOOPBACK}:{cfg.broker.controller_port}"
    )
    assert "sasl.enabled.mechanisms" not in props  # no users: plaintext, as before


def test_broker_host_is_configurable_but_the_controller_stays_on_loopback(tmp_path: Path) -> None:
    cfg = Config(broker=BrokerConfig(host="10.1.2.3", port=29092, controller_port=29093))
    props = _properties(server_properties(cfg, tmp_path))
    assert props["listeners"] == "PLAINTEXT://10.1.2.3:29092,CONTROLLER://127.0.0.1:29093"
    assert props["advertised.listeners"] == props["listeners"]


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_broker_host_is_refused_before_any_jvm(tmp_path: Path, wildcard: str) -> None:
    cfg = Config(broker=BrokerConfig(data_dir=tmp_path, host=wildcard))
    with pytest.raises(BrokerError, match="wildcard"):
        start_broker(cfg)
    assert not (tmp_path / "server.properties").exists()


def test_sasl_users_turn_the_client_listener_into_sasl_plaintext(tmp_path: Path) -> None:
    cfg = Config(broker=BrokerConfig(port=29092, controller_port=29093, sasl_users=USERS))
    props = _properties(server_properties(cfg, tmp_path))
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert (
        props["listener.security.protocol.map"]
        == "CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    )
    assert props["inter.broker.listener.name"] == "SASL_PLAINTEXT"
    assert (
        props["sasl.enabled.mechanisms"] == props["sasl.mechanism.inter.broker.protocol"] == "PLAIN"
    )
    jaas = props["listener.name.sasl_plaintext.plain.sasl.jaas.config"]
    assert jaas.startswith("org.apache.kafka.common.security.plain.PlainLoginModule required ")
    # the broker's own identity is the first user; every user may log in
    assert 'username="rolloutbus-admin" password="admin-pw-1"' in jaas
    assert 'user_rolloutbus-admin="admin-pw-1"' in jaas and 'user_trainer="tr41ner!pw"' in jaas
    assert "PLAINTEXT://" not in props["listeners"].replace("SASL_PLAINTEXT://", "")
    assert "admin-pw-1" not in repr(cfg.broker)  # SecretStr: kept out of logs and reprs


@pytest.mark.parametrize(
    "users",
    [
        {"bad name": "pw"},
        {"ok": 'quo"te'},
        {"ok": "back\\slash"},
        {"ok": "sp ace"},
        {"ok": ""},
        {'in"ject': "pw"},
    ],
)
def test_sasl_users_that_would_need_escaping_are_refused(users: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="broker.sasl_users"):
        with_overrides(Config(), {"broker.sasl_users": users})


def test_only_plain_is_offered() -> None:
    with pytest.raises(ConfigError, match="broker.sasl_mechanism"):
        with_overrides(Config(), {"broker.sasl_mechanism": "SCRAM-SHA-256"})


# -- the role ACLs (pure) --------------------------------------------------------------------


def test_each_topic_is_written_by_its_owner_only() -> None:
    from confluent_kafka.admin import AclOperation, ResourceType

    from rolloutbus.broker.acls import role_grants
    from rolloutbus.config import ACL_ROLES

    cfg = Config()
    topics = Topics.from_config(cfg.kafka)
    writers: dict[str, set[str]] = {name: set() for name in topics.all()}
    for role in ACL_ROLES:
        for grant in role_grants(cfg, role):
            if grant.resource == ResourceType.TOPIC and grant.operation == AclOperation.WRITE:
                writers[grant.name].add(role)
    assert writers == {
        topics.prompts: {"publisher"},
        topics.turns: {"sessions"},
        topics.trajectories: {"replay_buffer"},
        topics.released: {"replay_buffer"},
        topics.control: {"trainer", "weight_sync"},  # versions; versions applied
        topics.dlq: set(ACL_ROLES),  # bad input is dead-lettered wherever it is found
    }


def test_acls_follow_the_config_and_print_as_kafka_acls_commands() -> None:
    from rolloutbus.broker.acls import acl_bindings, kafka_acls_commands

    cfg = with_overrides(
        Config(),
        {
            "kafka.topic_prefix": "prod",
            "kafka.role_users": {"sessions": "svc-sessions"},
            "replay_buffer.group_id": "rb-prod",
        },
    )
    principals = {b.principal for b in acl_bindings(cfg)}
    assert "User:svc-sessions" in principals and "User:sessions" not in principals
    lines = kafka_acls_commands(cfg, "kafka:9093")
    assert all(line.startswith("kafka-acls.sh --bootstrap-server kafka:9093 ") for line in lines)
    assert any(
        "User:replay_buffer --operation Write --operation Describe --transactional-id rb-prod "
        "--resource-pattern-type prefixed" in line
        for line in lines
    ), lines
    pinned = with_overrides(cfg, {"replay_buffer.transactional_id": "rb-tx-1"})
    assert any(line.endswith("--transactional-id rb-tx-1") for line in kafka_acls_commands(pinned))


def test_acls_need_logins() -> None:
    with pytest.raises(ConfigError, match="broker.acls needs broker.sasl_users"):
        with_overrides(Config(), {"broker.acls": True})


# -- a second broker, with SASL and ACLs --------------------------------------------------


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    """A broker of its own with SASL logins for the admin and one user per role, and the
    StandardAuthorizer: a role may do only what rolloutbus/broker/acls.py grants it."""
    cfg = None
    for attempt in range(PORT_RETRIES):
        cfg = with_overrides(
            embedded_config(tmp_path_factory),
            {"broker.sasl_users": USERS, "broker.acls": True, "broker.heap": "256m"},
        )
        try:
            start_broker(cfg)
            break
        except BrokerError as exc:
            if "already in use" not in str(exc) or attempt == PORT_RETRIES - 1:
                raise
    assert cfg is not None
    watch_for_killed_session(broker_status(cfg).pid)
    try:
        yield cfg
    finally:
        assert stop_broker(cfg)


def _client(
    cfg: Config, user: str | None, password: str | None = None, prefix: str | None = None
) -> KafkaConfig:
    if user is None:
        return KafkaConfig(bootstrap_servers=cfg.kafka.bootstrap_servers)
    return KafkaConfig(
        bootstrap_servers=cfg.kafka.bootstrap_servers,
        topic_prefix=prefix or unique_name("s"),
        partitions=2,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username=user,
        sasl_password=password,
    )


def _rollout(broker: Config, **overrides: Any) -> Config:
    """A rollout config of its own (topic prefix, group and transactional ids) on the ACL
    broker, logged in as the admin, its topics created and every role's ACLs granted."""
    admin = _client(broker, ADMIN, USERS[ADMIN])
    cfg = with_overrides(
        broker,
        {
            "kafka": admin.model_dump(),
            "sessions.app_id": unique_name("s"),
            "replay_buffer.group_id": unique_name("rb"),
            "trainer.group_id": unique_name("tr"),
            **overrides,
        },
    )
    ensure_topics(cfg.kafka)
    assert apply_acls(cfg) > 0
    return cfg


def _as(cfg: Config, role: str) -> Config:
    """``cfg`` logged in as the user of ``role`` (each process sets its own login)."""
    return with_overrides(cfg, {"kafka.sasl_username": role, "kafka.sasl_password": USERS[role]})


def _refusal(kafka: KafkaConfig) -> tuple[float, KafkaError, list[KafkaError]]:
    """Ask for metadata; return how long the refusal took, its error, and the client's
    error callbacks (where librdkafka reports an authentication failure)."""
    errors: list[KafkaError] = []
    admin = admin_client(kafka, {"error_cb": errors.append, "log_level": 0})
    started = time.monotonic()
    with pytest.raises(KafkaException) as info:
        admin.list_topics(timeout=REFUSAL_TIMEOUT_S)
    took = time.monotonic() - started
    admin.poll(0.5)  # serve the error callbacks
    return took, info.value.args[0], errors


@pytest.mark.kafka
@pytest.mark.slow
def test_server_properties_with_passwords_are_private(sasl_broker: Config) -> None:
    path = sasl_broker.broker.data_dir / "server.properties"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    props = _properties(path.read_text())
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["super.users"] == f"User:{ADMIN}"  # the first user, and no other
    # the controller listener takes the admin's login only: no anonymous super user
    assert props["listener.security.protocol.map"].startswith("CONTROLLER:SASL_PLAINTEXT")
    jaas = props["listener.name.controller.plain.sasl.jaas.config"]
    assert f'user_{ADMIN}="' in jaas and "user_sessions" not in jaas
    status = broker_status(sasl_broker)  # the readiness probe logs in as the first user
    assert status.running


@pytest.mark.kafka
@pytest.mark.slow
def test_a_client_without_credentials_is_refused(sasl_broker: Config) -> None:
    took, error, _ = _refusal(_client(sasl_broker, None))
    # a plaintext request on a SASL listener: the broker hangs up (it logs "Unexpected
    # Kafka request of type METADATA during SASL handshake"), the client sees no broker
    assert error.code() == KafkaError._TRANSPORT, error
    assert took < REFUSAL_TIMEOUT_S + 1.0


@pytest.mark.kafka
@pytest.mark.slow
def test_a_client_with_a_wrong_password_is_refused(sasl_broker: Config) -> None:
    took, error, errors = _refusal(_client(sasl_broker, "trainer", "not-the-password"))
    assert error.code() == KafkaError._TRANSPORT, error
    assert took < REFUSAL_TIMEOUT_S + 1.0
    auth = [e for e in errors if e.code() == KafkaError._AUTHENTICATION]
    assert auth, f"no authentication error reported, only {errors}"
    assert "Invalid username or password" in auth[0].str()


def _produce_as(kafka: KafkaConfig, topic: str) -> KafkaError | None:
    """One keyed record to ``topic`` as ``kafka``'s user: the delivery error, or None."""
    results: list[KafkaError | None] = []
    producer = Producer({**kafka.client_settings(), "log_level": 0, "message.timeout.ms": 20000})
    producer.produce(topic, key=b"forged", value=b"{}", on_delivery=lambda e, m: results.append(e))
    producer.flush(30.0)
    assert len(results) == 1, f"no delivery report for {topic}"
    return results[0]


@pytest.mark.kafka
@pytest.mark.slow
def test_a_session_workers_login_cannot_write_released_or_control(sasl_broker: Config) -> None:
    """Only the replay buffer writes released records and only the trainer writes policy
    versions: a session worker's credentials (or a stolen copy) are refused on both, and
    on every other topic it does not own, while its own topic takes its writes."""
    cfg = _rollout(sasl_broker)
    topics = Topics.from_config(cfg.kafka)
    sessions = _as(cfg, "sessions").kafka
    assert _produce_as(sessions, topics.turns) is None
    for topic in (topics.released, topics.control, topics.trajectories, topics.prompts):
        error = _produce_as(sessions, topic)
        assert error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, (
            topic,
            error,
        )
    # the owners may: the refusal is about who writes, not about the topic
    assert _produce_as(_as(cfg, "replay_buffer").kafka, topics.released) is None
    assert _produce_as(_as(cfg, "trainer").kafka, topics.control) is None
    assert [m.value() for m in read_topic(cfg, topics.released)] == [b"{}"]
    assert [m.value() for m in read_topic(cfg, topics.control)] == [b"{}"]


@pytest.mark.kafka
@pytest.mark.slow
def test_a_client_with_credentials_works_end_to_end(sasl_broker: Config) -> None:
    """The publisher's login publishes a prompt group; read back read-committed."""
    cfg = _rollout(sasl_broker)
    topics = Topics.from_config(cfg.kafka)
    publisher_cfg = _as(cfg, "publisher")
    group = build_group(publisher_cfg, make_arithmetic_rows(1, seed=7, tool_fraction=0.0)[0])
    publisher = PromptPublisher(publisher_cfg)
    publisher.publish_group(group)
    publisher.flush()

    got = read_topic(cfg, topics.prompts)  # as the admin
    assert len(got) == 1, "the published prompt group was not read back"
    assert got[0].key().decode() == group.uid
    assert PromptGroup.model_validate_json(got[0].value()) == group


def test_cluster_ids_never_look_like_an_option() -> None:
    """Not security, but the SASL broker's start found it: a random cluster id starting with
    "-" made `kafka-storage format -t ID` fail, one start in 64 (as Kafka's own Uuid does,
    such ids are drawn again)."""
    from rolloutbus.broker.embedded import _random_cluster_id

    assert not any(_random_cluster_id().startswith("-") for _ in range(5000))


@pytest.mark.kafka
@pytest.mark.slow
def test_the_workers_run_end_to_end_with_a_login_per_role(
    sasl_broker: Config, tmp_path: Path
) -> None:
    """Session worker (Faust and the turn-log producer) and replay buffer as processes, each
    with its own role's login, against the SASL broker with ACLs; the publisher and the
    trainer client with theirs; a scripted replica (test double) answers. The ACLs of
    rolloutbus/broker/acls.py are enough for each role to do its whole job."""
    from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
    from rolloutbus.replica.server import replica_in_thread
    from tests.pipeline import running, spawn, write_config
    from tests.scripted_server import qwen3_tokenizer

    tok = qwen3_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine(
        lambda prompt: ScriptedTurn([*tok.encode("5"), end]),
        tokenizer=tok,
        eos_token_ids=frozenset({end}),
    )
    cfg = _rollout(
        sasl_broker,
        **{
            "model.name": "tiny-qwen3",
            "replica_server.port": 0,
            "rollout.n": 2,
            "rollout.prompt_length": 64,
            "rollout.response_length": 16,
        },
    )
    with replica_in_thread(cfg, engine) as replica:
        cfg = with_overrides(cfg, {"replicas.urls": [replica.url]})
        workers = [
            spawn(
                [command, "run"],
                write_config(_as(cfg, role), tmp_path / f"{role}.yaml"),
                tmp_path / f"{role}.log",
            )
            for command, role in (("sessions", "sessions"), ("replay-buffer", "replay_buffer"))
        ]
        with running(workers):
            publisher_cfg = _as(cfg, "publisher")
            group = build_group(
                publisher_cfg, make_arithmetic_rows(1, seed=3, tool_fraction=0.0)[0]
            )
            publisher = PromptPublisher(publisher_cfg)
            publisher.publish_group(group)
            publisher.flush()
            got = _receive_as_trainer(_as(cfg, "trainer"), group.uid, tmp_path)
    assert got == 2
    logs = "".join((tmp_path / f"{r}.log").read_text() for r in ("sessions", "replay_buffer"))
    assert "AUTHORIZATION_FAILED" not in logs, logs[-4000:]


def _receive_as_trainer(cfg: Config, uid: str, tmp_path: Path, timeout_s: float = 120.0) -> int:
    """Trajectories of ``uid`` read by the trainer client in the trainer's own group."""
    from rolloutbus.consumers.client import TrainerClient

    deadline = time.monotonic() + timeout_s
    with TrainerClient(cfg.kafka, cfg.trainer.group_id) as client:
        while time.monotonic() < deadline:
            for group in client.groups(max_groups=1, timeout_s=2.0):
                client.commit(group)
                if group.uid == uid:
                    return group.batch.num_rows
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    raise AssertionError(f"group {uid} never arrived; worker logs: {logs}")
