"""Policy versions on rollout.control, on the real broker: the latest published version is
what a late reader finds, a follower sees the current one and then new ones in order (the
newest of what arrived since its last poll),
and a record that is not a control event is skipped instead of stopping the followers."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from rolloutbus.kafka.control import (
    PolicyVersionFollower,
    PolicyVersionPublisher,
    latest_policy_version,
)
from rolloutbus.schemas.control import (
    PolicyVersionPublished,
    decode_control_event,
    encode_control_event,
)
from rolloutbus.topics import CONTROL_PARTITION, Topics

FOLLOW_TIMEOUT_S = 10.0  # seconds; a record reaches a follower in milliseconds


def _version(v: int, **kw) -> PolicyVersionPublished:
    return PolicyVersionPublished(
        policy_version=v, weights_path=f"/ckpt/v{v}", global_step=2 * v, trainer_id="t", **kw
    )


def test_event_round_trips_and_rejects_a_negative_version():
    event = _version(3, model_name="tiny-qwen3")
    assert decode_control_event(encode_control_event(event)) == event
    with pytest.raises(ValidationError):
        PolicyVersionPublished(policy_version=-1)
    assert PolicyVersionPublished(policy_version=0).weights_path is None  # initial weights


def test_latest_version_is_the_last_published(kafka_config):
    assert latest_policy_version(kafka_config) is None
    publisher = PolicyVersionPublisher(kafka_config)
    offsets = [publisher.publish(_version(v)) for v in (0, 1, 2)]
    assert offsets == sorted(offsets)
    latest = latest_policy_version(kafka_config)
    assert latest is not None and latest.policy_version == 2
    assert latest.weights_path == "/ckpt/v2" and latest.global_step == 4


def test_follower_sees_the_current_version_then_new_ones_in_order(kafka_config, make_producer):
    publisher = PolicyVersionPublisher(kafka_config)
    publisher.publish(_version(1))
    with PolicyVersionFollower(kafka_config) as follower:
        first = follower.poll(FOLLOW_TIMEOUT_S)
        assert first is not None and first.policy_version == 1  # published before it started
        assert follower.poll(0.2) is None  # nothing new
        # a record that is not a control event: logged and skipped
        producer = make_producer(kafka=kafka_config)
        producer.produce(
            Topics.from_config(kafka_config).control,
            key="policy_version",
            value=b"not json",
            partition=CONTROL_PARTITION,
        )
        producer.flush(10)
        for v in (2, 3, 4):
            publisher.publish(_version(v))
        seen: list[int] = []  # what each poll returned: the newest of what had arrived
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while (not seen or seen[-1] != 4) and time.monotonic() < deadline:
            if (event := follower.poll(1.0)) is not None:
                seen.append(event.policy_version)
        assert seen and seen[-1] == 4 and seen == sorted(set(seen)), seen
        assert follower.current is not None and follower.current.policy_version == 4
    latest = latest_policy_version(kafka_config)
    assert latest is not None and latest.policy_version == 4
