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
dead letter). A broker error during a transaction: a retriable one is retried with
backoff; an abortable one (or retries used up) aborts the transaction and re-reads every
partition from its committed offset (the fold state of the aborted batch is discarded);
a fatal one (e.g. fenced by another process with the same ``transactional_id``) ends the
process with one line naming the cause. Transactional calls run under a watchdog: librdkafka
can block in ``send_offsets_to_transaction`` forever when the coordinator goes away during
a broker restart (confluentinc/librdkafka#5456, #5511); a call that outlives its timeout
plus ``CALL_GRACE_S`` retires the producer (kept referenced, never closed under a blocked
call) for a new one with the same transactional id, whose ``init_transactions`` fences
the old and aborts its transaction. A broker that stays unusable for ``BROKER_RETRY_S``
ends the process.
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
from collections.abc import Callable
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError, RolloutBusError, SchemaError
from rolloutbus.kafka.admin import check_partition_counts
from rolloutbus.kafka.clients import (
    broker_error,
    message_location,
    read_committed_consumer,
    record_or_partition_end,
    record_position,
    transactional_producer,
    translate_kafka_errors,
)
from rolloutbus.kafka.dead_letters import dead_letter_record
from rolloutbus.metrics import ReplayBufferMetrics, start_metrics_server
from rolloutbus.schemas.trajectories import TrajectoryStatus
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.assembly.partition_fold import FoldLimits, PartitionFold, ReleasedGroup
from rolloutbus.streams.assembly.release_metrics import (
    last_turn_timestamp_ms,
    observe_open_groups,
    observe_release,
)
from rolloutbus.streams.assembly.released import (
    BadRecord,
    ReleasedClaims,
    TurnLogProbe,
    read_released,
    released_record,
)
from rolloutbus.streams.assembly.session_fold import short_error
from rolloutbus.streams.assembly.trajectories import (
    RECORD_HEADROOM_BYTES,
    finalize_group,
    max_record_bytes,
)
from rolloutbus.topics import Topics

log = logging.getLogger(__name__)

POLL_BATCH = 500  # records per consume() call
POLL_TIMEOUT_S = 0.5  # seconds a poll waits for the first record of a batch; the idle cadence
COMMIT_IDLE_S = 5.0  # seconds between watermark-only commits when nothing is released
TXN_TIMEOUT_S = 30.0  # seconds for each transactional call and offset query
# ms the coordinator lets a transaction stay open: a crashed worker's open transaction holds
# back read_committed readers of its output partitions (trainers, the next owner's read of
# the released topic) until then; a batch's transaction lasts well under a second
TRANSACTION_TIMEOUT_MS = 30_000
CALL_GRACE_S = 5.0  # seconds past a call's own timeout (librdkafka answers by then unless it hangs)
BROKER_RETRY_S = 300.0  # seconds of a broker failing every retry before the worker gives up
RETRY_BACKOFF_S = 0.5  # seconds before the first retry, doubled up to RETRY_BACKOFF_MAX_S
RETRY_BACKOFF_MAX_S = 5.0
LINGER_MS = 5  # ms a record waits to batch; small, since each batch is flushed by its commit
GC_THRESHOLD_ALLOCATIONS = 50_000  # net allocations between young collections (default 700)
LETTER_REASON_CHARS = 4000  # characters of a decoder's error kept in a dead letter's reason
ANY_PARTITION = -1  # an outgoing record the producer's partitioner places (dead letters)
# consumer errors no retry can fix; every other non-fatal one is retried by librdkafka itself
PERMANENT_CONSUMER_ERRORS = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError._UNKNOWN_TOPIC,
    }
)
HEAD_MISSING_REASON = (
    "turn event of group {uid}, whose group_started is not in the turn log (deleted by "
    "retention, or never written): the group's sessions are released as failed records once "
    "it passes deadlines.group_s or replay_buffer.max_open_groups"
)
FENCED_HINT = (
    "another process runs with the same replay_buffer.transactional_id; leave it unset "
    "to give every process its own"
)


class Outgoing(NamedTuple):
    """A record to produce inside the batch's transaction."""

    topic: str
    key: str
    value: bytes
    partition: int  # ANY_PARTITION: the producer's partitioner places it
    timestamp_ms: int | None = None  # the record's timestamp; None: the produce time


class TransactionFailed(RolloutBusError):
    """A transaction must be aborted and its batch re-read from the committed offsets."""

    def __init__(self, cause: str, action: str, detail: str):
        super().__init__(f"{action}: {detail}")
        self.cause = cause  # abortable, retries_exhausted or wedged (a metrics label)


def default_transactional_id(group_id: str) -> str:
    """One per process: two workers from one config must not fence each other."""
    return f"{group_id}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class ReplayBuffer:
    def __init__(self, cfg: Config, *, metrics: ReplayBufferMetrics | None = None):
        self.cfg = cfg
        self.topics = Topics.from_config(cfg.kafka)
        self.metrics = metrics or ReplayBufferMetrics()
        self.transactional_id = cfg.replay_buffer.transactional_id or default_transactional_id(
            cfg.replay_buffer.group_id
        )
        self.limits = FoldLimits.from_config(cfg)
        self.max_record_bytes = max_record_bytes(cfg.kafka)
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
        self._consumer = read_committed_consumer(
            cfg.kafka, cfg.replay_buffer.group_id, overrides={"auto.offset.reset": "earliest"}
        )
        self._producer = self._new_producer()
        self._retired: list[Producer] = []  # wedged producers: a thread may still be inside one
        self._dirty = False
        self._last_commit = time.monotonic()
        self._failing_since: float | None = None  # first of consecutive failed transactions

    # -- lifecycle -------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Consume until stop(); every exit path closes the consumer (leaving the group)."""
        try:
            check_partition_counts(self.cfg.kafka)
            self._init_transactions()
            self._consumer.subscribe(
                [self.topics.turns],
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_revoke,
            )
            log.info("replay buffer %s consuming %s", self.transactional_id, self.topics.turns)
            while not self._stop.is_set():
                self.step()
        finally:
            self._consumer.close()
            for probe in self._probes.values():
                probe.close()
            self._flush_quietly()

    def _flush_quietly(self) -> None:
        """Best effort on the way out: the error that ended the run, if any, is the one to
        report, not a flush failing after it (a fenced producer fails every call)."""
        if self._retired:
            return  # a retired producer may hold a call that never returns
        try:
            self._producer.flush(TXN_TIMEOUT_S)
        except KafkaException as exc:
            log.debug("flush on exit failed: %s", exc)

    def step(self) -> int:
        """Recover pending partitions, then one batch of polls folded and committed in one
        transaction. Returns the records read."""
        self._recover_pending()
        messages, generation = self._poll_batch()
        if generation != self._generation:
            self._seek_ready_partitions_back()
            return 0
        outgoing, self._recovery_letters = self._recovery_letters, []
        for msg in messages:
            self._fold_message(msg, outgoing)
        idle_commit = self._dirty and time.monotonic() - self._last_commit > COMMIT_IDLE_S
        if outgoing or idle_commit:
            self._commit(outgoing)
        self._update_gauges()
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
        """Records only; a transient consumer error (the broker restarting) is logged and
        left to librdkafka's own retries, a fatal or permanent one raises BrokerError.
        (librdkafka's consume() waits until it has ``max_records`` or ``timeout_s`` passed.)"""
        with translate_kafka_errors("consuming", topic=self.topics.turns):
            batch = self._consumer.consume(max_records, timeout_s)
        records = []
        for msg in batch:
            err = msg.error()
            if err is None:
                records.append(msg)
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal() or err.code() in PERMANENT_CONSUMER_ERRORS:
                record_or_partition_end(msg)  # raises the BrokerError
            else:
                log.warning("consumer: %s (%s); the client retries", err.str(), err.name())
        return records

    def _pause_pending(self) -> None:
        """Stop fetching partitions that are not recovered yet (their records are dropped
        and re-read after recovery seeks back)."""
        todo = [p for p in self._pending if p not in self._paused]
        if not todo:
            return
        try:
            self._consumer.pause([TopicPartition(self.topics.turns, p) for p in todo])
        except KafkaException as exc:  # only saves fetches: recovery seeks back anyway
            log.debug("pausing %s failed: %s", todo, exc)
        self._paused.update(todo)

    def _seek_ready_partitions_back(self) -> None:
        """A rebalance ran during the polls: drop the batch; the partitions still owned go
        on from where their folds stand."""
        for part, fold in self.partitions.items():
            with translate_kafka_errors(
                "seeking back after a rebalance",
                topic=self.topics.turns,
                partition=part,
                offset=fold.next_offset,
            ):
                self._consumer.seek(TopicPartition(self.topics.turns, part, fold.next_offset))

    # -- folding ---------------------------------------------------------------------------
    def _fold_message(self, msg: Message, outgoing: list[Outgoing]) -> None:
        part, offset = record_position(msg)
        fold = self.partitions.get(part)
        if fold is None or offset < fold.next_offset:
            return  # not recovered yet (re-read after its seek), or folded already
        self._dirty = True
        try:
            event = decode_turn_event(msg.value() or b"")  # a null value is dead-lettered too
        except (ValidationError, RolloutBusError) as exc:
            fold.next_offset = offset + 1
            self._settle_claims(part, offset, None, fold, outgoing)
            outgoing.append(
                self._dead_letter(
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
            outgoing.append(self._dead_letter(msg, f"turn event cannot be folded: {exc}"))
            return
        if fold.opened_headless is not None:
            outgoing.append(self._dead_letter(msg, HEAD_MISSING_REASON.format(uid=event.uid)))
        if fold.ignored > ignored_before:
            self.metrics.duplicates.inc(fold.ignored - ignored_before)
        if fold.forgotten:
            self.metrics.released_uids_forgotten.inc(fold.forgotten)
            fold.forgotten = 0
        for group in released:
            outgoing.extend(self._release(part, group))

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
        out.extend(self._bad_released_letter(bad) for bad in refused)
        for freed in claims.take_freed():
            fold.released.pop(freed, None)

    def _bad_released_letter(self, bad: BadRecord) -> Outgoing:
        key = (bad.key or b"").decode("utf-8", "replace")
        return self._letter(bad.value, bad.reason, source=bad.source, key=key)

    def _release(self, part: int, released: ReleasedGroup) -> list[Outgoing]:
        """Trajectories, dead letters and the released record of one group."""
        done = finalize_group(released, self.cfg.rollout, max_record_bytes=self.max_record_bytes)
        observe_release(released, done.trajectories, self.cfg.rollout)  # RL figures (Prometheus)
        stamp = last_turn_timestamp_ms(released)  # trainer clients measure last turn -> trainer
        uid = released.group.uid
        if (claims := self._claims.get(part)) is not None:
            claims.forget(uid)  # released here and now: no earlier record decides about it
        self.metrics.groups.inc()
        if released.kind != "completed":
            self.metrics.groups_released_early.labels(kind=released.kind).inc()
        # a letter about one trajectory names its key; one about the group, the event that
        # released it
        group_source = f"{self.topics.turns}[{part}]@{released.last_offset} uid {uid}"
        out = [
            self._letter(
                letter.original,
                letter.reason,
                key=letter.key,
                source=group_source
                if letter.key == uid
                else f"{self.topics.trajectories} key {letter.key}",
            )
            for letter in done.letters
        ]
        for t, value in zip(done.trajectories, done.records, strict=True):
            self.metrics.trajectories.labels(status=t.status.value).inc()
            out.append(Outgoing(self.topics.trajectories, t.key, value, part, stamp))
        record = released_record(
            uid,
            part,
            trajectories=len(done.trajectories),
            failed=sum(t.status == TrajectoryStatus.FAILED for t in done.trajectories),
            kind=released.kind,
            turns_first_offset=released.first_offset,
            turns_last_offset=released.last_offset,
        )
        out.append(Outgoing(self.topics.released, uid, record.encode(), part))
        return out

    def _dead_letter(self, msg: Message, reason: str) -> Outgoing:
        key = (msg.key() or b"").decode("utf-8", "replace")
        return self._letter(msg.value() or b"", reason, source=message_location(msg), key=key)

    def _letter(self, original: bytes, reason: str, *, source: str, key: str) -> Outgoing:
        """A dead letter that fits the topic: an original too large to carry in base64 is
        cut, and the reason says so (a record over the limit would abort every retry)."""
        self.metrics.dead_letters.inc()
        letter = dead_letter_record(
            self.topics.dlq, original, stage="replay_buffer", reason=reason, source=source, key=key
        )
        if len(letter.value) > self.max_record_bytes:
            keep = max(
                0,
                (self.max_record_bytes - len(letter.value) + len(original) * 4 // 3) * 3 // 4
                - RECORD_HEADROOM_BYTES,
            )
            letter = dead_letter_record(
                self.topics.dlq,
                original[:keep],
                stage="replay_buffer",
                source=source,
                key=key,
                reason=f"{reason} (original cut to its first {keep} of {len(original)} bytes)",
            )
        return Outgoing(letter.topic, letter.key or "", letter.value, ANY_PARTITION)

    # -- the transaction -------------------------------------------------------------------
    def _commit(self, outgoing: list[Outgoing]) -> None:
        try:
            self._call("beginning a transaction", self._producer.begin_transaction)  # 2.
            for record in outgoing:
                self._produce(record)
            offsets = self._offsets()  # 3.
            with translate_kafka_errors("reading the consumer group metadata"):
                group_metadata = self._consumer.consumer_group_metadata()
            self._call(
                "sending offsets to the transaction",
                lambda: self._producer.send_offsets_to_transaction(
                    offsets, group_metadata, TXN_TIMEOUT_S
                ),
            )
            self._call(
                "committing the transaction",  # 4.
                lambda: self._producer.commit_transaction(TXN_TIMEOUT_S),
            )
        except TransactionFailed as failure:
            self._abort_and_rewind(failure)
            return
        self._dirty = False
        self._last_commit = time.monotonic()
        self._failing_since = None

    def _produce(self, record: Outgoing) -> None:
        kwargs: dict[str, Any] = (
            {} if record.partition == ANY_PARTITION else {"partition": record.partition}
        )
        if record.timestamp_ms is not None:
            kwargs["timestamp"] = record.timestamp_ms
        while True:
            try:
                self._producer.produce(record.topic, key=record.key, value=record.value, **kwargs)
                return
            except BufferError:
                self._producer.poll(0.1)  # local queue full: let deliveries drain
            except KafkaException as exc:
                self._raise_if_fatal("producing", exc)
                raise TransactionFailed(
                    "abortable", f"producing to {record.topic}", str(exc)
                ) from exc

    def _offsets(self) -> list[TopicPartition]:
        return [
            TopicPartition(self.topics.turns, part, fold.low_watermark())
            for part, fold in self.partitions.items()
        ]

    def _call(self, action: str, call: Callable[[], Any]) -> Any:
        """One transactional call: retriable errors retried with backoff for up to
        BROKER_RETRY_S; abortable ones (and exhausted retries) raise TransactionFailed;
        fatal ones raise BrokerError."""
        give_up = time.monotonic() + BROKER_RETRY_S
        backoff = RETRY_BACKOFF_S
        while True:
            try:
                return self._within_deadline(action, call)
            except KafkaException as exc:
                self._raise_if_fatal(action, exc)
                err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if err is not None and err.txn_requires_abort():
                    raise TransactionFailed("abortable", action, _describe(exc)) from exc
                if err is None or not err.retriable():
                    raise TransactionFailed("abortable", action, _describe(exc)) from exc
                if time.monotonic() > give_up or self._stop.is_set():
                    raise TransactionFailed("retries_exhausted", action, _describe(exc)) from exc
                log.warning(
                    "replay buffer: %s: %s; retrying in %.1f s", action, _describe(exc), backoff
                )
                self._stop.wait(backoff)
                backoff = min(2 * backoff, RETRY_BACKOFF_MAX_S)

    def _within_deadline(self, action: str, call: Callable[[], Any]) -> Any:
        """Run ``call`` on a helper thread; a call still running after TXN_TIMEOUT_S +
        CALL_GRACE_S has wedged the producer (librdkafka#5456)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = call()
            except BaseException as exc:  # re-raised on the caller's thread below
                box["error"] = exc

        helper = threading.Thread(target=run, name="replay-buffer-txn", daemon=True)
        helper.start()
        helper.join(TXN_TIMEOUT_S + CALL_GRACE_S)
        if helper.is_alive():
            raise TransactionFailed(
                "wedged", action, f"no answer within {TXN_TIMEOUT_S + CALL_GRACE_S:.0f} s"
            )
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _raise_if_fatal(self, action: str, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is not None and err.fatal():
            fenced = err.code() in (
                KafkaError._FENCED,
                KafkaError.PRODUCER_FENCED,
                KafkaError.INVALID_PRODUCER_EPOCH,
            )
            raise broker_error(
                exc,
                f"replay buffer {self.transactional_id}: {action} (fatal)",
                hint=FENCED_HINT if fenced else "restart the worker",
            ) from exc

    def _abort_and_rewind(self, failure: TransactionFailed) -> None:
        """Abort (or, for a wedged producer, replace it), then re-read every partition from
        its committed offset: the fold state of the aborted batch is discarded."""
        self.metrics.transaction_aborts.labels(cause=failure.cause).inc()
        log.warning(
            "replay buffer: %s (%s): aborting; every partition is re-read from its "
            "committed offset",
            failure,
            failure.cause,
        )
        if failure.cause == "wedged":
            self._replace_producer()
        else:
            try:
                self._call(
                    "aborting the transaction",
                    lambda: self._producer.abort_transaction(TXN_TIMEOUT_S),
                )
            except TransactionFailed as again:
                log.warning("replay buffer: %s; replacing the producer", again)
                self._replace_producer()
        now = time.monotonic()
        for part in self.partitions:
            self._pending[part] = now
        self.partitions.clear()
        self._paused.clear()
        self._dirty = False  # the recovered folds are what was committed
        self._failing_since = self._failing_since or now
        if now - self._failing_since > BROKER_RETRY_S:
            raise BrokerError(
                f"replay buffer {self.transactional_id}: no transaction committed for "
                f"{BROKER_RETRY_S:.0f} s; the last one failed: {failure}"
            )
        self._stop.wait(RETRY_BACKOFF_S)

    def _new_producer(self) -> Producer:
        return transactional_producer(
            self.cfg.kafka,
            self.transactional_id,
            {
                "linger.ms": LINGER_MS,
                "compression.type": "lz4",
                "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            },
        )

    def _replace_producer(self) -> None:
        """A new producer with the same transactional id: its init_transactions fences the
        old one, and the coordinator aborts the old one's open transaction."""
        self._retired.append(self._producer)
        self._producer = self._new_producer()
        self._init_transactions()

    def _init_transactions(self) -> None:
        give_up = time.monotonic() + BROKER_RETRY_S
        while True:
            try:
                self._call(
                    f"init_transactions for {self.transactional_id!r}",
                    lambda: self._producer.init_transactions(TXN_TIMEOUT_S),
                )
                return
            except TransactionFailed as failure:
                if time.monotonic() > give_up:
                    raise BrokerError(f"replay buffer: {failure}") from failure
                if failure.cause == "wedged":
                    self._retired.append(self._producer)
                    self._producer = self._new_producer()
                self._stop.wait(RETRY_BACKOFF_S)

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
        for part, since in sorted(self._pending.items()):
            try:
                fold = self._recover(part)
            except BrokerError as exc:
                if time.monotonic() - since > BROKER_RETRY_S:
                    raise
                log.warning(
                    "replay buffer: recovering %s[%d] failed (%s); retrying",
                    self.topics.turns,
                    part,
                    exc,
                )
                self._stop.wait(RETRY_BACKOFF_S)
                continue
            self.partitions[part] = fold
            del self._pending[part]
            self._paused.discard(part)
            self.metrics.recoveries.inc()

    def _recover(self, part: int) -> PartitionFold:
        """The fold of ``part`` as of its committed offset: the uids already released on it
        (the released topic), then a seek back to that offset."""
        tp = TopicPartition(self.topics.turns, part)
        with translate_kafka_errors("reading the committed offset", topic=tp.topic, partition=part):
            [committed] = self._consumer.committed([tp], timeout=TXN_TIMEOUT_S)
            low, _ = self._consumer.get_watermark_offsets(tp, timeout=TXN_TIMEOUT_S, cached=False)
        if committed.error is not None:
            raise broker_error(
                committed.error, "reading the committed offset", topic=tp.topic, partition=part
            )
        start = max(committed.offset, low) if committed.offset >= 0 else low
        released = read_released(
            self.cfg.kafka, self.topics.released, part, self.limits.max_released, start
        )
        self._claims[part] = released.claims
        self._recovery_letters += [self._bad_released_letter(bad) for bad in released.bad]
        fold = PartitionFold(start, released=released.uids, limits=self.limits)
        with translate_kafka_errors(
            "seeking to the committed offset", topic=tp.topic, partition=part, offset=start
        ):
            self._consumer.seek(TopicPartition(tp.topic, part, start))
            self._consumer.resume([tp])
        log.info(
            "recovered %s[%d] at offset %d: %d released groups remembered (of %d read)",
            tp.topic,
            part,
            start,
            len(released.uids),
            released.read,
        )
        return fold

    def _update_gauges(self) -> None:
        self.metrics.open_groups.set(sum(len(f.open) for f in self.partitions.values()))
        self.metrics.released_uids.set(sum(len(f.released) for f in self.partitions.values()))
        observe_open_groups(self.metrics, self.partitions.values(), self.cfg.deadlines.group_s)


def _describe(exc: KafkaException) -> str:
    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    return f"{err.str()} ({err.name()})" if err is not None else str(exc)


def run_replay_buffer(cfg: Config) -> None:
    """Blocking: run one replay-buffer worker until SIGTERM/SIGINT."""
    if cfg.replay_buffer.metrics_port is not None:
        start_metrics_server(cfg.replay_buffer.metrics_port, cfg.replay_buffer.metrics_host)
    buffer = ReplayBuffer(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: buffer.stop())
    # The fold allocates a few objects per token and frees them by reference counting;
    # collector passes, each one over every open group's token lists, were 15-20% of the
    # process's CPU at the default threshold of 700 allocations
    gc.freeze()  # start-up's objects (modules, clients) live as long as the process
    gc.set_threshold(GC_THRESHOLD_ALLOCATIONS)
    buffer.run()
