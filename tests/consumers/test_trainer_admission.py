"""``trainer.min_successful_per_group`` on the real broker: a complete group with fewer
completed-or-truncated members than required is skipped (consumed, counted, never yielded,
and not delivered again from the client's position); the others are yielded whole, their
failed members included."""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry

from rolloutbus.config import KafkaConfig, TrainerConfig
from rolloutbus.consumers import TrainerClient, TrajectoryGroup
from rolloutbus.kafka.clients import idempotent_producer
from rolloutbus.schemas.trajectories import TrajectoryStatus
from tests.builders import make_trajectory, produce_trajectories

TAKE_TIMEOUT_S = 60.0  # seconds; a group join on two busy cores takes a few
OK, CUT, FAILED = TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED, TrajectoryStatus.FAILED


def _publish(kafka: KafkaConfig, groups: dict[str, list[TrajectoryStatus]]) -> None:
    trajectories = [
        make_trajectory(
            uid,
            s,
            group_size=len(statuses),
            status=status,
            error="replica timed out" if status is FAILED else None,
        )
        for uid, statuses in groups.items()
        for s, status in enumerate(statuses)
    ]
    produce_trajectories(idempotent_producer(kafka), kafka, trajectories)


def _take_all(client: TrainerClient, settle_s: float = 3.0) -> list[TrajectoryGroup]:
    got = list(client.groups(max_groups=1, timeout_s=TAKE_TIMEOUT_S))
    return got + list(client.groups(timeout_s=settle_s))


def test_groups_with_too_few_successful_members_are_skipped_counted_and_not_redelivered(
    kafka_config,
):
    groups = {
        "whole": [OK, OK, OK],
        "cut": [CUT, OK, FAILED],  # truncated counts as successful
        "thin": [OK, FAILED, FAILED],
        "none": [FAILED, FAILED, FAILED],
    }
    uids = {name: f"{name}{uuid.uuid4().hex[:6]}" for name in groups}
    _publish(kafka_config, {uids[name]: statuses for name, statuses in groups.items()})
    registry = CollectorRegistry()
    with TrainerClient(
        kafka_config,
        f"g{uuid.uuid4().hex[:8]}",
        config=TrainerConfig(min_successful_per_group=2, dedupe_window_keys=0),
        registry=registry,
    ) as client:
        got = _take_all(client)
        position = client.position()
    assert sorted(g.uid for g in got) == sorted([uids["cut"], uids["whole"]])
    assert all(len(g) == 3 for g in got)  # yielded whole, failed members included
    assert client.skipped.too_few_successful == 2
    assert sorted(n for _, n in client.skipped.recent) == [0, 1]
    assert (
        registry.get_sample_value(
            "rolloutbus_trainer_client_skipped_groups_total", {"reason": "too_few_successful"}
        )
        == 2
    )
    # resumed from its position (a checkpoint's): only what came after it is delivered
    later = f"later{uuid.uuid4().hex[:6]}"
    _publish(kafka_config, {later: [OK, OK, OK]})
    with TrainerClient(
        kafka_config,
        f"g{uuid.uuid4().hex[:8]}",
        resume_from=position,
        config=TrainerConfig(dedupe_window_keys=0),
    ) as again:
        assert [g.uid for g in _take_all(again)] == [later]

    # the default (0): every complete group is the trainer's
    with TrainerClient(
        kafka_config, f"g{uuid.uuid4().hex[:8]}", registry=CollectorRegistry()
    ) as everything:
        assert len(_take_all(everything)) == 5
