"""The replay-buffer processor: rollout.turns in, rollout.trajectories out, exactly once.

Guarantee on this hop: exactly-once, by Kafka transactions (consume-transform-produce
with confluent-kafka; Faust's exactly-once mode is experimental upstream). Per poll batch:

1. fold the new turn events; collect the groups they complete;
2. begin a transaction; produce every trajectory of those groups (and any dead letters);
3. send the consumer offsets to the transaction: per partition, the low watermark (first
   event of the oldest open group) with metadata naming the trajectory offset from which
   a restart must read to learn which later groups were already released;
4. commit the transaction. Trainers read with isolation.level=read_committed.

On partition assignment the processor runs *released-groups recovery*: it reads the
trajectory partition from the offset named in that metadata (or from
``rescan_lookback_s`` ago, if earlier: a prompt redelivered to a restarted session worker
re-runs a group that may have been released before that offset) and remembers the uids
it finds there as released, so they are never released twice. A uid maps to the
same partition number on every topic, so partition p of the turns feeds partition p of
the trajectories and one transactional writer owns it.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.kafka.clients import (
    broker_error,
    consume_records,
    message_location,
    read_committed_consumer,
    record_position,
    transactional_producer,
    translate_kafka_errors,
)
from rolloutbus.kafka.dead_letters import DeadLetterRecord, DeadLetterWriter
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.metrics import ReplayBufferMetrics, start_metrics_server
from rolloutbus.schemas.trajectories import Trajectory, encode_trajectories
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.partition_fold import PartitionFold, ReleasedGroup
from rolloutbus.streams.assembly.trajectories import finalize_group
from rolloutbus.topics import Topics, uid_of_key

log = logging.getLogger(__name__)

POLL_BATCH = 500  # records per consume() call
POLL_TIMEOUT_S = 0.5  # seconds; also the idle commit cadence
# One transaction per batch costs a coordinator round trip and a marker per partition, so a
# batch gathers polls for up to this long (seconds) or this many records: ~0.1 s of added
# release latency against groups that take seconds to roll out.
BATCH_WINDOW_S = 0.1
BATCH_MAX_RECORDS = 5000
COMMIT_IDLE_S = 5.0  # seconds between watermark-only commits when nothing is released
TXN_TIMEOUT_S = 30.0  # seconds for init/commit of a transaction
LINGER_MS = 5  # ms a record waits to batch; small, since each batch is flushed by its commit
ANY_PARTITION = -1  # an outgoing record the producer's partitioner places (dead letters)
FENCED_OR_DOWN_HINT = "fenced by a newer worker with the same transactional id, or the broker is down"


class ReplayBuffer:
    def __init__(self, cfg: Config, *, metrics: ReplayBufferMetrics | None = None):
        self.cfg = cfg
        self.topics = Topics.from_config(cfg.kafka)
        self.metrics = metrics or ReplayBufferMetrics()
        self.partitions: dict[int, PartitionFold] = {}
        self._stop = threading.Event()
        self._consumer = read_committed_consumer(cfg.kafka, cfg.replay_buffer.group_id,
                                                 overrides={"auto.offset.reset": "earliest"})
        self._producer = transactional_producer(cfg.kafka, cfg.replay_buffer.transactional_id,
                                                {"linger.ms": LINGER_MS, "compression.type": "lz4"})
        # letters are produced by _commit, inside the batch's transaction
        self._dead_letters = DeadLetterWriter(cfg.kafka, stage="replay_buffer", producer=self._producer)
        self._dirty = False
        self._last_commit = time.monotonic()

    # -- lifecycle -------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Consume until stop(); every exit path closes the consumer (leaving the group)."""
        with translate_kafka_errors(f"replay buffer: init_transactions for "
                                    f"{self.cfg.replay_buffer.transactional_id!r}"):
            self._producer.init_transactions(TXN_TIMEOUT_S)
        self._consumer.subscribe([self.topics.turns], on_assign=self._on_assign,
                                 on_revoke=self._on_revoke, on_lost=self._on_revoke)
        log.info("replay buffer consuming %s", self.topics.turns)
        try:
            while not self._stop.is_set():
                self.step()
        finally:
            self._consumer.close()
            self._producer.flush(TXN_TIMEOUT_S)

    def step(self) -> int:
        """One batch of polls, folded and committed in one transaction. Returns records read."""
        messages = self._poll_batch()
        outgoing: list[tuple[str, str, bytes, int]] = []  # topic, key, value, partition
        for msg in messages:
            outgoing.extend(self._fold_message(msg))
        idle_commit = self._dirty and time.monotonic() - self._last_commit > COMMIT_IDLE_S
        if outgoing or idle_commit:
            self._commit(outgoing)
        self.metrics.open_groups.set(sum(len(p.open) for p in self.partitions.values()))
        return len(messages)

    def _poll_batch(self) -> list[Message]:
        messages = consume_records(self._consumer, POLL_BATCH, POLL_TIMEOUT_S)
        deadline = time.monotonic() + BATCH_WINDOW_S
        while messages and len(messages) < BATCH_MAX_RECORDS and time.monotonic() < deadline:
            more = consume_records(self._consumer, POLL_BATCH, max(0.0, deadline - time.monotonic()))
            if not more:
                break
            messages.extend(more)
        return messages

    # -- folding ---------------------------------------------------------------
    def _fold_message(self, msg: Message) -> list[tuple[str, str, bytes, int]]:
        part, offset = record_position(msg)
        state = self.partitions.get(part)
        if state is None:
            return []  # revoked meanwhile
        self._dirty = True
        try:
            event = decode_turn_event(msg.value() or b"")  # a null value is dead-lettered too
        except ValidationError as exc:
            state.next_offset = offset + 1
            self.metrics.dead_letters.inc()
            return [self._dead_letter(msg, f"turn event does not match its schema: {exc}")]
        self.metrics.events.labels(type=event.type).inc()
        before = state.ignored
        released = state.apply(offset, event)
        if state.ignored > before:
            self.metrics.duplicates.inc()
        return self._trajectory_records(part, released) if released else []

    def _trajectory_records(self, part: int, released: ReleasedGroup) -> list[tuple[str, str, bytes, int]]:
        trajectories, broken = finalize_group(released, self.cfg.rollout)
        self.metrics.groups.inc()
        letters = [self._invariant_letter(v.trajectory, v.problems) for v in broken]
        for t in trajectories:
            self.metrics.trajectories.labels(status=t.status.value).inc()
        return letters + [(self.topics.trajectories, t.key, value, part)
                          for t, value in zip(trajectories, encode_trajectories(trajectories), strict=True)]

    def _invariant_letter(self, t: Trajectory, problems: list[str]) -> tuple[str, str, bytes, int]:
        reason = f"trajectory {t.key} released as failed: " + "; ".join(problems)
        self.metrics.dead_letters.inc()
        letter = self._dead_letters.record(encode_trajectories([t])[0], reason,
                                           source=f"{self.topics.trajectories} key {t.key}", key=t.key)
        return _outgoing(letter)

    def _dead_letter(self, msg: Message, reason: str) -> tuple[str, str, bytes, int]:
        key = (msg.key() or b"").decode("utf-8", "replace")
        letter = self._dead_letters.record(msg.value() or b"", reason, source=message_location(msg), key=key)
        return _outgoing(letter)

    # -- the transaction -------------------------------------------------------
    def _commit(self, outgoing: list[tuple[str, str, bytes, int]]) -> None:
        delivered: dict[int, int] = {}

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is None and msg.topic() == self.topics.trajectories:
                partition, offset = record_position(msg)
                delivered[partition] = max(delivered.get(partition, -1), offset)

        try:
            self._producer.begin_transaction()
            for topic, key, value, partition in outgoing:
                kwargs: dict[str, Any] = {} if partition == ANY_PARTITION else {"partition": partition}
                self._produce(topic, key, value, on_delivery, **kwargs)
            self._producer.send_offsets_to_transaction(
                self._offsets(), self._consumer.consumer_group_metadata(), TXN_TIMEOUT_S)
            self._producer.commit_transaction(TXN_TIMEOUT_S)
        except KafkaException as exc:
            self._abort(exc)
            raise broker_error(exc, "replay buffer transaction", hint=FENCED_OR_DOWN_HINT) from exc
        for part, last in delivered.items():
            if part in self.partitions:
                self.partitions[part].traj_next_offset = last + 1
        self._dirty = False
        self._last_commit = time.monotonic()

    def _produce(self, topic: str, key: str, value: bytes, on_delivery: Any, **kwargs: Any) -> None:
        while True:
            try:
                self._producer.produce(topic, key=key, value=value, on_delivery=on_delivery, **kwargs)
                return
            except BufferError:
                self._producer.poll(0.1)  # local queue full: let deliveries drain

    def _offsets(self) -> list[TopicPartition]:
        return [TopicPartition(self.topics.turns, part, state.low_watermark(),
                               metadata=json.dumps({"traj_scan_from": state.scan_from()}))
                for part, state in self.partitions.items()]

    def _abort(self, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args else None
        if err is not None and getattr(err, "txn_requires_abort", lambda: False)():
            try:
                self._producer.abort_transaction(TXN_TIMEOUT_S)
            except KafkaException:
                log.exception("abort_transaction failed")

    # -- rebalancing -----------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        with translate_kafka_errors("reading committed offsets", topic=self.topics.turns):
            committed = consumer.committed(partitions, timeout=TXN_TIMEOUT_S)
        for tp in committed:
            released = self._recover_released_groups(tp)
            start = tp.offset if tp.offset >= 0 else 0
            _, high = self._trajectory_watermarks(tp.partition)
            self.partitions[tp.partition] = PartitionFold(start, high, released)
            log.info("assigned %s[%d] from offset %d; %d released groups remembered",
                     tp.topic, tp.partition, start, len(released))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.partitions.pop(tp.partition, None)

    # -- released-groups recovery -----------------------------------------------
    def _recover_released_groups(self, committed: TopicPartition) -> set[str]:
        """uids already released on this partition, read back from the trajectory topic, so
        a group re-run after its release (a redelivered prompt) is not released again."""
        recover_from = _committed_recovery_offset(committed)
        if recover_from is None:
            return set()
        recover_from = min(recover_from, self._recovery_lookback_offset(committed.partition))
        return self._uids_released_since(committed.partition, recover_from)

    def _recovery_lookback_offset(self, partition: int) -> int:
        """First trajectory offset written within ``rescan_lookback_s`` (a bounded read)."""
        since_ms = int((time.time() - self.cfg.replay_buffer.rescan_lookback_s) * 1000)
        with translate_kafka_errors("looking up offsets by time", topic=self.topics.trajectories,
                                    partition=partition):
            [tp] = self._consumer.offsets_for_times(
                [TopicPartition(self.topics.trajectories, partition, since_ms)], timeout=TXN_TIMEOUT_S)
        if tp.offset >= 0:
            return tp.offset
        return self._trajectory_watermarks(partition)[1]  # nothing that recent: read nothing extra

    def _trajectory_watermarks(self, partition: int) -> tuple[int, int]:
        tp = TopicPartition(self.topics.trajectories, partition)
        with translate_kafka_errors("reading watermarks", topic=tp.topic, partition=partition):
            return self._consumer.get_watermark_offsets(tp, timeout=TXN_TIMEOUT_S, cached=False)

    def _uids_released_since(self, partition: int, offset: int) -> set[str]:
        """uids whose trajectories were committed to ``partition`` at or after ``offset``."""
        records = read_partition(self.cfg.kafka, self.topics.trajectories, partition, offset)
        # every record the replay buffer writes there has a key
        return {uid_of_key(key.decode()) for msg in records if (key := msg.key()) is not None}


def _committed_recovery_offset(tp: TopicPartition) -> int | None:
    """Where released-groups recovery starts, from the commit metadata written by
    ``_offsets`` (its key, ``traj_scan_from``, is stored on the broker: not renamed)."""
    if tp.offset < 0:
        return None  # never committed: nothing was released by this group
    try:
        return int(json.loads(tp.metadata or "{}").get("traj_scan_from", 0))
    except (ValueError, AttributeError):
        return 0  # unreadable metadata: read the whole partition, slower but safe


def _outgoing(letter: DeadLetterRecord) -> tuple[str, str, bytes, int]:
    return (letter.topic, letter.key or "", letter.value, ANY_PARTITION)


def run_replay_buffer(cfg: Config) -> None:
    """Blocking: run one replay-buffer worker until SIGTERM/SIGINT."""
    if cfg.replay_buffer.metrics_port is not None:
        start_metrics_server(cfg.replay_buffer.metrics_port)
    buffer = ReplayBuffer(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: buffer.stop())
    buffer.run()
