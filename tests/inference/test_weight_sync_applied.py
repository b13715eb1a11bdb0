"""``PolicyVersionApplied``: ``rolloutbus weight-sync``'s loop (real broker, a real embedded
tiny-qwen3 replica) says on ``rollout.control`` when a version serves on every replica;
the waiting reader finds it; every other reader of the topic skips it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from confluent_kafka import KafkaError, KafkaException

from rolloutbus.config import Config, ModelConfig, ReplicasConfig
from rolloutbus.kafka.control import TrainerControlWriter, read_control_log
from rolloutbus.kafka.version_ledger import VersionLedger
from rolloutbus.schemas.control import (
    PolicyVersionApplied,
    PolicyVersionPublished,
    decode_control_event,
    encode_control_event,
)
from rolloutbus.streams.inference.weight_sync import WeightSync
from rolloutbus.streams.inference.weight_sync_applied import AppliedAnnouncer, served_everywhere
from rolloutbus.verl.applied import WeightsNotAppliedError, applied_version, wait_for_applied
from tests.replica_http import greedy_reference, greedy_turn

WAIT_S = 120.0  # seconds; a reload of the tiny model takes well under one


def test_the_event_round_trips_and_the_ledger_ignores_it():
    event = PolicyVersionApplied(policy_version=3, weights_path="/w/3", run_id="r", run_epoch=2)
    assert decode_control_event(encode_control_event(event)) == event
    ledger = VersionLedger()
    verdict = ledger.fold(event)
    assert (verdict.changed, verdict.refusal, ledger.current) == (False, None, None)
    assert not ledger.refused
    ledger.run_epoch = 2
    assert applied_version(ledger, event, 3, "") and applied_version(ledger, event, 2, "r")
    assert not applied_version(ledger, event, 4, "")
    assert not applied_version(ledger, event, 3, "another run")


def test_served_everywhere_needs_every_replica_on_the_version():
    v2 = PolicyVersionPublished(policy_version=2, weights_path="/w/2")
    assert served_everywhere(v2, [2, 2])
    assert not served_everywhere(v2, [2, None])  # one replica down or failed
    assert not served_everywhere(v2, [2, 1])
    assert not served_everywhere(None, [2])
    assert not served_everywhere(v2, [])


class _RefusedUnderASystemError:
    """Fault injector (a test double): a producer whose flush meets the broker's refusal as
    confluent-kafka's SystemError caused by it (a log line handed to Python while the
    KafkaException was pending, seen in CI)."""

    def produce(self, *args, **kwargs) -> None:
        pass

    def flush(self, timeout: float) -> int:
        refused = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "not authorized")
        try:
            raise KafkaException(refused)
        except KafkaException as exc:
            raise SystemError("<built-in method> returned a result with an error set") from exc


def test_a_refusal_under_a_system_error_turns_the_announcer_off_as_a_bare_one(caplog):
    announcer = AppliedAnnouncer(Config())
    announcer._producer = _RefusedUnderASystemError()
    current = PolicyVersionPublished(policy_version=1, weights_path="/w/1")
    assert announcer.announce_if_served(current, {"http://r0": 1}) is None
    assert announcer.refused
    assert "grant the weight_sync role WRITE" in caplog.text


async def test_weight_sync_announces_a_version_once_every_replica_serves_it(
    tiny_replica, seed1, seed1_folder, kafka_config
):
    cfg = Config(
        kafka=kafka_config,
        model=ModelConfig(name="tiny-qwen3"),
        replicas=ReplicasConfig(urls=[tiny_replica.url], health_interval_s=0.5),
    )
    # before any version: the waiting reader gives up with a reason
    with pytest.raises(WeightsNotAppliedError, match="weight-sync"):
        await asyncio.to_thread(wait_for_applied, cfg, 0, timeout_s=1.0)
    writer = TrainerControlWriter(cfg)
    version1 = PolicyVersionPublished(policy_version=1, weights_path=str(seed1_folder))
    published = writer.start_run("run-applied", version1)
    stop = asyncio.Event()
    async with WeightSync(cfg) as sync:
        loop = asyncio.ensure_future(sync.run(stop))
        try:
            applied = await asyncio.to_thread(wait_for_applied, cfg, 1, timeout_s=WAIT_S)
        finally:
            stop.set()
            await loop
    writer.close()
    assert applied.policy_version == 1 and applied.weights_path == str(seed1_folder)
    assert (applied.run_id, applied.run_epoch) == ("run-applied", published.run_epoch)
    assert applied.replicas == [tiny_replica.url]
    # once announced, the replica samples with the new weights
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        turn = await greedy_turn(http, 8, url=tiny_replica.url)
    assert turn.token_ids == greedy_reference(seed1, 8)
    assert turn.extra_fields["min_global_steps"] == 1
    # every other reader skips it: the version is unchanged, nothing refused
    ledger = await asyncio.to_thread(read_control_log, cfg)
    assert ledger.current is not None and ledger.current.policy_version == 1
    assert not ledger.refused
    # a reader of another run does not take it
    with pytest.raises(WeightsNotAppliedError):
        await asyncio.to_thread(wait_for_applied, cfg, 1, run_id="another", timeout_s=1.0)
