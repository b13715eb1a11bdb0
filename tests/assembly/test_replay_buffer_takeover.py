"""The replay buffer through fatal errors and takeovers, against the real broker: a fenced
producer is replaced and every group is still released exactly once; a consumer fenced by
its own ``group.instance.id`` (a lone static member after a broker restart) is replaced
instead of leaving the process polling a dead consumer; a static member gets its
transactional id from its name; and a restarted static member takes its partitions back
without waiting for the dead one's session to expire.

Fatal errors are provoked as Kafka makes them: a producer with the same
``transactional.id`` runs ``init_transactions``; a consumer joins with the same
``group.instance.id``.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config, KafkaConfig, with_overrides
from rolloutbus.kafka.clients import (
    idempotent_producer,
    read_committed_consumer,
    transactional_producer,
)
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.replay_buffer import (
    consumer_overrides,
    transactional_id_of,
)
from rolloutbus.topics import Topics, partition_for
from tests.helpers import unique_name
from tests.pipeline import read_topic, running, spawn, write_config
from tests.synthetic import N, group_events

WAIT_S = 120.0  # seconds for a buffer to release what was produced (two busy cores)
# seconds of replay_buffer.session_timeout_s in the takeover test: far longer than a
# restart takes, so a release before it expires can only come from static membership
LONG_SESSION_S = 120.0
JOIN_S = 30.0  # seconds for a consumer to join the group and get its assignment


def _fence(kafka: KafkaConfig, transactional_id: str):
    """What a restarted process does first: its init_transactions fences every earlier
    producer with the id. Returns the new producer (kept alive by the caller)."""
    newer = transactional_producer(kafka, transactional_id)
    newer.init_transactions(30)
    return newer


def _fence_member(kafka: KafkaConfig, group_id: str, instance: str, topic: str) -> None:
    """A consumer joins with ``instance``, takes the name's assignment, and goes away
    without leaving (a static member never leaves): the member it replaced is fenced."""
    intruder = read_committed_consumer(kafka, group_id, overrides={"group.instance.id": instance})
    intruder.subscribe([topic])
    deadline = time.monotonic() + JOIN_S
    while not intruder.assignment() and time.monotonic() < deadline:
        intruder.poll(0.5)
    assert intruder.assignment(), f"the intruder did not join within {JOIN_S} s"
    intruder.close()


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


def test_the_replay_buffer_replaces_a_fenced_producer_and_releases_each_group_once(
    kafka_config: KafkaConfig, replay_buffer_thread
):
    """Before the seam, a fatal transaction error ended the replay buffer's process."""
    cfg = _config(kafka_config, **{"replay_buffer.transactional_id": unique_name("pinned")})
    metrics = ReplayBufferMetrics(CollectorRegistry())
    first = [f"g{uuid.uuid4().hex[:10]}" for _ in range(4)]
    later = [f"h{uuid.uuid4().hex[:10]}" for _ in range(4)]
    with replay_buffer_thread(cfg, metrics) as thread:
        _produce(kafka_config, first)
        _wait_for_keys(cfg, first, thread.is_alive)
        _fence(kafka_config, cfg.replay_buffer.transactional_id)  # once, as a restart does
        _produce(kafka_config, later)
        keys = _wait_for_keys(cfg, first + later, thread.is_alive)
    assert len(keys) == len(set(keys)) == len(first + later) * N  # each exactly once
    assert metrics.producer_replacements.labels(cause="fatal")._value.get() == 1


def test_the_replay_buffer_replaces_a_consumer_fenced_by_its_own_name(
    kafka_config: KafkaConfig, replay_buffer_thread
):
    """Before, the fatal FENCED_INSTANCE_ID was logged as a transient error and the dead
    consumer polled on: no group was ever released again, silently (seen after a broker
    restart, where a lone static member can fence itself)."""
    cfg = _config(kafka_config, **{"replay_buffer.group_instance_id": "rb0"})
    metrics = ReplayBufferMetrics(CollectorRegistry())
    first = [f"g{uuid.uuid4().hex[:10]}" for _ in range(4)]
    later = [f"h{uuid.uuid4().hex[:10]}" for _ in range(4)]
    with replay_buffer_thread(cfg, metrics) as thread:
        _produce(kafka_config, first)
        _wait_for_keys(cfg, first, thread.is_alive)
        topic = Topics.from_config(kafka_config).turns
        _fence_member(kafka_config, cfg.replay_buffer.group_id, "rb0", topic)
        _produce(kafka_config, later)
        keys = _wait_for_keys(cfg, first + later, thread.is_alive)
    assert len(keys) == len(set(keys)) == len(first + later) * N  # each exactly once


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
