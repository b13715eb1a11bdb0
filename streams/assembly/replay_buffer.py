"""The replay-buffer processor: rollout.turns in, rollout.trajectories out, exactly once.

Guarantee on this hop: exactly-once, by Kafka transactions (consume-transform-produce
with confluent-kafka; Faust's exactly-once mode is experimental upstream). Per batch:

1. fold the new turn events of the partitions that are ready; collect the groups released;
2. begin a transaction; produce every trajectory of those groups, their dead letters, and
   one record per group on the released-groups topic (``released.py``, key uid);
3. send the consumer offsets to the transaction — per partition the low watermark, the
   first event of the oldest open group — with the consumer group's metadata, so a worker
   that lost the partition in a rebalance is fenced (KIP-447);
4. commit the transaction. Trainers read with isolation.level=read_committed.

**Which groups were released** is read from the released-groups topic, never inferred
from offsets: a group's released record commits with its trajectories, and on assignment
a partition's released uids are read back before any of its events is folded. So a
restart, lost or expired consumer offsets, a new group id, or a session worker re-running
a group cannot release a group twice.

**Partition lifecycle.** The rebalance callbacks only record the change (no I/O in a
callback) and bump an assignment generation. A newly assigned partition is *pending*:
paused, its polled records dropped, until the main loop has read its committed offset and
its released uids, built its fold, and sought it back to the committed offset. A batch
during whose polls the generation changed is dropped whole, and the partitions still
owned are sought back to where their folds stand: nothing polled before a rebalance is
folded after it.

**Failures.** Bad input never stops the worker (``trajectories.py``: failed records plus a
dead letter). The transaction itself is ``rolloutbus/kafka/transactions.py``'s
(:class:`TransactionalProducer`): retriable broker errors are retried, an abortable one
aborts, and a fatal one (fenced, ``INVALID_TXN_STATE`` after a broker was SIGKILLed), a
call that never returns, or calls that keep timing out for ``replay_buffer.txn_stall_s``
after a broker restart replace the producer, never ends the process. Whenever a
transaction did not commit, every partition is re-read from its committed offset (the
fold state of the batch is discarded), so nothing is released twice. The process ends
only when no transaction commits for ``BROKER_RETRY_S``, or when another live process
holds its transactional id (fenced again and again).

**Takeover.** With ``replay_buffer.group_instance_id`` (static membership) a restarted
member takes its partitions back at once and, through the transactional id derived from
that name, fences its dead predecessor's producer and ends its open transaction; a member
gone for good is replaced after ``session_timeout_s``, and its open transaction ends after
``transaction_timeout_s`` (``docs/faults.md`` has the measured stalls).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError, RolloutBusError, SchemaError
from rolloutbus.kafka.admin import check_partition_counts
from rolloutbus.kafka.clients import (
    record_position,
    translate_kafka_errors,
)
from rolloutbus.kafka.group_member import GroupMember
from rolloutbus.kafka.transactions import OutgoingRecord as Outgoing
from rolloutbus.kafka.transactions import (
    TransactionAborted,
    TransactionalProducer,
    TransactionSettings,
)
from rolloutbus.kafka.watchdog import MainLoopWatch, Progress
from rolloutbus.metrics import start_metrics_server
from rolloutbus.progress import ProgressLine
from rolloutbus.streams.assembly.fold_events import decode_fold_event
from rolloutbus.streams.assembly.metrics import ReplayBufferMetrics
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold
from rolloutbus.streams.assembly.partition_recovery import (
    CALLS_PER_STALL,
    StuckConsumerWatch,
    recover_partition,
)
from rolloutbus.streams.assembly.release_metrics import observe_open_groups
from rolloutbus.streams.assembly.release_records import ReleaseRecords
from rolloutbus.streams.assembly.released import (
    ReleasedClaims,
    TurnLogProbe,
)
from rolloutbus.streams.assembly.session_fold import short_error
from rolloutbus.streams.assembly.trajectories import max_record_bytes
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)

POLL_BATCH = 500  # records per consume() call
POLL_TIMEOUT_S = 0.5  # seconds a poll waits for the first record of a batch; the idle cadence
COMMIT_IDLE_S = 5.0  # seconds between watermark-only commits when nothing is released
BROKER_RETRY_S = 300.0  # seconds of a broker failing every retry before the worker gives up
RETRY_BACKOFF_S = 0.5  # seconds before retrying a partition's recovery
# seconds the main loop may go without beginning a step, a partition's recovery attempt, a
# transactional call's attempt or a released-topic read's progress before the process ends
# itself (MainLoopWatch): past the longest wait a step bounds itself between those, a claim
# check retried for PROBE_RETRY_S; at least 4 x replay_buffer.txn_stall_s (main_loop_watch)
MAIN_LOOP_LIMIT_S = 420.0
LINGER_MS = 5  # ms a record waits to batch; small, since each batch is flushed by its commit
GC_THRESHOLD_ALLOCATIONS = 50_000  # net allocations between young collections (default 700)
LETTER_REASON_CHARS = 4000  # characters of a decoder's error kept in a dead letter's reason
HEAD_MISSING_REASON = (
    "turn event of group {uid}, whose group_started is not in the turn log (deleted by "
    "retention, or never written): the group's sessions are released as failed records once "
    "it passes deadlines.group_s or replay_buffer.max_open_groups"
)
FENCED_HINT = (
    "give every process its own replay_buffer.group_instance_id (or leave "
    "replay_buffer.transactional_id and group_instance_id unset)"
)


def default_transactional_id(group_id: str) -> str:
    """One per process: two workers from one config must not fence each other."""
    return f"{group_id}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def transactional_id_of(cfg: Config) -> str:
    """Pinned; or, for a static member, its name's (so a restart fences the dead process's
    producer and ends its open transaction at once); else one of its own per process."""
    rb = cfg.replay_buffer
    if rb.transactional_id:
        return rb.transactional_id
    if rb.group_instance_id:
        return f"{rb.group_id}-{rb.group_instance_id}"
    return default_transactional_id(rb.group_id)


def consumer_overrides(cfg: Config) -> dict[str, Any]:
    """The turn-log consumer's group membership: static when named, a short session."""
    rb = cfg.replay_buffer
    overrides: dict[str, Any] = {
        "auto.offset.reset": "earliest",
        "session.timeout.ms": int(rb.session_timeout_s * 1000),
    }
    if rb.group_instance_id:
        overrides["group.instance.id"] = rb.group_instance_id
    return overrides


def transaction_settings(cfg: Config) -> TransactionSettings:
    return TransactionSettings(
        broker_retry_s=BROKER_RETRY_S,
        stall_s=cfg.replay_buffer.txn_stall_s,
        # a call that never returns (librdkafka#5456) is found after this plus the grace:
        # within the stall limit, so a producer wedged by a broker restart is replaced too
        call_timeout_s=cfg.replay_buffer.txn_stall_s / CALLS_PER_STALL,
        producer_overrides={
            "linger.ms": LINGER_MS,
            "compression.type": cfg.replay_buffer.compression,
            "transaction.timeout.ms": int(cfg.replay_buffer.transaction_timeout_s * 1000),
        },
        fenced_hint=FENCED_HINT,
    )


# ReplayBuffer reads the common token-carrying turn events with the msgspec wire decoder
# (``fold_events.py``), the same records and dead letters as pydantic's decode, which reads
# every other record; wire_decode=False: pydantic's decode alone (benchmarks/fold_cpu.py)
class ReplayBuffer:
    def __init__(
        self, cfg: Config, *, metrics: ReplayBufferMetrics | None = None, wire_decode: bool = True
    ):
        self.cfg, self.wire_decode = cfg, wire_decode
        self.topics = Topics.from_config(cfg.kafka)
        self.metrics = metrics or ReplayBufferMetrics()
        self.transactional_id = transactional_id_of(cfg)
        self.limits = FoldLimits.from_config(cfg)
        self.records = ReleaseRecords(
            self.topics, cfg.rollout, self.metrics, max_record_bytes=max_record_bytes(cfg.kafka)
        )
        self.partitions: dict[int, PartitionFold] = {}  # ready: recovered, being folded
        # released records read on recovery, until the turn log backs them (released.py)
        self._claims: dict[int, ReleasedClaims] = {}
        self._probes: dict[int, TurnLogProbe] = {}
        self._recovery_letters: list[Outgoing] = []  # bad released records, next transaction
        self._event_counters: dict[str, Any] = {}  # event type -> its series of metrics.events
        self._pending: dict[int, float] = {}  # assigned, not yet recovered -> since (monotonic)
        self._paused: set[int] = set()
        self._generation = 0  # bumped by every rebalance callback
        self._stop = threading.Event()
        self._alive = Progress()  # beaten by the main loop, watched by MainLoopWatch
        self._member = GroupMember(
            cfg.kafka,
            cfg.replay_buffer.group_id,
            [self.topics.turns],
            overrides=consumer_overrides(cfg),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_replaced=self._drop_every_partition,
            fenced_hint=FENCED_HINT,
        )
        settings, tid = transaction_settings(cfg), self.transactional_id
        self._transactions = TransactionalProducer(
            cfg.kafka, tid, settings, stop=self._stop, progress=self._alive
        )
        self._stuck = StuckConsumerWatch(cfg, self._member, self.metrics)
        self._progress = ProgressLine("replay buffer", cfg.monitoring.progress_log_s, log)
        self._folded = 0  # turn events folded since the last commit
        self._dirty = False
        self._last_commit = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Consume until stop(); every exit path closes the consumer (leaving the group).
        The process ends itself (exit 75) if its main loop stalls (main_loop_watch)."""
        try:
            check_partition_counts(self.cfg.kafka)
            self._transactions.init()
            self._member.subscribe()
            log.info("replay buffer %s consuming %s", self.transactional_id, self.topics.turns)
            with main_loop_watch(self.cfg, self._alive, self.transactional_id):
                while not self._stop.is_set():
                    self.step()
        finally:
            self._member.close()
            for probe in self._probes.values():
                probe.close()
            self._transactions.close()

    def step(self) -> int:
        """Recover pending partitions, fold one batch of polls, commit it; the records read."""
        self._alive.beat()
        self._recover_pending()
        self._stuck.check_unassigned(bool(self.partitions or self._pending))
        messages, generation = self._poll_batch()
        if generation != self._generation:
            self._seek_ready_partitions_back()
            return 0
        outgoing, self._recovery_letters = self._recovery_letters, []
        for msg in messages:
            self._fold_message(msg, outgoing)
        self._folded += len(messages)
        idle_commit = self._dirty and time.monotonic() - self._last_commit > COMMIT_IDLE_S
        if outgoing or idle_commit:
            self._commit(outgoing)
        self._update_gauges()
        if self._progress.due():  # open groups counted once an interval, not per batch
            open_groups = sum(len(f.open) for f in self.partitions.values())
            self._progress.maybe_log({"open groups": open_groups})
        return len(messages)

    # -- polling ---------------------------------------------------------------------------
    def _poll_batch(self) -> tuple[list[Message], int]:
        """One batch of records, and the assignment generation they belong to (changed by
        the end if a rebalance callback ran during the polls). The first poll waits for a
        record; the next ones take only what has arrived, and the batch ends when nothing
        has (replay_buffer.batch_window_s and batch_max_records bound it under load)."""
        generation = self._generation
        settings = self.cfg.replay_buffer
        messages = self._consume(POLL_TIMEOUT_S, 1)  # returns at the first record
        deadline = time.monotonic() + settings.batch_window_s
        while (
            messages
            and len(messages) < settings.batch_max_records
            and time.monotonic() < deadline
            and self._generation == generation
        ):
            more = self._consume(0.0, min(POLL_BATCH, settings.batch_max_records - len(messages)))
            if not more:
                break  # the input is idle: commit what the batch released now
            messages.extend(more)
        self._pause_pending()
        return messages, generation

    def _consume(self, timeout_s: float, max_records: int = POLL_BATCH) -> list[Message]:
        """Records only (the group member's consume: errors translated there). librdkafka's
        consume() waits until it has ``max_records`` or ``timeout_s`` has passed."""
        return self._member.consume(max_records, timeout_s)

    def _pause_pending(self) -> None:
        """Stop fetching partitions that are not recovered yet (their records are dropped
        and re-read after recovery seeks back)."""
        todo = [p for p in self._pending if p not in self._paused]
        if not todo:
            return
        try:
            self._member.consumer.pause([TopicPartition(self.topics.turns, p) for p in todo])
        except KafkaException as exc:  # only saves fetches: recovery seeks back anyway
            log.debug("pausing %s failed: %s", todo, exc)
        self._paused.update(todo)

    def _seek_ready_partitions_back(self) -> None:
        """A rebalance ran during the polls: drop the batch; the partitions still owned go
        on from where their folds stand."""
        seek_to_folds(self._member.consumer, self.topics.turns, self.partitions)

    # -- folding ---------------------------------------------------------------------------
    def _fold_message(self, msg: Message, outgoing: list[Outgoing]) -> None:
        part, offset = record_position(msg)
        fold = self.partitions.get(part)
        if fold is None or offset < fold.next_offset:
            return  # not recovered yet (re-read after its seek), or folded already
        self._dirty = True
        try:
            event = decode_fold_event(msg.value() or b"", wire=self.wire_decode)  # null: a letter
        except (ValidationError, RolloutBusError) as exc:
            fold.next_offset = offset + 1
            self._settle_claims(part, offset, None, fold, outgoing)
            outgoing.append(
                self.records.bad_turn(
                    msg,
                    "turn event does not match its schema: "
                    f"{short_error(exc, LETTER_REASON_CHARS)}",
                )
            )
            return
        self._events_of(event.type).inc()
        self._settle_claims(part, offset, event.uid, fold, outgoing)
        ignored_before = fold.ignored
        try:
            released = fold.fold(offset, event)
        except SchemaError as exc:
            outgoing.append(self.records.bad_turn(msg, f"turn event cannot be folded: {exc}"))
            return
        if fold.opened_headless is not None:
            outgoing.append(self.records.bad_turn(msg, HEAD_MISSING_REASON.format(uid=event.uid)))
        if fold.ignored > ignored_before:
            self.metrics.duplicates.inc(fold.ignored - ignored_before)
        if fold.forgotten:
            self.metrics.released_uids_forgotten.inc(fold.forgotten)
            fold.forgotten = 0
        for group in released:
            if (claims := self._claims.get(part)) is not None:
                claims.forget(group.group.uid)  # released now: no earlier record decides
            outgoing.extend(self.records.group(part, group))

    def _events_of(self, kind: str) -> Any:
        """The events counter of one type, looked up once (labels() per event cost ~4% of
        the fold)."""
        counter = self._event_counters.get(kind)
        if counter is None:
            counter = self._event_counters[kind] = self.metrics.events.labels(type=kind)
        return counter

    def _settle_claims(
        self, part: int, offset: int, uid: str | None, fold: PartitionFold, out: list[Outgoing]
    ) -> None:
        """Released records read on recovery are obeyed only where the turn log backs them:
        the event at ``offset`` settles those that name it as their group's start, and an
        event about to be ignored as released settles its uid's (released.py). A refused
        record is dead-lettered; a uid with no claim left is no longer released."""
        claims = self._claims.get(part)
        if claims is None or not len(claims):
            return
        refused = claims.passed(offset, uid)
        if uid is not None and uid in fold.released and claims.pending(uid):
            probe = self._probes.get(part)
            if probe is None:
                probe = self._probes[part] = TurnLogProbe(self.cfg.kafka, self.topics.turns, part)
            refused += claims.suppressing(offset, uid, probe)
        out.extend(self.records.bad_released(bad) for bad in refused)
        for freed in claims.take_freed():
            fold.released.pop(freed, None)

    # -- the transaction (rolloutbus/kafka/transactions.py) --------------------------------
    def _commit(self, outgoing: list[Outgoing]) -> None:
        """Steps 2-4 in one transaction: the records, then the offsets (the low watermarks)."""
        try:
            self._transactions.commit(outgoing, self._offsets(), self._member.consumer)
        except TransactionAborted as failure:
            self._rewind(failure)
            return
        self._member.committed()
        self._dirty = False
        self._last_commit = time.monotonic()
        count_committed(self._progress, self.topics, outgoing, self._folded)
        self._folded = 0

    def _offsets(self) -> list[TopicPartition]:
        return [
            TopicPartition(self.topics.turns, part, fold.low_watermark())
            for part, fold in self.partitions.items()
        ]

    def _rewind(self, failure: TransactionAborted) -> None:
        """Nothing of the batch committed: re-read every partition from its committed
        offset (the fold state of the aborted batch is discarded)."""
        self._folded = 0  # re-read and folded again
        self.metrics.transaction_aborts.labels(cause=failure.cause).inc()
        if failure.replaced:
            self.metrics.producer_replacements.labels(cause=failure.cause).inc()
        log.warning(
            "replay buffer: %s (%s%s): every partition is re-read from its committed offset",
            failure,
            failure.cause,
            ", producer replaced" if failure.replaced else "",
        )
        now = time.monotonic()
        for part in self.partitions:
            self._pending[part] = now
        self.partitions.clear()
        self._paused.clear()
        self._dirty = False  # the recovered folds are what was committed

    def _drop_every_partition(self) -> None:
        """The consumer was replaced (a fatal consumer error): its assignment is gone, and
        the new one comes through _on_assign; nothing polled before is folded after."""
        self._generation += 1
        self.partitions.clear()
        self._pending.clear()
        self._paused.clear()
        self._dirty = False

    # -- rebalancing: record only; the main loop does the work ----------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._generation += 1
        now = time.monotonic()
        for tp in partitions:
            self.partitions.pop(tp.partition, None)
            self._pending[tp.partition] = now
            self._paused.discard(tp.partition)
        log.info("assigned %s %s", self.topics.turns, sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._generation += 1
        for tp in partitions:
            self.partitions.pop(tp.partition, None)
            self._pending.pop(tp.partition, None)
            self._paused.discard(tp.partition)

    # -- partition recovery ----------------------------------------------------------------
    def _recover_pending(self) -> None:
        timeout_s = self._stuck.query_timeout_s
        for part, since in sorted(self._pending.items()):
            self._alive.beat()
            try:
                fold, released = recover_partition(
                    self._member.consumer, self.cfg, part, self.limits, timeout_s, self._alive
                )
            except BrokerError as exc:
                if time.monotonic() - since > BROKER_RETRY_S:
                    raise
                if self._stuck.replaced(part, since, exc):
                    return  # its assignment is gone; the new consumer's comes to _on_assign
                log.warning(
                    "replay buffer: recovering %s[%d] failed (%s); retrying",
                    self.topics.turns,
                    part,
                    exc,
                )
                self._stop.wait(RETRY_BACKOFF_S)
                continue
            self._claims[part] = released.claims
            self._recovery_letters += [self.records.bad_released(bad) for bad in released.bad]
            self.partitions[part] = fold
            del self._pending[part]
            self._paused.discard(part)
            self.metrics.recoveries.inc()

    def _update_gauges(self) -> None:
        self.metrics.open_groups.set(sum(len(f.open) for f in self.partitions.values()))
        self.metrics.released_uids.set(sum(len(f.released) for f in self.partitions.values()))
        observe_open_groups(self.metrics, self.partitions.values(), self.cfg.deadlines.group_s)


def count_committed(
    progress: ProgressLine, topics: Topics, committed: list[Outgoing], folded: int
) -> None:
    """A committed transaction in the progress line: groups, trajectories, events folded."""
    written = [record.topic for record in committed]
    progress.add("groups", written.count(topics.released))
    progress.add("trajectories", written.count(topics.trajectories))
    progress.add("turn events", folded)


def seek_to_folds(consumer: Consumer, topic: str, partitions: dict[int, PartitionFold]) -> None:
    """Each partition of ``topic`` back to where its fold stands (its next offset)."""
    for part, fold in partitions.items():
        at = fold.next_offset
        with translate_kafka_errors(
            "seeking back after a rebalance", topic=topic, partition=part, offset=at
        ):
            consumer.seek(TopicPartition(topic, part, at))


def main_loop_watch(cfg: Config, alive: Progress, transactional_id: str) -> MainLoopWatch:
    """The watch on a replay buffer's main loop (``alive``). It exits the process only where
    the loop is its main thread (the worker process); a buffer run on another thread (tests,
    an embedding program) is logged, not ended. A transactional call may wait a third of
    ``replay_buffer.txn_stall_s`` plus a grace: the limit is at least four stall limits."""
    own_process = threading.current_thread() is threading.main_thread()
    return MainLoopWatch(
        alive,
        max(MAIN_LOOP_LIMIT_S, 4 * cfg.replay_buffer.txn_stall_s),
        f"replay buffer {transactional_id}",
        log=log,
        exit_process=os._exit if own_process else None,
    )


def run_replay_buffer(cfg: Config) -> None:
    """Blocking: run one replay-buffer worker until SIGTERM/SIGINT."""
    if cfg.replay_buffer.metrics_port is not None:
        start_metrics_server(cfg.replay_buffer.metrics_port, cfg.replay_buffer.metrics_host)
    buffer = ReplayBuffer(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: buffer.stop())
    tune_gc_for_folding()
    buffer.run()


def tune_gc_for_folding() -> None:
    """For a process that folds turn events until it exits (the replay buffer, ``replay``).
    The fold allocates a few objects per token and frees them by reference counting;
    collector passes, each one over every open group's token lists, were 15-20% of the
    process's CPU at the default threshold of 700 allocations."""
    gc.freeze()  # start-up's objects (modules, clients) live as long as the process
    gc.set_threshold(GC_THRESHOLD_ALLOCATIONS)
