"""The embedded broker's ``server.properties``: one KRaft node, or each node of a cluster.

Every node is a combined broker and controller (``process.roles=broker,controller``):

- one node: a dynamic quorum of itself (``controller.quorum.bootstrap.servers``, KIP-853),
  formatted ``--standalone``; every internal topic has one replica;
- N nodes: a static quorum of all of them (``controller.quorum.voters``), so any
  majority elects a controller; internal topics get ``min(3, N)`` replicas and, from three
  replicas on, ``min.insync.replicas`` 2, so a broker may die without losing an
  acknowledged offset commit or transaction marker.

Security: the client listener is PLAINTEXT, or SASL_PLAINTEXT with ``broker.sasl_users``
(the first user is the broker's own identity on it). With ``broker.acls`` the
StandardAuthorizer is on, the first user is the only super user, and the controller
listener takes SASL logins too (so nothing on this host talks to a controller unnamed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rolloutbus.config import LOOPBACK, Config

__all__ = ["BrokerNode", "broker_nodes", "internal_replication", "server_properties"]

PLAIN_LISTENER = "PLAINTEXT"
SASL_LISTENER = "SASL_PLAINTEXT"
CONTROLLER_LISTENER = "CONTROLLER"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
MAX_REPLICAS = 3  # replicas of every topic on a cluster of 3+: one may fail, one may lag
PORT_STRIDE = 2  # node i listens on port + 2i and controller_port + 2i: the defaults interleave


@dataclass(frozen=True)
class BrokerNode:
    """One JVM of the embedded broker: its KRaft node id, ports and data folder."""

    node_id: int  # 1-based
    port: int
    controller_port: int
    data_dir: Path


def broker_nodes(cfg: Config, data_dir: Path) -> list[BrokerNode]:
    """The nodes of ``cfg.broker``. One node keeps ``data_dir`` itself (the layout of every
    earlier release); a cluster puts node i in ``data_dir/node{i}``."""
    broker = cfg.broker
    if broker.nodes == 1:
        return [BrokerNode(1, broker.port, broker.controller_port, data_dir)]
    return [
        BrokerNode(
            i + 1,
            broker.port + PORT_STRIDE * i,
            broker.controller_port + PORT_STRIDE * i,
            data_dir / f"node{i + 1}",
        )
        for i in range(broker.nodes)
    ]


def internal_replication(nodes: int) -> tuple[int, int]:
    """(replication factor, min in-sync replicas) of internal topics on ``nodes`` nodes."""
    replicas = min(MAX_REPLICAS, nodes)
    return replicas, 2 if replicas >= MAX_REPLICAS else 1


def client_listener(cfg: Config) -> str:
    return SASL_LISTENER if cfg.broker.sasl_users else PLAIN_LISTENER


def server_properties(
    cfg: Config,
    data_dir: Path,
    node: BrokerNode | None = None,
    nodes: list[BrokerNode] | None = None,
) -> str:
    """The config of ``node`` (default: the single node in ``data_dir``) among ``nodes``.

    With ``broker.sasl_users`` the text holds their passwords: write it where only the
    owner can read it (``broker._write_server_properties`` does).
    """
    node = node or BrokerNode(1, cfg.broker.port, cfg.broker.controller_port, data_dir)
    nodes = nodes or [node]
    client = client_listener(cfg)
    client_url = f"{client}://{cfg.broker.host}:{node.port}"
    controller_url = f"{CONTROLLER_LISTENER}://{LOOPBACK}:{node.controller_port}"
    controller_protocol = SASL_LISTENER if cfg.broker.acls else PLAIN_LISTENER
    lines = {
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        **_quorum(nodes),
        "listeners": f"{client_url},{controller_url}",
        "advertised.listeners": f"{client_url},{controller_url}",
        "controller.listener.names": CONTROLLER_LISTENER,
        # the broker reaches itself on the client listener (transaction markers to the
        # partition leaders): with SASL, as the first user (_sasl_properties)
        "inter.broker.listener.name": client,
        "listener.security.protocol.map": (
            f"{CONTROLLER_LISTENER}:{controller_protocol},{client}:{client}"
        ),
        **_sasl_properties(cfg),
        **_acl_properties(cfg),
        "log.dirs": str(node.data_dir / "kraft-logs"),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",  # topics come from rolloutbus.kafka.admin only
        **_size_properties(cfg),
        **_replication_properties(len(nodes)),
        # Dev speed: no 3 s wait before the first rebalance, and one partition per internal
        # topic instead of 50 (each partition is files and a coordinator load on start).
        "group.initial.rebalance.delay.ms": "0",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.num.partitions": "1",
        "share.coordinator.state.topic.num.partitions": "1",
    }
    header = (
        "# Written by rolloutbus.broker.embedded on every start; edit the config, not this file.\n"
    )
    return header + "".join(f"{key}={value}\n" for key, value in lines.items())


def _quorum(nodes: list[BrokerNode]) -> dict[str, str]:
    if len(nodes) == 1:  # dynamic quorum (KIP-853), formatted --standalone
        return {"controller.quorum.bootstrap.servers": f"{LOOPBACK}:{nodes[0].controller_port}"}
    voters = ",".join(f"{n.node_id}@{LOOPBACK}:{n.controller_port}" for n in nodes)
    return {"controller.quorum.voters": voters}  # static: every node formatted alike


def _size_properties(cfg: Config) -> dict[str, str]:
    # bytes; topic max.message.bytes is set per topic (rolloutbus.kafka.admin), this is the
    # broker default and the cap that replica fetches and socket requests must exceed.
    max_bytes = max(cfg.kafka.max_message_bytes, 1048588)
    request_max = max(104857600, max_bytes + 1048576)  # bytes; Kafka's default 100 MiB
    return {
        "message.max.bytes": str(max_bytes),
        "replica.fetch.max.bytes": str(max_bytes),
        "socket.request.max.bytes": str(request_max),
    }


def _replication_properties(nodes: int) -> dict[str, str]:
    """Internal topics (offsets, transaction state, share state) sized to the cluster, and
    the defaults a topic created without settings gets."""
    replicas, min_isr = internal_replication(nodes)
    return {
        "offsets.topic.replication.factor": str(replicas),
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "default.replication.factor": str(replicas),
        "min.insync.replicas": str(min_isr),
        # Kafka's default, stated: a replica that missed writes never becomes leader
        "unclean.leader.election.enable": "false",
    }


def _jaas(own: tuple[str, str], users: dict[str, str]) -> str:
    entries = [
        f'username="{own[0]}"',
        f'password="{own[1]}"',
        *(f'user_{name}="{password}"' for name, password in users.items()),
    ]
    return f"{PLAIN_LOGIN} required {' '.join(entries)};"


def _users(cfg: Config) -> dict[str, str]:
    return {name: secret.get_secret_value() for name, secret in cfg.broker.sasl_users.items()}


def _sasl_properties(cfg: Config) -> dict[str, str]:
    """SASL/PLAIN on the client listener: one ``user_NAME="PASSWORD"`` per user, and the
    first user's ``username``/``password`` for the broker's connections to itself.
    Names and passwords are checked JAAS-safe by BrokerConfig."""
    users = _users(cfg)
    if not users:
        return {}
    mechanism = cfg.broker.sasl_mechanism
    own = next(iter(users.items()))
    prefix = f"listener.name.{SASL_LISTENER.lower()}.{mechanism.lower()}"
    return {
        "sasl.enabled.mechanisms": mechanism,
        "sasl.mechanism.inter.broker.protocol": mechanism,
        f"{prefix}.sasl.jaas.config": _jaas(own, users),
    }


def _acl_properties(cfg: Config) -> dict[str, str]:
    """The StandardAuthorizer, the first user its only super user; the controller listener
    then takes that user's SASL login only (controllers authorize each other's requests
    too, and an anonymous super user would be anyone on this host)."""
    if not cfg.broker.acls:
        return {}
    mechanism = cfg.broker.sasl_mechanism
    own = next(iter(_users(cfg).items()))
    return {
        "authorizer.class.name": AUTHORIZER,
        "super.users": f"User:{own[0]}",
        "allow.everyone.if.no.acl.found": "false",  # Kafka's default, stated
        "sasl.mechanism.controller.protocol": mechanism,
        f"listener.name.{CONTROLLER_LISTENER.lower()}.{mechanism.lower()}.sasl.jaas.config": (
            _jaas(own, {own[0]: own[1]})
        ),
    }
