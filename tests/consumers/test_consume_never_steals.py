"""Looking never takes (real broker): ``rolloutbus consume`` reads in a throwaway group and
commits nothing, so no trainer loses a group to it; only ``--group-id G --commit`` consumes
as G. And a publish that publishes nothing fails."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from rolloutbus.config import Config, KafkaConfig, TrainerConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.kafka.clients import idempotent_producer
from rolloutbus.topics import Topics
from tests.builders import make_group, produce_trajectories
from tests.helpers import unique_name
from tests.pipeline import write_config

GROUP_SIZE = 2
GROUPS = 6
TRAINED_FIRST = 2  # groups the trainer has used (and committed) before anyone looks
TAKE_TIMEOUT_S = 90.0  # seconds; a group join on two busy cores takes a few
IDLE_S = "8"  # seconds without a new group before `consume` stops


def _publish_trajectory_groups(kafka: KafkaConfig, count: int) -> list[str]:
    """``count`` complete groups on the trajectory topic, as the replay buffer writes them."""
    uids = [uuid.uuid4().hex for _ in range(count)]
    groups = [make_group(uid, GROUP_SIZE, rollout_log_probs=[-0.5]) for uid in uids]
    produce_trajectories(idempotent_producer(kafka), kafka, [t for g in groups for t in g])
    return uids


def _committed(kafka: KafkaConfig, group_id: str) -> dict[int, tuple[int, str]]:
    """The group's committed offsets and metadata on the trajectory topic, read without
    joining it (a plain confluent-kafka consumer, not the code under test)."""
    consumer = Consumer({**kafka.client_settings(), "group.id": group_id})
    try:
        topic = Topics.from_config(kafka).trajectories
        parts = [TopicPartition(topic, p) for p in range(kafka.partitions)]
        committed = consumer.committed(parts, timeout=30)
    finally:
        consumer.close()
    return {tp.partition: (tp.offset, tp.metadata or "") for tp in committed if tp.offset >= 0}


def _groups_with_commits(kafka: KafkaConfig) -> set[str]:
    """Every consumer group on the broker that has committed on this test's topic."""
    admin = AdminClient(kafka.client_settings())  # kept alive until the answer is in
    listed = admin.list_consumer_groups().result(timeout=30)
    assert not listed.errors, listed.errors
    return {g.group_id for g in listed.valid if _committed(kafka, g.group_id)}


def _train(kafka: KafkaConfig, group_id: str, count: int) -> list[str]:
    """A trainer of ``group_id``: take ``count`` groups, committing each."""
    got: list[str] = []
    with TrainerClient(kafka, group_id) as client:
        for group in client.groups(timeout_s=TAKE_TIMEOUT_S):
            client.commit(group)
            got.append(group.uid)
            if len(got) == count:
                break
    return got


def _consume(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rolloutbus.cli",
            "consume",
            "--timeout",
            IDLE_S,
            "--config",
            str(config),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _received(result: subprocess.CompletedProcess) -> set[str]:
    return {
        line.split()[2] for line in result.stderr.splitlines() if line.startswith("received group")
    }


def test_a_plain_consume_leaves_every_trainer_groups_committed_offsets_untouched(
    kafka_config, tmp_path
):
    uids = _publish_trajectory_groups(kafka_config, GROUPS)
    trainer = unique_name("trainer")
    trained = _train(kafka_config, trainer, TRAINED_FIRST)
    before = _committed(kafka_config, trainer)
    assert before, "the trainer committed its position"
    config = write_config(
        Config(kafka=kafka_config, trainer=TrainerConfig(group_id=trainer)), tmp_path / "c.yaml"
    )

    plain = _consume(config)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert _received(plain) == set(uids)  # it saw every group, the trained ones too
    where_the_trainer_is = _consume(config, "--group-id", trainer)
    assert where_the_trainer_is.returncode == 0, where_the_trainer_is.stderr[-3000:]
    assert _received(where_the_trainer_is) == set(uids) - set(trained)

    assert _committed(kafka_config, trainer) == before
    assert _groups_with_commits(kafka_config) == {trainer}  # nobody else committed either
    # and the trainer still gets every group it had not used
    assert set(_train(kafka_config, trainer, GROUPS - TRAINED_FIRST)) == set(uids) - set(trained)


def test_consume_commits_only_as_a_named_group_and_warns_when_it_is_a_trainers(
    kafka_config, tmp_path
):
    uids = _publish_trajectory_groups(kafka_config, 2)
    trainer = unique_name("trainer")
    config = write_config(
        Config(kafka=kafka_config, trainer=TrainerConfig(group_id=trainer)), tmp_path / "c.yaml"
    )
    alone = _consume(config, "--commit")
    assert alone.returncode == 2 and "--commit needs --group-id" in alone.stderr

    taken = _consume(config, "--group-id", trainer, "--commit")
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert _received(taken) == set(uids)
    assert f"consuming as group '{trainer}' with --commit: it is trainer.group_id" in taken.stderr
    assert _committed(kafka_config, trainer)  # used up for the trainer's group, as asked


def test_publish_exits_nonzero_when_no_row_was_published(kafka_config, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"prompt": "a string, not messages"}\n'
        '{"prompt": [{"role": "user", "content": "hi"}], "agent_name": "no_such_loop"}\n'
    )
    config = write_config(Config(kafka=kafka_config), tmp_path / "c.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "publish", str(rows), "-q", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 4, result.stderr[-3000:]  # all refused (docs/cli.md)
    assert "read 2 rows: 0 published, 2 to the dead-letter topic" in result.stderr
    assert "no row was published" in result.stderr and result.stdout == ""
