"""Policy versions on rollout.control, on the real broker: the latest published version is
what a late reader finds, a follower sees the current one and then new ones in order (the
newest of what arrived since its last poll), a record that is not a control event is
skipped instead of stopping the followers, and each trainer start is a newer run that
fences the trainer before it."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from pydantic import ValidationError

from rolloutbus.errors import BrokerError, TrainerFencedError
from rolloutbus.kafka.control import (
    PolicyVersionFollower,
    PolicyVersionPublisher,
    TrainerControlWriter,
    latest_policy_version,
    publish_policy_version,
    read_control_log,
)
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.control import (
    PolicyVersionPublished,
    decode_control_event,
    encode_control_event,
)
from rolloutbus.topics import CONTROL_PARTITION, Topics
from tests.helpers import unique_name

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


def test_each_trainer_start_is_a_newer_run_and_fences_the_one_before(kafka_config):
    publish_policy_version(kafka_config, _version(3))  # written before runs existed: epoch 0
    first = TrainerControlWriter(kafka_config)
    announced = first.start_run("run-a", PolicyVersionPublished(policy_version=0))
    assert (announced.run_id, announced.run_epoch) == ("run-a", 1)
    first.publish(_version(1))
    second = TrainerControlWriter(kafka_config)  # fences the first
    second.start_run("run-b", _version(0), prompt_offsets={0: 5})
    with pytest.raises(TrainerFencedError, match="another trainer started"):
        first.publish(_version(2))
    ledger = read_control_log(kafka_config)
    assert ledger.run is not None and (ledger.run.run_id, ledger.run_epoch) == ("run-b", 2)
    assert ledger.run.prompt_offsets == {0: 5}
    latest = latest_policy_version(kafka_config)
    assert latest is not None and (latest.run_id, latest.policy_version) == ("run-b", 0)
    # keyed by type and run epoch: compaction keeps every run's latest version
    records = read_partition(kafka_config, _control(kafka_config), CONTROL_PARTITION, 0)
    keys = [m.key().decode() for m in records]
    assert keys == [
        "policy_version",
        "run_started@1",
        "policy_version@1",
        "policy_version@1",
        "run_started@2",
        "policy_version@2",
    ]
    first.close()
    second.close()


class _FlushRaises:
    """Fault injector: a producer whose ``flush`` raises ``error``, as librdkafka raises a
    fenced producer's fatal state again on flush (seen once in CI, after a fence)."""

    def __init__(self, error: KafkaError):
        self.error = error

    def flush(self, timeout: float) -> int:
        raise KafkaException(self.error)


def test_a_fenced_writer_closes_quietly_and_any_other_flush_error_names_the_topic(kafka_config):
    writer = TrainerControlWriter(kafka_config)
    real, writer._producer = (
        writer._producer,
        _FlushRaises(KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)),
    )
    try:
        writer.close()  # the fence was reported by the write that met it
        writer._producer = _FlushRaises(KafkaError(KafkaError._TIMED_OUT, "timed out"))
        with pytest.raises(BrokerError, match=r"flushing the control writer.*control"):
            writer.close()
    finally:
        real.flush(5)


class _FlushRaisesSystemError(_FlushRaises):
    """Fault injector: confluent-kafka's quirk seen in CI. librdkafka's log lines reached a
    Python handler while the flush's KafkaException was pending, and the handler's first C
    call raised SystemError caused by it (``cause=None``: a SystemError of its own)."""

    def __init__(self, error: KafkaError, *, caused: bool = True):
        super().__init__(error)
        self.caused = caused

    def flush(self, timeout: float) -> int:
        quirk = SystemError(
            "<method 'append' of 'list' objects> returned a result with an error set"
        )
        try:
            return super().flush(timeout)
        except KafkaException as exc:
            raise quirk from (exc if self.caused else None)


def test_a_fence_that_surfaces_as_a_system_error_closes_quietly_and_nothing_else_does(
    kafka_config,
):
    writer = TrainerControlWriter(kafka_config)
    fenced = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
    real, writer._producer = writer._producer, _FlushRaisesSystemError(fenced)
    try:
        writer.close()  # the fence, under the SystemError
        writer._producer = _FlushRaisesSystemError(KafkaError(KafkaError._TIMED_OUT, "late"))
        with pytest.raises(BrokerError, match=r"flushing the control writer.*control"):
            writer.close()
        writer._producer = _FlushRaisesSystemError(fenced, caused=False)
        with pytest.raises(SystemError, match="returned a result"):
            writer.close()  # a SystemError no KafkaException caused is a bug: raised as is
    finally:
        real.flush(5)


class _CommitFencedUnderASystemError:
    """Fault injector: the real producer, but ``commit_transaction`` meets a fence that
    arrives as confluent-kafka's SystemError caused by it."""

    def __init__(self, real):
        self._real = real

    def commit_transaction(self, timeout: float) -> None:
        fenced = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
        try:
            raise KafkaException(fenced)
        except KafkaException as exc:
            raise SystemError("<built-in method> returned a result with an error set") from exc

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_a_fence_under_a_system_error_while_writing_is_reported_as_a_fence(kafka_config):
    writer = TrainerControlWriter(kafka_config)
    writer.start_run(unique_name("run"), _version(0))
    real = writer._producer
    writer._producer = _CommitFencedUnderASystemError(real)
    try:
        with pytest.raises(TrainerFencedError, match="another trainer started"):
            writer.publish(_version(1))
    finally:
        real.flush(5)  # delivered before the abort (librdkafka#4849: see test_consumer_lag)
        real.abort_transaction(5)


def _control(kafka_config) -> str:
    return Topics.from_config(kafka_config).control
