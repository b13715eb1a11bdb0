"""Kafka transactions for a consume-transform-produce processor: one batch, exactly once.

The seam is :class:`TransactionalProducer`. A processor folds what it consumed into
records, then hands them to :meth:`TransactionalProducer.commit` with the consumer
offsets they stand for; that either commits all of it, or raises
:class:`TransactionAborted` once nothing of it can ever become visible, and the processor
re-reads from its committed offsets. The protocol, numbered as in the replay buffer:

2. begin a transaction; produce every record;
3. send the consumer offsets to the transaction with the consumer group's metadata, so a
   member that lost the partitions in a rebalance is fenced (KIP-447);
4. commit the transaction.

**Failures.**

- *Retriable* (a broker restarting, a coordinator moving): the call is retried with backoff.
- *Abortable*, not retriable, or retries used up: the transaction is aborted (and the
  producer replaced, below).
- *Fatal* (the producer is fenced, or its transaction state is beyond repair, e.g.
  ``INVALID_TXN_STATE`` from ``abort_transaction`` after a broker was SIGKILLed, or from an
  abort that overtakes its first record's AddPartitionsToTxn, confluentinc/librdkafka#4849;
  also an abort that fails): the producer is **replaced**, never the process ended. A new
  producer with the same ``transactional.id`` runs ``init_transactions``, which fences the
  old one (any write it still attempts is rejected) and completes or aborts its open
  transaction before it returns, so what the processor reads back from its committed offsets
  afterwards is final: nothing is released twice.
- *Wedged*: librdkafka can block in ``send_offsets_to_transaction`` forever when the
  coordinator goes away during a broker restart (confluentinc/librdkafka#5456, #5511).
  Every call runs under a watchdog; one that outlives its timeout plus ``CALL_GRACE_S`` is
  left on its thread with its producer kept referenced (never destroyed under a blocked
  call), and the producer is replaced as for a fatal error.
- *Stalled*: after a broker restart a producer can time out on every call for minutes
  with its request never leaving the client ("Timed out 0 in-flight, 0 retry-queued, 1
  out-queue": the client lost its coordinator connection and does not find it again), while
  a new client connects at once. So retriable errors are retried on one producer for at
  most ``stall_s`` (``replay_buffer.txn_stall_s``, 30 s); then the producer is replaced as
  for a fatal error; the new one's ``init_transactions`` fences it and aborts its open
  transaction.
- *Any* failed transaction, even one aborted cleanly, hands the next one to a new producer:
  after a broker restart a producer that aborted cleanly still wedged its next
  ``send_offsets_to_transaction``, and a replacement costs one ``init_transactions``.
- *Authorization* errors are permanent: they raise :class:`BrokerError` at once.
- A broker that lets no transaction commit for ``broker_retry_s`` raises ``BrokerError``.

Each failure path ends in :class:`TransactionAborted`, whose ``cause`` (abortable,
retries_exhausted, stalled, wedged, fatal) and ``replaced`` are for the processor's metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from rolloutbus.config import KafkaConfig
from rolloutbus.errors import BrokerError, RolloutBusError
from rolloutbus.kafka.clients import (
    bare_kafka_exceptions,
    broker_error,
    kafka_error,
    transactional_producer,
)
from rolloutbus.kafka.watchdog import NoAnswer, Progress, run_watched

log = logging.getLogger(__name__)

ANY_PARTITION = -1  # an outgoing record the producer's partitioner places
CALL_TIMEOUT_S = 30.0  # seconds for each transactional call
CALL_GRACE_S = 5.0  # seconds past a call's own timeout (librdkafka answers by then unless it hangs)
# seconds of retriable failures on one producer before it is replaced: a healthy broker
# that restarts answers a new client within seconds, so a producer still timing out after
# this is stuck on a dead connection (the issue measured 4 minutes of 10 s timeouts)
STALL_S = 30.0
BROKER_RETRY_S = 300.0  # seconds of a broker failing every retry before giving up
RETRY_BACKOFF_S = 0.5  # seconds before the first retry, doubled up to RETRY_BACKOFF_MAX_S
RETRY_BACKOFF_MAX_S = 5.0
FENCED_CODES = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)
# permission errors no new producer can fix: the principal lacks an ACL
AUTHORIZATION_CODES = frozenset(
    {
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)
# the causes for which a failed transaction is ended by a new producer, not by an abort call
REPLACING_CAUSES = frozenset({"wedged", "fatal", "stalled"})
FENCED_LIMIT = 3  # fencings in a row (no commit between) that mean a second live process
FENCED_HINT = (
    "fenced: a newer producer with this transactional id exists (a restart of this member, "
    "the coordinator's timeout of a transaction, or another process with the same id: "
    "give every process its own)"
)


class OutgoingRecord(NamedTuple):
    """A record to produce inside a transaction."""

    topic: str
    key: str
    value: bytes
    partition: int  # ANY_PARTITION: the producer's partitioner places it
    timestamp_ms: int | None = None  # the record's timestamp; None: the produce time


class TransactionAborted(RolloutBusError):
    """The transaction was aborted (or its producer replaced): nothing of it is visible;
    re-read from the committed offsets."""

    def __init__(
        self, cause: str, action: str, detail: str, *, replaced: bool = False, fenced: bool = False
    ):
        super().__init__(f"{action}: {detail}")
        self.cause = cause  # abortable, retries_exhausted, stalled, wedged or fatal (a label)
        self.replaced = replaced  # the producer was replaced (after every failed transaction)
        self.fenced = fenced  # a newer producer with this transactional id exists


@dataclass(frozen=True)
class TransactionSettings:
    """Timing of the protocol; see the module constants for the units and reasons."""

    call_timeout_s: float = CALL_TIMEOUT_S
    call_grace_s: float = CALL_GRACE_S
    broker_retry_s: float = BROKER_RETRY_S
    retry_backoff_s: float = RETRY_BACKOFF_S
    retry_backoff_max_s: float = RETRY_BACKOFF_MAX_S
    stall_s: float = STALL_S
    # librdkafka settings of every producer made (the processor's linger, compression,
    # transaction.timeout.ms)
    producer_overrides: Mapping[str, Any] = field(default_factory=dict)
    # fenced this many times with no transaction committed between: another live process
    # holds the id (a restart or a coordinator's timeout fences once, then the new producer
    # commits); the two would go on aborting each other's transactions, so this one stops
    fenced_limit: int = FENCED_LIMIT
    fenced_hint: str = ""  # what the processor's user should check (its config key)


class TransactionalProducer:
    """One transactional id's producer, replaced whenever it cannot go on (module docstring)."""

    def __init__(
        self,
        kafka: KafkaConfig,
        transactional_id: str,
        settings: TransactionSettings | None = None,
        *,
        stop: threading.Event | None = None,
        progress: Progress | None = None,
    ):
        self.kafka = kafka
        self.transactional_id = transactional_id
        self.settings = settings or TransactionSettings()
        self._stop = stop or threading.Event()  # set: stop retrying, fail fast
        self._progress = progress or Progress()  # beaten per call attempt (a MainLoopWatch's)
        self._producer = self._new_producer()
        self._wedged: list[Producer] = []  # a thread may still be inside one: never destroyed
        self._failing_since: float | None = None  # first of consecutive failed transactions
        self._fenced_in_a_row = 0  # fencings since the last commit
        self._aborted_in_a_row = 0  # failed transactions since the last commit

    # -- the seam ----------------------------------------------------------------------------
    def init(self) -> None:
        """``init_transactions``: fences every earlier producer with this id, and completes
        or aborts its open transaction. Retried (a new producer after a fatal error) for up
        to ``broker_retry_s``."""
        give_up = time.monotonic() + self.settings.broker_retry_s
        while True:
            try:
                self._call(
                    f"init_transactions for {self.transactional_id!r}",
                    lambda: self._producer.init_transactions(self.settings.call_timeout_s),
                )
                return
            except TransactionAborted as failure:
                if self._stop.is_set():
                    return  # stopping: nothing more will be produced with it
                if time.monotonic() > give_up:
                    raise BrokerError(f"transactional producer: {failure}") from failure
                if failure.cause in REPLACING_CAUSES:
                    self._swap_producer(wedged=failure.cause == "wedged")
                self._stop.wait(self.settings.retry_backoff_s)

    def commit(
        self, records: Iterable[OutgoingRecord], offsets: list[TopicPartition], consumer: Consumer
    ) -> None:
        """Produce ``records`` and commit ``offsets`` of ``consumer``'s group, all in one
        transaction; raises TransactionAborted when nothing of it was committed."""
        try:
            self._call("beginning a transaction", self._producer.begin_transaction)  # 2.
            for record in records:
                self._produce(record)
            group_metadata = self._group_metadata(consumer)
            timeout = self.settings.call_timeout_s
            self._call(  # 3.
                "sending offsets to the transaction",
                lambda: self._producer.send_offsets_to_transaction(
                    offsets, group_metadata, timeout
                ),
            )
            self._call(  # 4.
                "committing the transaction", lambda: self._producer.commit_transaction(timeout)
            )
        except TransactionAborted as failure:
            raise self._aborted(failure) from failure
        self._committed_again()

    def _committed_again(self) -> None:
        """A transaction committed: the failures before it are over (one line saying so)."""
        if self._failing_since is not None:
            log.warning(
                "%s: transactions commit again after %.1f s (%d failed, each followed by a "
                "new producer)",
                self.transactional_id,
                time.monotonic() - self._failing_since,
                self._aborted_in_a_row,
            )
        self._failing_since = None
        self._fenced_in_a_row = self._aborted_in_a_row = 0

    def close(self) -> None:
        """Best effort on the way out: the error that ended the run, if any, is the one to
        report, not a flush failing after it (a fenced producer fails every call)."""
        if self._wedged:
            return  # a wedged producer's thread may hold librdkafka's locks
        try:
            with bare_kafka_exceptions():
                self._producer.flush(self.settings.call_timeout_s)
        except KafkaException as exc:
            log.debug("flush on exit failed: %s", exc)

    # -- one transactional call ----------------------------------------------------------------
    def _group_metadata(self, consumer: Consumer) -> Any:
        try:
            return consumer.consumer_group_metadata()
        except KafkaException as exc:  # a closed consumer: this batch cannot commit
            action = "reading the consumer group metadata"
            raise TransactionAborted("abortable", action, describe(exc)) from exc

    def _produce(self, record: OutgoingRecord) -> None:
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
                action = f"producing to {record.topic}"
                failure = self._failure(action, exc)
                raise failure or TransactionAborted("abortable", action, describe(exc)) from exc

    def _call(self, action: str, call: Callable[[], Any]) -> Any:
        """One transactional call: retriable errors retried with backoff for up to
        ``broker_retry_s``; every other failure raises TransactionAborted (or BrokerError
        for a missing permission)."""
        started = time.monotonic()
        give_up = started + self.settings.broker_retry_s
        backoff = self.settings.retry_backoff_s
        while True:
            self._progress.beat()
            try:
                with bare_kafka_exceptions():
                    return self._within_deadline(action, call)
            except KafkaException as exc:
                failure = self._failure(action, exc)
                if failure is not None:
                    raise failure from exc
                now = time.monotonic()
                if now > give_up or self._stop.is_set():
                    raise TransactionAborted("retries_exhausted", action, describe(exc)) from exc
                if now - started > self.settings.stall_s:
                    detail = (
                        f"retriable errors for {now - started:.0f} s on one producer "
                        f"(stall limit {self.settings.stall_s:.0f} s), the last: {describe(exc)}"
                    )
                    raise TransactionAborted("stalled", action, detail) from exc
                log.warning(
                    "%s: %s: %s; retrying in %.1f s",
                    self.transactional_id,
                    action,
                    describe(exc),
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(2 * backoff, self.settings.retry_backoff_max_s)

    def _failure(self, action: str, exc: KafkaException) -> RolloutBusError | None:
        """What ``exc`` means: None for a retriable error, else the error to raise."""
        err = kafka_error(exc)
        code = err.code() if err is not None else None
        if code in AUTHORIZATION_CODES:
            return broker_error(
                exc,
                f"transactional producer {self.transactional_id}: {action}",
                hint="the principal lacks an ACL for this (see docs/security.md)",
            )
        if err is not None and err.fatal():
            fenced = code in FENCED_CODES
            detail = describe(exc) + (f"; {FENCED_HINT}" if fenced else "")
            return TransactionAborted("fatal", action, detail, fenced=fenced)
        if err is not None and err.retriable() and not err.txn_requires_abort():
            return None
        return TransactionAborted("abortable", action, describe(exc))

    def _within_deadline(self, action: str, call: Callable[[], Any]) -> Any:
        """Run ``call`` on a helper thread; a call still running after its timeout plus the
        grace has wedged the producer (librdkafka#5456)."""
        limit = self.settings.call_timeout_s + self.settings.call_grace_s
        try:
            return run_watched(call, limit, action, thread_name="kafka-transaction-call")
        except NoAnswer as exc:
            raise TransactionAborted("wedged", action, f"no answer within {limit:.0f} s") from exc

    # -- after a failure -------------------------------------------------------------------------
    def _aborted(self, failure: TransactionAborted) -> TransactionAborted:
        """Abort the failed transaction where the producer can, then replace the producer;
        wait a backoff; the failure as the caller gets it (BrokerError once failing too
        long)."""
        log.warning("%s: %s (%s)", self.transactional_id, failure, failure.cause)
        self._check_fenced(failure)
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        self._aborted_in_a_row += 1
        if failure.cause not in REPLACING_CAUSES:
            try:
                self._call(
                    "aborting the transaction",
                    lambda: self._producer.abort_transaction(self.settings.call_timeout_s),
                )
            except TransactionAborted as again:
                log.warning("%s: %s", self.transactional_id, again)
                failure = again
        # A producer that failed a transaction does not get the next one: after a broker
        # restart one that aborted cleanly still wedged the next send_offsets (seen in the
        # broker-restart row), and a new one costs an init_transactions
        self._replace(wedged=failure.cause == "wedged")
        if now - self._failing_since > self.settings.broker_retry_s:
            raise BrokerError(
                f"{self.transactional_id}: no transaction committed for "
                f"{self.settings.broker_retry_s:.0f} s; the last one failed: {failure}"
            )
        self._stop.wait(self.settings.retry_backoff_s)
        return TransactionAborted(failure.cause, "transaction aborted", str(failure), replaced=True)

    def _check_fenced(self, failure: TransactionAborted) -> None:
        self._fenced_in_a_row += failure.fenced
        if self._fenced_in_a_row >= self.settings.fenced_limit:
            raise BrokerError(
                f"{self.transactional_id}: fenced {self._fenced_in_a_row} times in a row with "
                f"no transaction committed between (fatal): another live process holds this "
                f"transactional id; {self.settings.fenced_hint or 'give every process its own'}"
            ) from failure

    def _replace(self, *, wedged: bool) -> None:
        """A new producer with the same transactional id; its init_transactions fences the
        old one and ends the old one's open transaction before the caller re-reads."""
        log.warning("%s: replacing the producer", self.transactional_id)
        self._swap_producer(wedged=wedged)
        self.init()

    def _swap_producer(self, *, wedged: bool) -> None:
        old, self._producer = self._producer, self._new_producer()
        if wedged:
            self._wedged.append(old)  # a thread is inside it: keep it, never destroy it
        else:  # destroyed off this thread: librdkafka's teardown may wait on its brokers
            threading.Thread(target=_discard, args=(old,), daemon=True).start()

    def _new_producer(self) -> Producer:
        return transactional_producer(
            self.kafka, self.transactional_id, dict(self.settings.producer_overrides)
        )


def _discard(producer: Producer) -> None:
    """Drop a replaced producer's queued records; it is destroyed when this thread ends."""
    try:
        producer.purge()
    except KafkaException as exc:
        log.debug("purging a replaced producer failed: %s", exc)


def describe(exc: KafkaException) -> str:
    err = kafka_error(exc)
    return f"{err.str()} ({err.name()})" if err is not None else str(exc)


__all__ = [
    "ANY_PARTITION",
    "FENCED_HINT",
    "OutgoingRecord",
    "TransactionAborted",
    "TransactionSettings",
    "TransactionalProducer",
]
