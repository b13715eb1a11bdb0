"""Rebuild trajectories from any range of the turn log, without touching live state.

Reads rollout.turns (read_committed, no consumer group, nothing committed), folds each
partition with the same code as the live replay buffer, and returns the trajectories of
every group whose events lie wholly inside the range. Groups that started before the
range or had not settled by its end are reported, not guessed at.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.schemas.trajectories import Trajectory, encode_trajectories
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.group_fold import PartitionFold
from rolloutbus.streams.release import finalize_group
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)
POLL_S = 5.0  # seconds one poll may wait; the range end is known, so this only bounds stalls


@dataclass
class ReplayResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    records: dict[str, bytes] = field(default_factory=dict)  # key -> value, as the buffer writes it
    events: int = 0
    undecodable: int = 0
    open_groups: list[str] = field(default_factory=list)  # not settled within the range


def replay_turns(cfg: Config, *, partitions: list[int] | None = None, start_offset: int = 0,
                 end_offset: int | None = None) -> ReplayResult:
    """Fold ``[start_offset, end_offset)`` of each partition (default: all, to the end)."""
    topic = Topics.from_config(cfg.kafka).turns
    consumer = Consumer({**cfg.kafka.client_settings(), "group.id": f"rolloutbus-replay-{time.time_ns()}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True,
                         "max.partition.fetch.bytes": cfg.kafka.max_message_bytes})
    result = ReplayResult()
    try:
        for part in partitions if partitions is not None else range(cfg.kafka.partitions):
            _replay_partition(consumer, cfg, topic, part, start_offset, end_offset, result)
    finally:
        consumer.close()
    return result


def _replay_partition(consumer: Consumer, cfg: Config, topic: str, part: int, start: int,
                      end: int | None, result: ReplayResult) -> None:
    low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=30, cached=False)
    stop = high if end is None else min(end, high)
    fold = PartitionFold(next_offset=max(start, low), traj_next_offset=0)
    if stop <= max(start, low):
        return
    consumer.assign([TopicPartition(topic, part, max(start, low))])
    while True:
        msg = consumer.poll(POLL_S)
        if msg is None:
            raise BrokerError(f"replay of {topic}[{part}] stalled before offset {stop}")
        if msg.error():
            if msg.error().code() == KafkaError._PARTITION_EOF:
                break
            raise BrokerError(f"replay of {topic}[{part}]: {msg.error()}")
        if msg.offset() >= stop:
            break
        result.events += 1
        try:
            event = decode_turn_event(msg.value())
        except ValidationError:
            result.undecodable += 1  # the live buffer dead-lettered it too
            continue
        released = fold.apply(msg.offset(), event)
        if released is not None:
            trajectories, _ = finalize_group(released, cfg.rollout)
            result.trajectories.extend(trajectories)
            result.records.update(zip((t.key for t in trajectories),
                                      encode_trajectories(trajectories), strict=True))
    result.open_groups.extend(fold.open)
