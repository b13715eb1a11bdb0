"""Exactly-once trajectories when the replay buffer is killed with SIGKILL mid-stream and
restarted, and when a released group is re-run under a new attempt (a redelivered prompt)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer

from rolloutbus.config import Config, KafkaConfig, ReplayBufferConfig
from rolloutbus.topics import Topics, partition_for, uid_of_key
from tests.helpers import unique_name
from tests.pipeline import read_topic, spawn, stop, write_config
from tests.synthetic import N, group_events, make_events

pytestmark = pytest.mark.kafka  # replay-buffer processes on the test broker


def _produce(kafka: KafkaConfig, events) -> None:
    p = Producer(
        {
            **kafka.client_settings(),
            "enable.idempotence": True,
            "linger.ms": 5,
            "message.max.bytes": kafka.max_message_bytes,
        }
    )
    topic = Topics.from_config(kafka).turns
    for uid, key, value in events:
        p.produce(topic, key=key, value=value, partition=partition_for(uid, kafka.partitions))
        p.poll(0)
    assert p.flush(30) == 0


def _trajectory_keys(cfg: Config) -> list[str]:
    return [m.key().decode() for m in read_topic(cfg, Topics.from_config(cfg.kafka).trajectories)]


def _wait_for(cfg: Config, count: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    keys: list[str] = []
    while time.monotonic() < deadline:
        keys = _trajectory_keys(cfg)
        if len(keys) >= count:
            return keys
        time.sleep(0.5)
    return keys


@pytest.mark.slow
def test_sigkill_and_restart_release_every_group_exactly_once(kafka_config, tmp_path):
    cfg = Config(
        kafka=kafka_config,
        replay_buffer=ReplayBufferConfig(
            group_id=unique_name("rb"), transactional_id=unique_name("tx")
        ),
    )
    config_path = write_config(cfg, tmp_path / "c.yaml")
    first, second = make_events(150), make_events(150)
    _produce(kafka_config, first)

    proc = spawn(["replay-buffer", "run"], config_path, tmp_path / "rb1.log")
    seen = _wait_for(cfg, 40, timeout_s=120)
    assert len(seen) >= 40, (tmp_path / "rb1.log").read_text()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)  # no clean shutdown, no final commit
    proc.wait()
    partial = len(_trajectory_keys(cfg))

    _produce(kafka_config, second)
    # a released group redelivered under a new attempt (the session worker re-ran it)
    rerun_uid = first[0][0]
    _produce(kafka_config, group_events(rerun_uid, attempt="rerun"))

    proc = spawn(["replay-buffer", "run"], config_path, tmp_path / "rb2.log")
    try:
        keys = _wait_for(cfg, 300 * N, timeout_s=180)
        time.sleep(3)  # give a duplicate, if any, the time to appear
        keys = _trajectory_keys(cfg)
    finally:
        stop(proc)
    counts = Counter(keys)
    dupes = {k: c for k, c in counts.items() if c > 1}
    assert not dupes, f"keys written twice: {list(dupes)[:5]}"
    expected = {uid for uid, _, _ in first + second}
    assert {uid_of_key(k) for k in keys} == expected
    assert len(keys) == len(expected) * N
    assert 0 < partial < len(keys)  # the kill really landed mid-stream


def test_group_waits_for_all_sessions(kafka_config, tmp_path):
    """A group with one session still running is not released (no silently short group)."""
    cfg = Config(
        kafka=kafka_config,
        replay_buffer=ReplayBufferConfig(
            group_id=unique_name("rb"), transactional_id=unique_name("tx")
        ),
    )
    uid = uuid.uuid4().hex
    events = group_events(uid)
    *all_but_last, last = events
    _produce(kafka_config, all_but_last)
    proc = spawn(
        ["replay-buffer", "run"], write_config(cfg, tmp_path / "c.yaml"), tmp_path / "rb.log"
    )
    try:
        time.sleep(6)
        assert _trajectory_keys(cfg) == []
        _produce(kafka_config, [last])
        keys = _wait_for(cfg, N, timeout_s=60)
    finally:
        stop(proc)
    assert sorted(keys) == [f"{uid}_{i}_0" for i in range(N)]
