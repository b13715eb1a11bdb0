"""The trainer client's staleness bound on the real broker: a group whose oldest token is
older than ``current - staleness_threshold`` versions is dropped (and counted, and never
delivered again from the client's position) or down-weighted, by policy; the current
version comes from the trainer or from rollout.control."""

from __future__ import annotations

import time
import uuid

from prometheus_client import CollectorRegistry

from rolloutbus.config import AsyncTrainingConfig, KafkaConfig, TrainerConfig
from rolloutbus.consumers.client import TrainerClient
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.consumers.staleness import StalenessFilter
from rolloutbus.kafka.clients import idempotent_producer
from rolloutbus.kafka.control import publish_policy_version
from rolloutbus.schemas.control import PolicyVersionPublished, RunStarted
from rolloutbus.schemas.trajectories import (
    Trajectory,
    encode_trajectories,
    trajectories_to_batch,
)
from rolloutbus.topics import Topics, partition_for
from tests.builders import make_trajectory

GROUP_SIZE = 2
TAKE_TIMEOUT_S = 60.0  # seconds; a group join on two busy cores takes a few


def _trajectories(uid: str, versions: list[tuple[int | None, int | None]]) -> list[Trajectory]:
    return [
        make_trajectory(
            uid,
            s,
            group_size=len(versions),
            rollout_log_probs=[-0.5],
            min_global_steps=low,
            max_global_steps=high,
        )
        for s, (low, high) in enumerate(versions)
    ]


def _group(versions: list[tuple[int | None, int | None]]) -> TrajectoryGroup:
    uid = uuid.uuid4().hex
    return TrajectoryGroup(uid, trajectories_to_batch(_trajectories(uid, versions)), 0, 0)


def _publish(kafka: KafkaConfig, groups: dict[str, list[tuple[int, int]]]) -> None:
    producer = idempotent_producer(kafka)
    topic = Topics.from_config(kafka).trajectories
    for uid, versions in groups.items():
        ts = _trajectories(uid, versions)
        for t, value in zip(ts, encode_trajectories(ts), strict=True):
            producer.produce(
                topic, key=t.key, value=value, partition=partition_for(uid, kafka.partitions)
            )
    assert producer.flush(30) == 0


def _take(client: TrainerClient, count: int, settle_s: float = 3.0) -> list[TrajectoryGroup]:
    got: list[TrajectoryGroup] = []
    deadline = time.monotonic() + TAKE_TIMEOUT_S
    while len(got) < count and time.monotonic() < deadline:
        got.extend(client.groups(max_groups=count - len(got), timeout_s=1.0))
    return got + list(client.groups(timeout_s=settle_s))


def test_filter_uses_the_oldest_version_of_the_group():
    cfg = AsyncTrainingConfig(staleness_threshold=1)
    stale_filter = StalenessFilter(cfg, CollectorRegistry())
    stale_filter.policy_version = 5
    fresh = _group([(4, 5), (5, 5)])
    mixed = _group([(3, 5), (5, 5)])  # one token sampled by version 3: 2 versions old
    unversioned = _group([(None, None), (None, None)])
    assert stale_filter.admit(fresh) and fresh.staleness == 1
    assert not stale_filter.admit(mixed) and mixed.staleness == 2
    assert stale_filter.admit(unversioned) and unversioned.staleness is None
    assert (mixed.min_policy_version, mixed.max_policy_version) == (3, 5)
    report = stale_filter.report
    assert (report.dropped, report.down_weighted, report.max_staleness) == (1, 0, 2)
    assert report.recent_dropped == [(mixed.uid, 3, 5)]

    weighted = StalenessFilter(
        AsyncTrainingConfig(
            staleness_threshold=0, stale_group_policy="down_weight", stale_group_weight=0.25
        ),
        CollectorRegistry(),
    )
    weighted.policy_version = 1
    old = _group([(0, 0), (1, 1)])
    assert weighted.admit(old) and old.loss_weight == 0.25
    assert weighted.report.down_weighted == 1


def test_stale_groups_are_dropped_counted_and_not_redelivered(kafka_config):
    uids = {uuid.uuid4().hex: v for v in ([(0, 0)] * 2, [(2, 3)] * 2, [(1, 3), (3, 3)])}
    _publish(kafka_config, uids)
    registry = CollectorRegistry()
    # current version 3, threshold 1: groups whose oldest version is < 2 are stale
    client = TrainerClient(
        kafka_config,
        f"g{uuid.uuid4().hex[:8]}",
        config=TrainerConfig(dedupe_window_keys=0),
        async_training=AsyncTrainingConfig(staleness_threshold=1),
        registry=registry,
    )
    client.set_policy_version(3)
    with client:
        got = _take(client, 1)
        position = client.position()
    assert [g.min_policy_version for g in got] == [2]
    assert client.stale.dropped == 2 and client.stale.max_staleness == 3
    assert (
        registry.get_sample_value(
            "rolloutbus_trainer_client_stale_groups_total", {"action": "dropped"}
        )
        == 2
    )
    # resumed from its position, the dropped groups are not delivered again
    with TrainerClient(
        kafka_config,
        f"g{uuid.uuid4().hex[:8]}",
        resume_from=position,
        config=TrainerConfig(dedupe_window_keys=0),
    ) as again:
        assert _take(again, 0, settle_s=3.0) == []


def test_the_client_follows_the_version_on_the_control_topic(kafka_config):
    publish_policy_version(
        kafka_config,
        PolicyVersionPublished(policy_version=4, weights_path="/ckpt/v4", global_step=4),
    )
    old, fresh = uuid.uuid4().hex, uuid.uuid4().hex
    _publish(kafka_config, {old: [(1, 1)] * GROUP_SIZE, fresh: [(4, 4)] * GROUP_SIZE})
    with TrainerClient(
        kafka_config,
        f"g{uuid.uuid4().hex[:8]}",
        async_training=AsyncTrainingConfig(staleness_threshold=2),
        follow_control=True,
        registry=CollectorRegistry(),
    ) as client:
        got = _take(client, 1)
        assert [g.uid for g in got] == [fresh]
        assert client.stale.recent_dropped == [(old, 1, 4)]

        # a second run supersedes the first: its v3 is current, and a later record of the
        # older run (v9, no run fields: epoch 0) is ignored
        run = RunStarted(run_id="run2", run_epoch=1)
        for event in (
            run,
            _run_version(run, 0),
            _run_version(run, 3),
            PolicyVersionPublished(policy_version=9, weights_path="/ckpt/v9"),
        ):
            publish_policy_version(kafka_config, event)
        _wait_for_version(client, 3)
        # stale under v4 (or v9), within the bound under run 2's v3
        second = uuid.uuid4().hex
        _publish(kafka_config, {second: [(1, 1)] * GROUP_SIZE})
        [group] = _take(client, 1)
        assert group.uid == second and group.staleness == 2
        assert client.staleness is not None and client.staleness.policy_version == 3


def _run_version(run: RunStarted, v: int) -> PolicyVersionPublished:
    return PolicyVersionPublished(
        policy_version=v, weights_path=f"/ckpt/run2/v{v}", run_id=run.run_id, run_epoch=1
    )


def _wait_for_version(client: TrainerClient, version: int) -> None:
    """Idle polls follow the control topic (no group is waiting meanwhile)."""
    deadline = time.monotonic() + TAKE_TIMEOUT_S
    while client.staleness is not None and client.staleness.policy_version != version:
        assert time.monotonic() < deadline, f"still at {client.staleness.policy_version}"
        assert list(client.groups(max_groups=1, timeout_s=0.5)) == []
