"""Kafka ACLs by role: each topic is written only by the role that owns it.

- publisher (publish, dispatch): writes prompts; reads prompts and control.
- sessions (session workers): writes turns; reads prompts and turns (the recovery scan);
  group ``sessions.app_id``; describes group ``replay_buffer.group_id`` (its committed
  offset is where the recovery scan starts).
- replay_buffer: writes trajectories and released; reads turns and released; group
  ``replay_buffer.group_id``; its transactional ids.
- trainer (``rolloutbus train``, the trainer client): writes control; reads trajectories
  and control; group ``trainer.group_id``.
- weight_sync: reads control; writes control (``PolicyVersionApplied`` once a version
  serves on every replica, streams/inference/weight_sync_applied.py).

Every role also writes the dead-letter topic and may describe every rollout topic (the
partition-count check and ``ensure_topics`` list them; a principal sees only the topics it
may describe). Creating topics and ACLs is the super user's: ``rolloutbus topics`` and
``rolloutbus broker acls`` with the admin's credentials.

Idempotent producers need no cluster ``IdempotentWrite`` ACL: since Kafka 3.0 a ``Write``
on the topic suffices (KIP-679). The reader groups that only ``assign()`` partitions
(``rolloutbus-partition-reader``, ``-control-reader``, ``-dispatch-reader``) never join or
commit, so they need no group ACL.

Every ACL is an allow; the authorizer denies whatever no ACL allows
(``allow.everyone.if.no.acl.found=false``, Kafka's default). The same bindings are applied
to the embedded broker (``broker.acls``), to any cluster by ``rolloutbus broker acls``, or
printed as ``kafka-acls.sh`` commands (``--print``) for an operator to run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from rolloutbus.config import ACL_ROLES, Config, KafkaConfig
from rolloutbus.errors import BrokerError, ConfigError
from rolloutbus.kafka.clients import admin_client, broker_error
from rolloutbus.kafka.control_reader import CONTROL_DEAD_LETTER_GROUP, CONTROL_READER_GROUP
from rolloutbus.kafka.control_writer import trainer_transactional_id
from rolloutbus.topics import Topics

__all__ = ["Grant", "acl_bindings", "apply_acls", "kafka_acls_commands", "role_grants"]

ACL_TIMEOUT_S = 30.0  # seconds for the controller to commit the ACLs (milliseconds when idle)
ACL_POLL_S = 0.1  # seconds between checks that new ACLs are in force
ANY_HOST = "*"

READ, WRITE, DESCRIBE = AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE


@dataclass(frozen=True)
class Grant:
    """One allow ACL of a role: ``operation`` on ``resource`` ``name`` (a name prefix when
    ``prefixed``)."""

    role: str
    resource: ResourceType
    name: str
    operation: AclOperation
    prefixed: bool = False


def role_user(kafka: KafkaConfig, role: str) -> str:
    """The SASL user of ``role``: kafka.role_users, else the role's own name."""
    # role_users is keyed by the AclRole literal; a role named on the command line is a str
    users = {str(known): user for known, user in kafka.role_users.items()}
    return users.get(role, role)


def role_grants(cfg: Config, role: str) -> list[Grant]:
    """Every ACL that ``role`` needs under ``cfg`` (topic prefix, group and transactional ids)."""
    if role not in ACL_ROLES:
        raise ConfigError(f"unknown role {role!r}: one of {', '.join(ACL_ROLES)}")
    topics = Topics.from_config(cfg.kafka)
    grants = [_topic(role, name, DESCRIBE) for name in topics.all()]
    grants.append(_topic(role, topics.dlq, WRITE))
    grants += _ROLE_GRANTS[role](cfg, topics, role)
    if _topic(role, topics.control, READ) in grants:
        # a reader of rollout.control assigns its partition under this group id, which never
        # commits; librdkafka still looks up its coordinator (a group describe)
        grants.append(_group(role, CONTROL_READER_GROUP, DESCRIBE))
    return grants


def _topic(role: str, name: str, operation: AclOperation) -> Grant:
    return Grant(role, ResourceType.TOPIC, name, operation)


def _group(role: str, name: str, operation: AclOperation = READ) -> Grant:
    return Grant(role, ResourceType.GROUP, name, operation)


def _publisher(cfg: Config, topics: Topics, role: str) -> list[Grant]:
    # the dispatcher reads the uids already on prompts and the policy version on control
    return [
        _topic(role, topics.prompts, WRITE),
        _topic(role, topics.prompts, READ),
        _topic(role, topics.control, READ),
    ]


def _sessions(cfg: Config, topics: Topics, role: str) -> list[Grant]:
    return [
        _topic(role, topics.prompts, READ),
        _group(role, cfg.sessions.app_id),
        _topic(role, topics.turns, WRITE),
        _topic(role, topics.turns, READ),  # the recovery scan of an assigned partition
        _topic(role, topics.control, READ),  # the current version, for replica admission
        # the scan starts at the replay buffer's committed offset (an offset fetch)
        _group(role, cfg.replay_buffer.group_id, DESCRIBE),
    ]


def _replay_buffer(cfg: Config, topics: Topics, role: str) -> list[Grant]:
    pinned = cfg.replay_buffer.transactional_id
    # unpinned, a static member's is "{group_id}-{group_instance_id}" and any other process
    # draws "{group_id}-{host}-{pid}-{random}" (replay_buffer.transactional_id_of): a prefix ACL
    txn_name, txn_prefixed = (pinned, False) if pinned else (cfg.replay_buffer.group_id, True)
    return [
        _topic(role, topics.turns, READ),
        _group(role, cfg.replay_buffer.group_id),
        _topic(role, topics.trajectories, WRITE),
        _topic(role, topics.released, WRITE),
        _topic(role, topics.released, READ),  # read back on partition assignment
        *(
            Grant(role, ResourceType.TRANSACTIONAL_ID, txn_name, op, prefixed=txn_prefixed)
            for op in (WRITE, DESCRIBE)
        ),
    ]


def _trainer(cfg: Config, topics: Topics, role: str) -> list[Grant]:
    return [
        _topic(role, topics.trajectories, READ),
        _group(role, cfg.trainer.group_id),
        _topic(role, topics.control, WRITE),
        _topic(role, topics.control, READ),  # the latest version, the staleness bound
        # the fenced control writer: one transactional id per control topic
        *(
            Grant(role, ResourceType.TRANSACTIONAL_ID, trainer_transactional_id(cfg.kafka), op)
            for op in (WRITE, DESCRIBE)
        ),
    ]


def _weight_sync(cfg: Config, topics: Topics, role: str) -> list[Grant]:
    return [
        _topic(role, topics.control, READ),
        _topic(role, topics.control, WRITE),  # PolicyVersionApplied, idempotently
        # how far its dead letters of the control topic got (kafka/control_reader.py)
        _group(role, CONTROL_DEAD_LETTER_GROUP),
    ]


_ROLE_GRANTS = {
    "publisher": _publisher,
    "sessions": _sessions,
    "replay_buffer": _replay_buffer,
    "trainer": _trainer,
    "weight_sync": _weight_sync,
}


def acl_bindings(cfg: Config, roles: tuple[str, ...] = ACL_ROLES) -> list[AclBinding]:
    """The AdminClient bindings of ``roles``, each granted to ``User:{role_user}``."""
    return [
        AclBinding(
            grant.resource,
            grant.name,
            ResourcePatternType.PREFIXED if grant.prefixed else ResourcePatternType.LITERAL,
            f"User:{role_user(cfg.kafka, grant.role)}",
            ANY_HOST,
            grant.operation,
            AclPermissionType.ALLOW,
        )
        for role in roles
        for grant in role_grants(cfg, role)
    ]


def apply_acls(
    cfg: Config, admin: KafkaConfig | None = None, roles: tuple[str, ...] = ACL_ROLES
) -> int:
    """Create the ACLs of ``roles`` on the cluster, as ``admin`` (default ``cfg.kafka``: it
    must be a super user or hold ``Alter`` on the cluster). Idempotent: an ACL that exists
    already is left as it is. Returns the number of bindings."""
    admin = admin or cfg.kafka
    bindings = acl_bindings(cfg, roles)
    client = admin_client(admin)  # held until the futures resolve: a dropped client fails them
    futures = client.create_acls(bindings, request_timeout=ACL_TIMEOUT_S)
    for binding, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            raise broker_error(
                exc,
                f"creating ACL {binding} on {admin.bootstrap_servers} (as "
                f"{admin.sasl_username or 'an anonymous client'}: a super user or Alter on "
                "the cluster is needed)",
            ) from exc
    _wait_until_in_force(client, admin, bindings)
    return len(bindings)


def _binding_key(binding: AclBinding) -> tuple[Any, ...]:
    return (
        binding.restype,
        binding.name,
        binding.resource_pattern_type,
        binding.principal,
        binding.host,
        binding.operation,
        binding.permission_type,
    )


def _wait_until_in_force(
    client: AdminClient, admin: KafkaConfig, bindings: list[AclBinding]
) -> None:
    """create_acls returns once the controller committed them; a broker authorizes with
    them once it has applied that metadata, a moment later (up to seconds on a busy host).
    Wait until the broker answering describe_acls lists them all, so the caller's next
    client is not refused."""
    wanted = {_binding_key(b) for b in bindings}
    # confluent-kafka documents None as "any" for a filter's name, principal and host, but
    # annotates them str
    everything = AclBindingFilter(
        ResourceType.ANY,
        None,  # type: ignore[arg-type]
        ResourcePatternType.ANY,
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    deadline = time.monotonic() + ACL_TIMEOUT_S
    while True:
        try:
            found = client.describe_acls(everything, request_timeout=ACL_TIMEOUT_S).result()
        except KafkaException as exc:
            raise broker_error(exc, f"listing ACLs on {admin.bootstrap_servers}") from exc
        missing = wanted - {_binding_key(b) for b in found}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise BrokerError(
                f"{len(missing)} ACLs created on {admin.bootstrap_servers} are not in force "
                f"after {ACL_TIMEOUT_S:.0f} s"
            )
        time.sleep(ACL_POLL_S)


_CLI_RESOURCE = {
    ResourceType.TOPIC: "--topic",
    ResourceType.GROUP: "--group",
    ResourceType.TRANSACTIONAL_ID: "--transactional-id",
}


def kafka_acls_commands(cfg: Config, bootstrap: str = "$BOOTSTRAP") -> list[str]:
    """The same ACLs as ``kafka-acls.sh`` commands (Kafka's own tool), one per role and
    resource, for an operator who applies ACLs by hand. ``$ADMIN_PROPERTIES`` names the
    admin's client config file."""
    merged: dict[tuple[str, ResourceType, str, bool], list[str]] = {}
    for role in ACL_ROLES:
        for grant in role_grants(cfg, role):
            key = (role, grant.resource, grant.name, grant.prefixed)
            operations = merged.setdefault(key, [])
            name = grant.operation.name.title()
            if name not in operations:
                operations.append(name)
    lines = []
    for (role, resource, name, prefixed), operations in merged.items():
        ops = " ".join(f"--operation {op}" for op in operations)
        pattern = " --resource-pattern-type prefixed" if prefixed else ""
        lines.append(
            f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config $ADMIN_PROPERTIES "
            f"--add --allow-principal User:{role_user(cfg.kafka, role)} {ops} "
            f"{_CLI_RESOURCE[resource]} {name}{pattern}"
        )
    return lines
