"""The dispatcher: feed prompt groups from a dataset, epoch after epoch, within the
staleness bound.

AReaL's bound, with verl's names (``async_training``, see ``AsyncTrainingConfig``): while
the trainer's current policy version is ``v``, at most

    (v + staleness_threshold + 1) * groups_per_version

groups have ever been started (published to ``rollout.prompts``), where
``groups_per_version = ppo_mini_batch_size * require_batches * trigger_parameter_sync_step``
is what the trainer consumes between two versions. So a group started under version ``v``
is trained at the latest by version ``v + staleness_threshold``. The version is the newest
run's current one on ``rollout.control`` (``rolloutbus.kafka.version_ledger``); before the
trainer publishes any, it is 0 (the initial weights).

**Runs.** A new training run starts again at version 0, so the bound counts the groups
started since the run began: ``groups_before_run + (v + staleness_threshold + 1) *
groups_per_version``. ``groups_before_run`` are this dispatcher's groups that lie before
the prompt topic's end offsets the trainer recorded when the run first started
(``RunStarted.prompt_offsets``): a restarted dispatcher finds the same number. When a run
names no offsets, the groups before it are those this process had started when it saw the
run (none, for the run current at start).

Group ``k`` of a run is row ``k % N`` of epoch ``k // N`` (N rows), and its uid is derived
from (dataset identity, row, epoch) as ``rolloutbus publish --epoch`` derives it. That makes
the dispatcher restartable without memory: on start it reads the uids on the prompt topic
and counts how many of its own groups are already there, then goes on after them; nothing
is published twice (a group published but not yet acknowledged when the process died is
found on the topic too, or re-sent with the same uid, which the replay buffer folds into
one group).

A row's own ``uid`` column is not used: each epoch needs new uids.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError, ConfigError
from rolloutbus.kafka.clients import (
    PartitionEnd,
    poll_record,
    read_committed_consumer,
    record_position,
    translate_kafka_errors,
)
from rolloutbus.kafka.control import PolicyVersionFollower, read_control_log
from rolloutbus.kafka.version_ledger import supersedes
from rolloutbus.producers.datasets import BadRow, read_rows
from rolloutbus.producers.publish import (
    PromptPublisher,
    build_group,
    dataset_identity,
    derive_uid,
)
from rolloutbus.producers.row_checks import RowChecker
from rolloutbus.schemas.control import PolicyVersionPublished, RunStarted
from rolloutbus.topics import Topics

__all__ = ["DispatchReport", "Dispatcher", "started_groups", "started_uids"]

log = logging.getLogger(__name__)
VERSION_POLL_S = 0.5  # seconds one wait for a new version lasts: the stop latency
# seconds without a record or partition end before the start-up read of the prompt topic
# counts as stalled (it reads ~18k uids/s here, so a large topic takes long but moves)
STALL_TIMEOUT_S = 60.0
DISPATCH_READER_GROUP = "rolloutbus-dispatch-reader"  # never commits: librdkafka wants an id


@dataclass
class DispatchReport:
    started: int = 0  # groups of this run on the prompt topic (found there + published now)
    found_on_topic: int = 0  # of those, already there when this process started
    published: int = 0  # by this process
    dead_lettered: int = 0  # bad rows (written once per process start)
    policy_version: int = 0  # the trainer's version when the dispatcher stopped
    bound: int = 0  # groups the bound allowed at that version
    run_id: str = ""  # the trainer's run then ("": none, or records without a run)
    groups_before_run: int = 0  # groups of this dispatcher started before that run began
    finished: bool = False  # every requested epoch was dispatched


class Dispatcher:
    """Publishes groups ``k = 0, 1, ...`` of a dataset while the bound allows."""

    def __init__(
        self,
        cfg: Config,
        dataset: str | Path,
        *,
        epochs: int | None = 1,
        run_name: str = "",
        progress: bool = True,
    ):
        if epochs is not None and epochs < 1:
            raise ConfigError(f"--epochs must be at least 1 (or omitted: forever), got {epochs}")
        self.cfg = cfg
        self.epochs = epochs
        self.progress = progress
        # the run's identity: the file's content plus an optional name, so the same file can
        # be dispatched again as a new run (new uids) by naming it
        identity = dataset_identity(dataset)
        self.identity = f"{identity}:{run_name}" if run_name else identity
        self.rows, self.bad_rows = _load(cfg, dataset)
        if not self.rows:
            raise ConfigError(f"{dataset} has no valid rows to dispatch")
        self._publisher = PromptPublisher(cfg)
        # set while the bound holds the dispatcher back (every allowed group is on the
        # topic): for tests and callers that want to know it is waiting for the trainer
        self.waiting = threading.Event()
        # the trainer's newest run and its current version (see "Runs" above)
        self._event: PolicyVersionPublished | None = None
        self._version = self._global_step = self._before_run = 0
        self._run_id: str | None = None  # None: no control record read yet

    @property
    def total(self) -> int | None:
        """Groups this run dispatches in all; None: forever."""
        return None if self.epochs is None else self.epochs * len(self.rows)

    def uid(self, k: int) -> str:
        row, epoch = k % len(self.rows), k // len(self.rows)
        return derive_uid(self.identity, row, epoch=epoch)

    def run(self, stop: threading.Event | None = None) -> DispatchReport:
        """Dispatch until every epoch is out or ``stop`` is set."""
        stop = stop or threading.Event()
        report = self.report = DispatchReport()  # live: read by its /metrics
        self._dead_letter_bad_rows(report)
        follower = PolicyVersionFollower(self.cfg)
        try:
            self._dispatch(follower, stop, report)
        finally:
            self._publisher.flush()
            follower.close()
        return report

    def _dispatch(
        self, follower: PolicyVersionFollower, stop: threading.Event, report: DispatchReport
    ) -> None:
        on_topic = started_groups(self.cfg)
        ledger = read_control_log(self.cfg)
        self._follow(ledger.current, ledger.run, on_topic, k=0)
        k, already = self._resume_point(set(on_topic))
        report.found_on_topic = k + len(already)
        self._say(f"{report.found_on_topic} groups of this run already on the prompt topic")
        while not stop.is_set() and (self.total is None or k < self.total):
            bound = self._bound()
            stop_at = bound if self.total is None else min(bound, self.total)
            while k < stop_at and not stop.is_set():
                if k not in already:
                    self._publish(k)
                    report.published += 1
                k += 1
            self._publisher.flush()  # a group counts as started once the broker has it
            self._report(report, k)
            if self.total is not None and k >= self.total:
                break
            self._say(f"{k} groups started at version {self._version} (bound {bound}); waiting")
            self._wait_for_new_version(follower, stop, k)
        self._report(report, k)
        report.finished = self.total is not None and k >= self.total
        self._say(
            f"{'done' if report.finished else 'stopped'}: {k} groups started "
            f"({report.published} by this process), version {self._version}"
        )

    def _report(self, report: DispatchReport, k: int) -> None:
        report.started, report.policy_version, report.bound = k, self._version, self._bound()
        report.run_id, report.groups_before_run = self._run_id or "", self._before_run

    def _bound(self) -> int:
        """Groups this dispatcher may have started in all, at the current version."""
        return self._before_run + self.cfg.async_training.max_groups_started(self._version)

    def _follow(
        self,
        event: PolicyVersionPublished | None,
        run: RunStarted | None,
        on_topic: dict[str, tuple[int, int]] | None,
        *,
        k: int,
    ) -> None:
        """Take the newest run's version; a run not seen before moves the bound's base."""
        run_id = run.run_id if run is not None else (event.run_id if event is not None else "")
        if run_id != self._run_id:
            self._before_run = self._groups_before(run, on_topic, k)
            self._run_id = run_id
            self._say(f"trainer run {run_id or '(none)'}: {self._before_run} groups before it")
        self._event = event
        self._version = event.policy_version if event is not None else 0
        self._global_step = event.global_step if event is not None else 0

    def _groups_before(
        self, run: RunStarted | None, on_topic: dict[str, tuple[int, int]] | None, k: int
    ) -> int:
        """This dispatcher's groups on the prompt topic before ``run`` began."""
        if run is None or not run.prompt_offsets:
            return k  # unknown: what this process started so far (0 at start)
        on_topic = on_topic if on_topic is not None else started_groups(self.cfg)
        before = 0
        for j in range(self.total if self.total is not None else len(on_topic)):
            found = on_topic.get(self.uid(j))
            if found is None:
                break  # the dispatcher's groups are started in order
            partition, offset = found
            if offset < run.prompt_offsets.get(partition, 0):
                before += 1
        return before

    def _resume_point(self, on_topic: set[str]) -> tuple[int, set[int]]:
        """The first group of this run not on the topic, and any later ones that are (a
        crash can lose an earlier record while a later one, on another partition, landed);
        they lie within the bound of the current version, so only that range is searched."""
        k = 0
        while (self.total is None or k < self.total) and self.uid(k) in on_topic:
            k += 1
        horizon = self._bound()
        if self.total is not None:
            horizon = min(horizon, self.total)
        later = {j for j in range(k + 1, horizon) if self.uid(j) in on_topic}
        return k, later

    def _publish(self, k: int) -> None:
        row = self.rows[k % len(self.rows)]  # without its own uid column (see above)
        group = build_group(
            self.cfg,
            row,
            uid=self.uid(k),
            global_steps=self._global_step,
            policy_version=self._version,
        )
        self._publisher.publish_group(group)

    def _wait_for_new_version(
        self, follower: PolicyVersionFollower, stop: threading.Event, k: int
    ) -> None:
        self.waiting.set()
        try:
            while not stop.is_set():
                event = follower.poll(VERSION_POLL_S)
                # the follower's first answer may be the version read at start again
                if event is not None and supersedes(event, self._event):
                    self._follow(event, follower.ledger.run, None, k=k)
                    self._say(f"trainer published version {event.policy_version}")
                    return
        finally:
            self.waiting.clear()

    def _dead_letter_bad_rows(self, report: DispatchReport) -> None:
        for bad in self.bad_rows:
            self._publisher.dlq.write(bad.original, bad.reason, source=bad.source)
            report.dead_lettered += 1

    def _say(self, message: str) -> None:
        if self.progress:
            print(f"dispatch: {message}", file=sys.stderr, flush=True)
        log.debug("dispatch: %s", message)


def started_uids(cfg: Config) -> set[str]:
    """Every uid on the prompt topic now (its keys), all partitions read to their end."""
    return set(started_groups(cfg))


def started_groups(cfg: Config) -> dict[str, tuple[int, int]]:
    """Every uid on the prompt topic now, with the (partition, offset) of its first record;
    all partitions read to their end.

    A consumer assigned to every partition, not ``read_partition``'s watermark query: the
    consumer waits out a partition that has no leader yet (a topic created a moment ago)
    where a watermark query fails at once.
    """
    kafka = cfg.kafka
    topic = Topics.from_config(kafka).prompts
    consumer = read_committed_consumer(kafka, DISPATCH_READER_GROUP, partition_eof=True)
    uids: dict[str, tuple[int, int]] = {}
    ended: set[int] = set()
    try:
        with translate_kafka_errors("assigning", topic=topic):
            consumer.assign(
                [TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(kafka.partitions)]
            )
        last_progress = time.monotonic()
        while len(ended) < kafka.partitions:
            if time.monotonic() - last_progress > STALL_TIMEOUT_S:
                raise BrokerError(
                    f"reading the uids on {topic} stalled for {STALL_TIMEOUT_S} s "
                    f"(partitions read to the end: {sorted(ended)})"
                )
            msg = poll_record(consumer, VERSION_POLL_S)
            if msg is not None:
                last_progress = time.monotonic()
            if isinstance(msg, PartitionEnd):
                ended.add(msg.partition)
            elif msg is not None and (key := msg.key()) is not None:
                uid = key.decode() if isinstance(key, bytes) else str(key)
                uids.setdefault(uid, record_position(msg))
    finally:
        consumer.close()
    return uids


def _load(cfg: Config, dataset: str | Path) -> tuple[list[dict[str, Any]], list[BadRow]]:
    """The rows that make a group, in file order; the rest (unreadable, or not a verl row
    within the limits) kept aside for the dead-letter topic. Checked once, up front, so a
    bad row cannot stop the run in a later epoch."""
    rows: list[dict[str, Any]] = []
    bad: list[BadRow] = []
    checker = RowChecker(cfg)  # what `rolloutbus publish` checks: loop, scorer, lengths
    for item in read_rows(dataset):
        if isinstance(item, BadRow):
            bad.append(item)
            continue
        data = {k: v for k, v in item.data.items() if k != "uid"}
        try:
            checker.check(build_group(cfg, data, uid="check"))
        except (ValidationError, ValueError) as exc:
            original = json.dumps(item.data, ensure_ascii=False, default=str).encode()
            bad.append(BadRow(item.source, original, f"row {item.source}: {exc}"))
            continue
        rows.append(data)
    return rows, bad
