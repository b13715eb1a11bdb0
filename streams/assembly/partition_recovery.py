"""Recovering a turn-log partition when the replay buffer is assigned it: the fold as of
the committed offset (recover_partition), and the rules that replace a consumer whose
recoveries keep failing because its own coordinator requests are stuck, or that owns no
partition and reaches no broker (StuckConsumerWatch).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, TopicPartition

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.clients import broker_error, translate_kafka_errors, watermark_offsets
from rolloutbus.kafka.group_member import GroupMember
from rolloutbus.kafka.watchdog import NoAnswer, Progress, run_watched
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.released import READ_TIMEOUT_S, ReleasedRead, read_released
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)

OFFSET_QUERY_TIMEOUT_S = 30.0  # seconds for each committed-offset and watermark query
CALLS_PER_STALL = 3  # a broker call's timeout is replay_buffer.txn_stall_s / this
# seconds without an answer from librdkafka before a released-topic read is given up: past
# the longest single call it makes (READ_TIMEOUT_S), so only a call that hangs meets it
RELEASED_READ_LIMIT_S = READ_TIMEOUT_S + 15.0


def recover_partition(
    consumer: Consumer,
    cfg: Config,
    part: int,
    limits: FoldLimits,
    timeout_s: float = OFFSET_QUERY_TIMEOUT_S,
    alive: Progress | None = None,
) -> tuple[PartitionFold, ReleasedRead]:
    """The fold of turn-log partition ``part`` as of its committed offset: the uids already
    released on it (the released topic, with the claims the turn log must still back and
    the records that were bad), then ``consumer`` sought back to that offset. ``alive``:
    the caller's main-loop progress, beaten by the released-topic read's."""
    topics = Topics.from_config(cfg.kafka)
    tp = TopicPartition(topics.turns, part)
    with translate_kafka_errors("reading the committed offset", topic=tp.topic, partition=part):
        [committed] = consumer.committed([tp], timeout=timeout_s)
    low, _ = watermark_offsets(consumer, tp, timeout_s)
    if committed.error is not None:
        raise broker_error(
            committed.error, "reading the committed offset", topic=tp.topic, partition=part
        )
    start = max(committed.offset, low) if committed.offset >= 0 else low
    released = _read_released_watched(cfg, topics.released, part, limits.max_released, start, alive)
    fold = PartitionFold(start, released=released.uids, limits=limits)
    with translate_kafka_errors(
        "seeking to the committed offset", topic=tp.topic, partition=part, offset=start
    ):
        consumer.seek(TopicPartition(tp.topic, part, start))
        consumer.resume([tp])
    log.info(
        "recovered %s[%d] at offset %d: %d released groups remembered (of %d read)",
        tp.topic,
        part,
        start,
        len(released.uids),
        released.read,
    )
    return fold, released


def _read_released_watched(
    cfg: Config, topic: str, part: int, limit: int, start: int, alive: Progress | None
) -> ReleasedRead:
    """read_released on a helper thread, given up once librdkafka has not answered for
    RELEASED_READ_LIMIT_S; the retry makes new clients. (After a broker restart in CI the
    buffer released nothing for eight minutes; its stack dump found it in one of this
    read's polls, and no line said the read had timed out.)"""
    progress = Progress(parent=alive)
    try:
        return run_watched(
            lambda: read_released(cfg.kafka, topic, part, limit, start, progress),
            RELEASED_READ_LIMIT_S,
            f"reading {topic}[{part}]",
            thread_name=f"released-read-{part}",
            progress=progress,
        )
    except NoAnswer as exc:
        log.warning("%s; the read is left on its thread, at:\n%s", exc, exc.stack.rstrip())
        raise BrokerError(str(exc)) from None


class StuckConsumerWatch:
    """Replaces a consumer that is alive but will not recover by itself, each rule once per
    replay_buffer.txn_stall_s:

    * a partition that could not be recovered for the stall limit: the consumer's
      coordinator requests are stuck (seen after a broker restart: committed offsets timing
      out for a minute while a new client is answered at once), once per consumer;
    * no partition owned for the stall limit, and no metadata either: after a broker restart
      under load librdkafka was seen to decommission the only broker it knew without
      re-bootstrapping, so the consumer never rejoined its group and the buffer sat idle
      (``check_unassigned``). A member that owns nothing because the others own every
      partition still reads metadata, and stays."""

    def __init__(self, cfg: Config, member: GroupMember, metrics: ReplayBufferMetrics):
        self.stall_s = cfg.replay_buffer.txn_stall_s
        self.topic = Topics.from_config(cfg.kafka).turns
        # each committed-offset and watermark query of a recovery: within the stall limit
        self.query_timeout_s = min(OFFSET_QUERY_TIMEOUT_S, self.stall_s / CALLS_PER_STALL)
        self._member = member
        self._metrics = metrics
        self._consumer_since = time.monotonic()  # when the consumer in use was made
        self._unassigned_since: float | None = None  # owning no partition since (monotonic)

    def replaced(self, part: int, since: float, exc: BrokerError) -> bool:
        """Replace the consumer if ``part``, pending since ``since`` (monotonic), has failed
        for longer than the stall limit on this consumer; True if it was replaced."""
        waited = time.monotonic() - since
        if waited <= self.stall_s or since <= self._consumer_since:
            return False
        self._replace(
            f"recovering {self.topic}[{part}] has failed for {waited:.0f} s "
            f"(replay_buffer.txn_stall_s {self.stall_s:.0f} s; the last error: {exc})"
        )
        return True

    def check_unassigned(self, owns_partitions: bool) -> bool:
        """Replace the consumer if it has owned no partition for the stall limit and cannot
        read the turn log's metadata; True if it was replaced. Probes at most once per
        stall limit, on the caller's thread (it owns nothing: nothing waits on it)."""
        now = time.monotonic()
        if owns_partitions or self._unassigned_since is None:
            self._unassigned_since = None if owns_partitions else now
            return False
        waited = now - self._unassigned_since
        if waited <= self.stall_s:
            return False
        self._unassigned_since = now
        try:
            self._member.consumer.list_topics(self.topic, timeout=self.query_timeout_s)
        except KafkaException as exc:
            self._replace(
                f"it has owned no partition of {self.topic} for {waited:.0f} s and cannot "
                f"read its metadata ({exc}; replay_buffer.txn_stall_s {self.stall_s:.0f} s)"
            )
            return True
        return False

    def _replace(self, reason: str) -> None:
        self._metrics.consumer_replacements.inc()
        self._consumer_since = time.monotonic()
        self._member.replace_stalled(reason)
