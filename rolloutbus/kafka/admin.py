"""Topic administration: the rollout topics, created idempotently, and their partition
counts checked against the config.

Works against any cluster (the embedded broker or the user's own). Every confluent-kafka
error is translated here into :class:`BrokerError`, naming the topic and the bootstrap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ClusterMetadata, NewTopic, TopicMetadata

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError, ConfigError
from rolloutbus.kafka.clients import (
    admin_client,
    broker_error,
    kafka_error_code,
    read_committed_consumer,
    watermark_offsets,
)
from rolloutbus.topics import Topics

__all__ = [
    "check_partition_counts",
    "delete_topics",
    "ensure_topics",
    "min_insync_replicas",
    "replication_factor",
    "topic_configs",
    "topic_partitions",
]

log = logging.getLogger(__name__)

# Policy versions are a single ordered stream that every worker reads in full, so the
# control topic has one partition; the others share kafka.partitions (see topics.py).
CONTROL_PARTITIONS = 1
ADMIN_TIMEOUT_S = 30.0  # seconds per admin round trip; a busy two-core broker answers in <1 s
VISIBLE_POLL_S = 0.1  # seconds between metadata polls while new topics propagate


REACHABLE_TIMEOUT_S = 10.0  # seconds; a live broker answers metadata in milliseconds


def check_reachable(kafka: KafkaConfig, timeout_s: float = REACHABLE_TIMEOUT_S) -> None:
    """Fail fast, with what to do, instead of letting a client retry for minutes."""
    # log_level 2: the probe's own connection failures (one line per retry) stay quiet;
    # the error below says it once
    probe = admin_client(kafka, {"log_level": 2})
    try:
        probe.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerError(
            f"cannot reach Kafka at {kafka.bootstrap_servers} within {timeout_s:.0f} s "
            f"({_broker_error('metadata request', kafka, exc)}); start the embedded broker with "
            "`rolloutbus broker start` or set kafka.bootstrap_servers"
        ) from exc


def topic_partitions(kafka: KafkaConfig) -> dict[str, int]:
    """The partition count of each rollout topic, by name."""
    topics = Topics.from_config(kafka)
    counts = {name: kafka.partitions for name in topics.all()}
    counts[topics.control] = CONTROL_PARTITIONS
    return counts


# The released-groups topic is compacted (one record per uid) and also time-bounded, so
# reading a partition of it on assignment costs the groups released within its retention,
# not every group ever. It keeps a record twice as long as the turn log keeps events: a
# group's turn events are older than its released record, so while any of them can still be
# replayed the record is there to say the group was released.
RELEASED_RETENTION_FACTOR = 2


# Replicas of a topic on a cluster of this many brokers or more: one broker may be down
# (min.insync.replicas 2 then still takes acks=all writes) while another lags.
MAX_REPLICATION_FACTOR = 3
SAFE_MIN_INSYNC = 2  # in-sync replicas an acks=all write waits for, from 3 replicas on


def replication_factor(kafka: KafkaConfig, brokers: int) -> int:
    """kafka.replication_factor, or min(3, brokers) when it is unset."""
    if kafka.replication_factor is not None:
        return kafka.replication_factor
    return max(1, min(MAX_REPLICATION_FACTOR, brokers))


def min_insync_replicas(kafka: KafkaConfig, replicas: int) -> int | None:
    """kafka.min_insync_replicas, or 2 from 3 replicas on; None: the broker's default."""
    if kafka.min_insync_replicas is not None:
        return kafka.min_insync_replicas
    return SAFE_MIN_INSYNC if replicas >= MAX_REPLICATION_FACTOR else None


def topic_configs(
    kafka: KafkaConfig, name: str | None = None, replicas: int | None = None
) -> dict[str, str]:
    """Topic-level settings of the rollout topic ``name`` (None: those most topics share),
    created with ``replicas`` replicas (None: unknown, no ``min.insync.replicas``)."""
    configs = _cleanup_configs(kafka, name)
    min_isr = min_insync_replicas(kafka, replicas) if replicas is not None else None
    if min_isr is not None:
        configs["min.insync.replicas"] = str(min_isr)
    return configs


def _cleanup_configs(kafka: KafkaConfig, name: str | None) -> dict[str, str]:
    if name is not None and name == Topics.from_config(kafka).control:
        # keyed by event type (topics.control_key): compaction keeps the latest policy
        # version forever, so a replica or dispatcher started months later still finds it
        # (retention.ms is kept for uniformity; a compact-only topic does not delete by age)
        return {
            "cleanup.policy": "compact",
            "retention.ms": str(kafka.retention_ms),
            "max.message.bytes": str(kafka.max_message_bytes),
        }
    if name is not None and name == Topics.from_config(kafka).released:
        return {
            "cleanup.policy": "compact,delete",
            "retention.ms": str(kafka.retention_ms * RELEASED_RETENTION_FACTOR),
            "max.message.bytes": str(kafka.max_message_bytes),
        }
    return {
        "cleanup.policy": "delete",
        "retention.ms": str(kafka.retention_ms),
        "max.message.bytes": str(kafka.max_message_bytes),
    }


def check_partition_counts(kafka: KafkaConfig, timeout_s: float = ADMIN_TIMEOUT_S) -> int:
    """The partition count of the uid-partitioned topics, read from the cluster.

    A uid maps to partition ``crc32(uid) % count`` on every topic, so prompts, turns,
    trajectories and released must have one count, and ``kafka.partitions`` must name it
    (the publisher and the session worker place records by it). Raises BrokerError when a
    topic is missing or the topics disagree, ConfigError when they agree with each other
    but not with the config; each message says what to do.
    """
    names = Topics.from_config(kafka).partitioned_by_uid()
    existing = _partition_counts(_admin(kafka), kafka, timeout_s)
    missing = [name for name in names if name not in existing]
    if missing:
        raise BrokerError(
            f"topics {', '.join(missing)} do not exist on {kafka.bootstrap_servers}: "
            "create them with `rolloutbus topics` (same config)"
        )
    counts = {name: existing[name] for name in names}
    if len(set(counts.values())) > 1:
        found = ", ".join(f"{name} has {count}" for name, count in counts.items())
        raise BrokerError(
            f"the rollout topics on {kafka.bootstrap_servers} disagree on their partition count "
            f"({found}): a uid would map to different partitions on different topics; recreate "
            "them with one count, or use another kafka.topic_prefix"
        )
    count = counts[names[0]]
    if count != kafka.partitions:
        raise ConfigError(
            f"the rollout topics ({kafka.topic_prefix}.*) on {kafka.bootstrap_servers} have "
            f"{count} "
            f"partitions but kafka.partitions is {kafka.partitions}: set kafka.partitions: {count} "
            "(or use another kafka.topic_prefix)"
        )
    return count


def ensure_topics(kafka: KafkaConfig, timeout_s: float = ADMIN_TIMEOUT_S) -> list[str]:
    """Create the missing rollout topics; return the names created (empty if none).

    An existing topic is left alone, but its partition count must match: a uid maps to
    the same partition number on every topic only if the counts agree.
    """
    admin = _admin(kafka)
    wanted = topic_partitions(kafka)
    metadata = _metadata(admin, kafka, timeout_s)
    existing = {name: len(meta.partitions) for name, meta in metadata.topics.items()}
    _check_partition_counts(kafka, wanted, existing)
    missing = [name for name in wanted if name not in existing]
    replicas = replication_factor(kafka, len(metadata.brokers))
    _check_replicas(kafka, metadata, replicas, len(metadata.brokers))
    created = _create(admin, kafka, missing, wanted, replicas, timeout_s)
    if created:
        _wait_until_visible(admin, kafka, wanted, created, timeout_s)
        _wait_until_leaders_answer(kafka, wanted, created, timeout_s)
    # A topic that a concurrent caller created between our listing and our create has
    # not been checked yet.
    raced = [name for name in missing if name not in created]
    if raced:
        _check_partition_counts(kafka, wanted, _partition_counts(admin, kafka, timeout_s))
    return created


def delete_topics(
    kafka: KafkaConfig, names: Iterable[str], timeout_s: float = ADMIN_TIMEOUT_S
) -> None:
    """Delete topics by name; a topic that does not exist is not an error (for tests)."""
    names = list(names)
    if not names:
        return
    admin = _admin(kafka)  # held until the futures resolve: a dropped client fails them
    futures = admin.delete_topics(names, operation_timeout=timeout_s, request_timeout=timeout_s)
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if kafka_error_code(exc) != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise _broker_error(f"deleting topic {name}", kafka, exc) from exc


def _admin(kafka: KafkaConfig) -> AdminClient:
    return admin_client(kafka)


def _partition_counts(admin: AdminClient, kafka: KafkaConfig, timeout_s: float) -> dict[str, int]:
    return {
        name: len(meta.partitions)
        for name, meta in _metadata(admin, kafka, timeout_s).topics.items()
    }


def _metadata(admin: AdminClient, kafka: KafkaConfig, timeout_s: float) -> ClusterMetadata:
    try:
        return admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise _broker_error(f"listing topics ({kafka.topic_prefix}.*)", kafka, exc) from exc


def _check_partition_counts(
    kafka: KafkaConfig, wanted: dict[str, int], existing: dict[str, int]
) -> None:
    for name, count in wanted.items():
        if name in existing and existing[name] != count:
            raise BrokerError(
                f"topic {name} on {kafka.bootstrap_servers} has {existing[name]} partitions but "
                f"the config asks for {count} (kafka.partitions): a uid would map to different "
                "partitions on different topics; use another kafka.topic_prefix or recreate it"
            )


def _check_replicas(
    kafka: KafkaConfig, metadata: ClusterMetadata, replicas: int, brokers: int
) -> None:
    """A replication factor the cluster cannot hold is an error before anything is created;
    existing rollout topics with fewer replicas than new ones would get are logged."""
    if replicas > brokers:
        raise ConfigError(
            f"kafka.replication_factor is {replicas} but {kafka.bootstrap_servers} has "
            f"{brokers} broker(s): lower it, or leave it unset for min(3, brokers)"
        )
    for name in topic_partitions(kafka):
        meta = metadata.topics.get(name)
        fewer = meta is not None and any(
            len(p.replicas) < replicas for p in meta.partitions.values()
        )
        if fewer:
            log.warning(
                "topic %s on %s has partitions with fewer than %d replicas (created on a "
                "smaller cluster?): raise them with kafka-reassign-partitions "
                "(docs/production.md)",
                name,
                kafka.bootstrap_servers,
                replicas,
            )


def _create(
    admin: AdminClient,
    kafka: KafkaConfig,
    names: list[str],
    wanted: dict[str, int],
    replicas: int,
    timeout_s: float,
) -> list[str]:
    if not names:
        return []
    new_topics = [
        NewTopic(
            name,
            num_partitions=wanted[name],
            replication_factor=replicas,
            config=topic_configs(kafka, name, replicas),
        )
        for name in names
    ]
    futures = admin.create_topics(
        new_topics, operation_timeout=timeout_s, request_timeout=timeout_s
    )
    created = []
    for name, future in futures.items():
        try:
            future.result()
        except KafkaException as exc:
            if kafka_error_code(exc) == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # created concurrently by another caller: checked afterwards
            raise _broker_error(f"creating topic {name}", kafka, exc) from exc
        created.append(name)
    return [name for name in names if name in created]  # in the order of Topics.all()


def _wait_until_visible(
    admin: AdminClient,
    kafka: KafkaConfig,
    wanted: dict[str, int],
    names: list[str],
    timeout_s: float,
) -> None:
    """Wait until the broker's metadata shows every new partition with a leader.

    create_topics returns once the controller has committed the topic; a producer that
    starts in that instant could still see UNKNOWN_TOPIC_OR_PART from the broker.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(names)
    while pending:
        topics = _metadata(admin, kafka, timeout_s).topics
        pending = [name for name in pending if not _has_leaders(topics.get(name), wanted[name])]
        if pending and time.monotonic() > deadline:
            raise BrokerError(
                f"topics {', '.join(pending)} on {kafka.bootstrap_servers} were created but have "
                f"no leader for every partition after {timeout_s:.0f} s"
            )
        if pending:
            time.sleep(VISIBLE_POLL_S)


def _wait_until_leaders_answer(
    kafka: KafkaConfig, wanted: dict[str, int], names: list[str], timeout_s: float
) -> None:
    """Wait until the leader of every new partition answers for it (a ListOffsets).

    Metadata can name a leader before that broker leads the partition. A producer that
    starts then gets a retriable error for its first batch while the next batches, already
    in flight, are taken: a broker with no state for the producer accepts any first sequence
    number. librdkafka then reads the first batch's out-of-order retry as already written and
    reports it delivered, with no offset; it is lost (seen in tests under load, about one
    fresh topic in 150).
    """
    consumer = read_committed_consumer(kafka, f"rolloutbus-topics-{time.monotonic_ns()}")
    try:
        deadline = time.monotonic() + timeout_s
        for name in names:
            for partition in range(wanted[name]):
                _leader_answers(consumer, TopicPartition(name, partition), deadline)
    finally:
        consumer.close()


# what a fresh client says of a topic its own metadata does not hold yet (a cluster's
# brokers learn of a new topic one by one): asked again until the deadline
NOT_YET_KNOWN = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC})


def _leader_answers(consumer: Consumer, tp: TopicPartition, deadline: float) -> None:
    while True:
        try:
            watermark_offsets(consumer, tp, max(VISIBLE_POLL_S, deadline - time.monotonic()))
            return
        except BrokerError as exc:
            cause = exc.__cause__
            code = kafka_error_code(cause) if isinstance(cause, KafkaException) else None
            if code not in NOT_YET_KNOWN or time.monotonic() >= deadline:
                raise
            time.sleep(VISIBLE_POLL_S)


def _has_leaders(meta: TopicMetadata | None, count: int) -> bool:
    if meta is None or meta.error is not None or len(meta.partitions) != count:
        return False
    return all(p.leader >= 0 and p.error is None for p in meta.partitions.values())


def _broker_error(action: str, kafka: KafkaConfig, exc: KafkaException) -> BrokerError:
    return broker_error(exc, f"{action} on {kafka.bootstrap_servers}")
