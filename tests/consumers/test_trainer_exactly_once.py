"""Exactly once per trainer checkpoint, on the real broker: a crash before the Kafka commit,
a commit newer than the checkpoint, a rebalance between two clients mid-stream, a commit
after the partitions were lost, and (slow) a trainer process SIGKILLed between its step and
its commit. Groups interleave in their partition (a0 b0 b1 b2 a1 a2), so positions that
must list groups yielded past an incomplete one are exercised too. The clients run with
the dedupe window off: exactly-once must come from the position alone."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, TopicPartition

from rolloutbus.config import Config, KafkaConfig, TrainerConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.position import PartitionPosition
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import idempotent_producer, read_committed_consumer
from rolloutbus.topics import Topics, partition_for, uid_of_key
from tests.builders import make_group, trajectory_records
from tests.helpers import unique_name
from tests.pipeline import read_topic, write_config
from tests.source_tree import PROGRAMS

GROUP_SIZE = 3
SAFETY_NET_OFF = TrainerConfig(dedupe_window_keys=0)
TAKE_TIMEOUT_S = 90.0  # seconds; a group join on two busy cores takes a few
SETTLE_S = 3.0  # seconds to wait for a duplicate that should not come


# -- trajectories on the topic -----------------------------------------------------------


def _records(uid: str) -> list[tuple[str, bytes]]:
    group = make_group(
        uid, GROUP_SIZE, prompts=[1, 2, 3], responses=[4, 5], rollout_log_probs=[-0.1, -0.2]
    )
    return trajectory_records(group)


def _interleaved(uids: list[str]) -> list[tuple[str, bytes]]:
    """Pairs a, b as a0 b0 b1 b2 a1 a2: b completes while a is incomplete."""
    out = []
    for i in range(0, len(uids) - 1, 2):
        a, b = _records(uids[i]), _records(uids[i + 1])
        out += [a[0], *b, *a[1:]]
    if len(uids) % 2:
        out += _records(uids[-1])
    return out


def publish_groups(kafka: KafkaConfig, count: int, *, record_per_batch: bool = False) -> list[str]:
    """``count`` complete groups on the trajectory topic, interleaved in pairs per partition.
    ``record_per_batch``: one record per producer batch, so a fetch can bring just one."""
    uids = [uuid.uuid4().hex for _ in range(count)]
    by_partition: dict[int, list[str]] = {}
    for uid in uids:
        by_partition.setdefault(partition_for(uid, kafka.partitions), []).append(uid)
    producer = idempotent_producer(
        kafka, {"linger.ms": 0, "batch.num.messages": 1} if record_per_batch else None
    )
    topic = Topics.from_config(kafka).trajectories
    failed: list[str] = []  # flush() counts what is still queued, not what failed

    def delivered(err, msg) -> None:
        if err is not None:
            failed.append(f"{msg.key()!r}: {err}")

    for partition, mine in by_partition.items():
        for key, value in _interleaved(mine):
            producer.produce(
                topic, key=key, value=value, partition=partition, on_delivery=delivered
            )
    assert producer.flush(30) == 0
    assert not failed, f"{len(failed)} records were not written: {failed[:5]}"
    return uids


# -- receiving ---------------------------------------------------------------------------


def take(client: TrainerClient, count: int) -> list[TrajectoryGroup]:
    got: list[TrajectoryGroup] = []
    deadline = time.monotonic() + TAKE_TIMEOUT_S
    while len(got) < count and time.monotonic() < deadline:
        got.extend(client.groups(max_groups=count - len(got), timeout_s=1.0))
    return got


def take_all(client: TrainerClient, count: int) -> list[str]:
    """``count`` groups, then whatever else comes within SETTLE_S (there should be none)."""
    got = take(client, count)
    got += client.groups(timeout_s=SETTLE_S)
    return [g.uid for g in got]


def take_until_interleaved(client: TrainerClient, minimum: int) -> list[str]:
    """At least ``minimum`` groups, stopping right after one yielded past an incomplete one."""
    got: list[str] = []
    for group in client.groups(timeout_s=TAKE_TIMEOUT_S):
        got.append(group.uid)
        if len(got) >= minimum and any(p.yielded for p in client.position().partitions.values()):
            break
    return got


def exactly_once(*parts: list[str], expected: list[str], why: str = "") -> None:
    every = [uid for part in parts for uid in part]
    twice = [uid for uid, n in Counter(every).items() if n > 1]
    assert not twice, f"groups delivered twice: {twice}"
    assert set(every) == set(expected), f"missing: {set(expected) - set(every)}; {why}"


# -- (a) crash before the commit -----------------------------------------------------------


def test_a_crash_without_commit_resumes_exactly_at_the_checkpoint(kafka_config):
    uids = publish_groups(kafka_config, 12)
    group_id = unique_name("trainer")
    with TrainerClient(kafka_config, group_id, config=SAFETY_NET_OFF) as first:
        trained = take_until_interleaved(first, minimum=3)
        checkpoint = json.dumps(first.position().model_dump(mode="json"))
    # closed without a commit: as far as Kafka knows, nothing was used
    assert any(p["yielded"] for p in json.loads(checkpoint)["partitions"].values())
    with TrainerClient(
        kafka_config, group_id, resume_from=json.loads(checkpoint), config=SAFETY_NET_OFF
    ) as resumed:
        rest = take_all(resumed, len(uids) - len(trained))
    exactly_once(trained, rest, expected=uids)


# -- (b) commit newer than the checkpoint --------------------------------------------------


def test_a_commit_newer_than_the_checkpoint_does_not_skip_what_the_checkpoint_lacks(kafka_config):
    uids = publish_groups(kafka_config, 12)
    group_id = unique_name("trainer")
    with TrainerClient(kafka_config, group_id, config=SAFETY_NET_OFF) as first:
        in_checkpoint = take(first, 3)
        checkpoint = first.position().model_dump(mode="json")
        after_checkpoint = take(first, 3)
        first.commit(in_checkpoint + after_checkpoint)  # then the crash, before the next checkpoint
    with TrainerClient(
        kafka_config, group_id, resume_from=checkpoint, config=SAFETY_NET_OFF
    ) as resumed:
        rest = take_all(resumed, len(uids) - 3)
    exactly_once([g.uid for g in in_checkpoint], rest, expected=uids)
    # a client that does not checkpoint goes by the (advisory) commit
    with TrainerClient(kafka_config, group_id, config=SAFETY_NET_OFF) as plain:
        after_commit = take_all(plain, len(uids) - 6)
    exactly_once([g.uid for g in in_checkpoint + after_checkpoint], after_commit, expected=uids)


# -- (c) a rebalance mid-stream -------------------------------------------------------------


class _TrainerThread(threading.Thread):
    STEP_S = 0.1  # seconds per "train step": long enough for the second client to join mid-stream
    # groups per commit (a train batch): a revoke finds groups yielded, not committed. Not a
    # divisor of 30: the revoke comes at a heartbeat (every 3 s = 30 steps), which would
    # otherwise always follow a commit
    COMMIT_EVERY = 7
    # one producer batch per partition per fetch: the client works through both partitions
    # together instead of draining one first, so a revoke always finds groups of its own
    INTERLEAVED_FETCH = {"max.partition.fetch.bytes": 1}

    def __init__(
        self, kafka: KafkaConfig, group_id: str, received: list[str], stop: threading.Event
    ):
        super().__init__(daemon=True)
        self.kafka, self.group_id, self.received, self.stop = kafka, group_id, received, stop
        self.mine: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with TrainerClient(
                self.kafka,
                self.group_id,
                config=SAFETY_NET_OFF,
                consumer_overrides=self.INTERLEAVED_FETCH,
            ) as client:
                uncommitted: list[TrajectoryGroup] = []
                while not self.stop.is_set():
                    for group in client.groups(max_groups=1, timeout_s=0.5):
                        time.sleep(self.STEP_S)
                        self.mine.append(group.uid)
                        self.received.append(group.uid)
                        uncommitted.append(group)
                        if len(uncommitted) == self.COMMIT_EVERY:
                            client.commit(uncommitted)
                            uncommitted = []
                client.commit(uncommitted)  # before leaving: close() commits nothing by itself
        except BaseException as exc:  # reported by the test
            self.error = exc


def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_two_clients_across_a_rebalance_never_share_or_drop_a_group(kafka_config, caplog):
    caplog.set_level(logging.INFO, logger="rolloutbus.consumers")  # assignments, for a failure
    # ~50 groups per partition at STEP_S each: neither partition is drained while the second
    # client joins (a few seconds), so each has records left to hand over
    uids = publish_groups(kafka_config, 100, record_per_batch=True)
    group_id, received, stop = unique_name("trainer"), [], threading.Event()
    first = _TrainerThread(kafka_config, group_id, received, stop)
    second = _TrainerThread(kafka_config, group_id, received, stop)
    first.start()
    try:
        assert _wait_until(lambda: len(first.mine) >= 5, TAKE_TIMEOUT_S), (
            f"the first client got {len(first.mine)} groups in {TAKE_TIMEOUT_S} s"
        )
        second.start()
        _wait_until(
            lambda: set(received) >= set(uids) or first.error or second.error, TAKE_TIMEOUT_S
        )
        time.sleep(SETTLE_S)
    finally:
        stop.set()
        first.join(30)
        second.join(30)
    assert first.error is None and second.error is None, first.error or second.error
    assert second.mine, "the second client got nothing: the rebalance did not happen mid-stream"
    missing = set(uids) - set(first.mine) - set(second.mine)
    moves = [r.getMessage() for r in caplog.records if r.name.startswith("rolloutbus.consumers")]
    why = f"{_whereabouts(kafka_config, missing)}; the clients' log: {moves}" if missing else ""
    exactly_once(first.mine, second.mine, expected=uids, why=why)


def _whereabouts(kafka: KafkaConfig, uids: set[str]) -> str:
    """Where the records of groups no client yielded lie on the topic: written and missed,
    or never written (what a failure of the test needs to say)."""
    if not uids:
        return ""
    topic = Topics.from_config(kafka).trajectories
    found = [
        f"{m.key().decode()}@{m.partition()}:{m.offset()}"
        for m in read_topic(Config(kafka=kafka), topic)
        if uid_of_key(m.key().decode()) in uids
    ]
    return f"their records on {topic}: {found or 'none'}"


# -- (d) commit after the partitions were lost ----------------------------------------------


def test_a_commit_after_the_partitions_were_lost_is_a_broker_error(kafka_config):
    publish_groups(kafka_config, 4)
    group_id, received, stop = unique_name("trainer"), [], threading.Event()
    # the broker's minimum session timeout; a member that does not poll for 6 s leaves the group
    quick = {
        "consumer_overrides": {"session.timeout.ms": 6000},
        "config": TrainerConfig(dedupe_window_keys=0, max_poll_interval_s=6.0),
    }
    slow = TrainerClient(kafka_config, group_id, **quick)
    try:
        [group] = take(slow, 1)
        other = _TrainerThread(kafka_config, group_id, received, stop)
        other.start()  # the rebalance waits for `slow`, busy training, until it is dropped
        assert _wait_until(lambda: received, TAKE_TIMEOUT_S), (
            "the second client never got a partition"
        )
        with pytest.raises(BrokerError) as caught:
            slow.commit(group)
        assert isinstance(caught.value.__cause__, KafkaException)
        assert group.resume is not None
        topic = Topics.from_config(kafka_config).trajectories
        where = f"{topic}[{group.partition}]@{group.resume.offset}"
        assert where in str(caught.value)
        # once it has polled it knows the partition went: nothing to commit, no error
        list(slow.groups(timeout_s=2.0))
        slow.commit(group)
    finally:
        stop.set()
        slow.close()
    other.join(30)
    assert other.error is None, other.error


# -- a real trainer process, SIGKILLed ----------------------------------------------------


def _run_trainer(
    config_path: Path, group_id: str, checkpoint: Path, expect: int, *extra: str, log: Path
) -> int:
    argv = [
        sys.executable,
        str(PROGRAMS / "checkpointing_trainer.py"),
        str(config_path),
        group_id,
        str(checkpoint),
        "--expect",
        str(expect),
        *extra,
    ]
    with log.open("ab") as out:
        return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=240).returncode


def _committed(kafka: KafkaConfig, group_id: str) -> dict[int, PartitionPosition]:
    consumer = read_committed_consumer(kafka, group_id)  # reads the group's offsets, never joins it
    try:
        topic = Topics.from_config(kafka).trajectories
        parts = consumer.committed(
            [TopicPartition(topic, p) for p in range(kafka.partitions)], timeout=30
        )
    finally:
        consumer.close()
    return {
        tp.partition: PartitionPosition.from_commit(tp.offset, tp.metadata)
        for tp in parts
        if tp.offset >= 0
    }


@pytest.mark.slow
def test_a_trainer_killed_between_step_and_commit_trains_every_group_exactly_once(
    kafka_config, tmp_path
):
    uids = publish_groups(kafka_config, 16)
    config_path = write_config(Config(kafka=kafka_config), tmp_path / "c.yaml")
    group_id, checkpoint, log = (
        unique_name("trainer"),
        tmp_path / "checkpoint.json",
        tmp_path / "trainer.log",
    )

    # checkpointed its 4th group, killed before committing it: Kafka's commit is one group behind
    assert (
        _run_trainer(
            config_path, group_id, checkpoint, len(uids), "--kill-before-commit", "4", log=log
        )
        == -9
    )
    saved = json.loads(checkpoint.read_text())
    assert len(saved["trained"]) == 4
    assert _committed(kafka_config, group_id) != {
        int(p): PartitionPosition.model_validate(pos)
        for p, pos in saved["position"]["partitions"].items()
    }
    # stepped its 3rd group of this run, killed before the checkpoint: that step is lost
    assert (
        _run_trainer(
            config_path, group_id, checkpoint, len(uids), "--kill-after-step", "3", log=log
        )
        == -9
    )
    assert len(json.loads(checkpoint.read_text())["trained"]) == 6
    assert _run_trainer(config_path, group_id, checkpoint, len(uids), log=log) == 0, (
        log.read_text()[-3000:]
    )
    trained = json.loads(checkpoint.read_text())["trained"]
    exactly_once(trained, expected=uids)
