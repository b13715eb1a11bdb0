"""The session processor as a Faust worker: rollout.prompts in, rollout.turns out.

The turn log is the source of truth for sessions (recovery is replay):

1. A prompt group is taken from rollout.prompts in offset order, one at a time, and its
   ``group_started`` is written to rollout.turns through an idempotent producer; only
   once that write is durable is the prompt acknowledged (and Faust may commit its
   offset). From then on the group belongs to the log.
2. Its n sessions run in the background (at most ``sessions.concurrency`` groups at once),
   every turn logged as it happens, each event numbered (``seq``) within its attempt.
3. A worker that gains a partition (start, rebalance, restart after a crash) folds that
   partition's turn log from the replay buffer's committed offset (the first event of the
   oldest group not yet released) and resumes every group that started and did not
   finish: each unsettled session re-runs its agent loop with generate() answered from
   its logged generations, so no token is sampled twice, then goes on live. Prompts of
   the partition wait until that is done, and a redelivered prompt whose group is already
   in the log is skipped.

So correctness never rests on Faust's offset bookkeeping: acknowledging in offset order
after the durable write only decides how much a restarted worker reads again. A write
that fails after the producer's retries ends the process (exit 70) before anything more
is acknowledged; the restart resumes from the log. A crash of every worker loses at most
the turns being generated at that moment.

Faust's own exactly-once mode is not used: it is still experimental upstream, with open
duplicate-on-rebalance bugs (github.com/faust-streaming/faust issues #323 and #517).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import faust
from pydantic import BaseModel, ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError, SchemaError
from rolloutbus.kafka.admin import check_partition_counts
from rolloutbus.kafka.async_producer import AsyncProducer
from rolloutbus.kafka.clients import record_location
from rolloutbus.kafka.dead_letters import DeadLetterWriter
from rolloutbus.metrics import start_metrics_server
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.progress import ProgressLine
from rolloutbus.schemas.prompts import PromptGroup, decode_prompt_group
from rolloutbus.schemas.turns import SessionFailed, SessionFinished
from rolloutbus.streams.agent_loop import registry
from rolloutbus.streams.inference.admission import ControlVersionWatch
from rolloutbus.streams.inference.llm_client import LLMClient
from rolloutbus.streams.sessions.consumer_watch import EXIT_CONSUMER_STALLED, ConsumerWatch
from rolloutbus.streams.sessions.heap import settle_start_up_heap
from rolloutbus.streams.sessions.metrics import SessionMetrics
from rolloutbus.streams.sessions.recovery import TurnLogScan, UnfinishedGroup
from rolloutbus.streams.sessions.runner import (
    EmitError,
    SessionContext,
    group_started,
    prompt_group_of,
    run_sessions,
)
from rolloutbus.streams.sessions.stall import StallWatch, waits_on
from rolloutbus.streams.sessions.turn_log import RecordTooLargeError, TurnLog, scan_turn_log
from rolloutbus.topics import Topics, session_key

log = logging.getLogger(__name__)

EXIT_TURN_LOG_UNWRITABLE = 70  # EX_SOFTWARE: restart the worker; it resumes from the log
# uids per partition remembered as already in the turn log (a redelivered prompt is
# skipped); a prompt redelivered after more groups than this is run again, and the replay
# buffer's released record keeps it from being released twice
STARTED_UIDS_MEMORY = 100_000
# seconds a revocation waits for stopped sessions and the producer's queue: well inside
# Faust's rebalance timeout, and a turn-log write takes milliseconds
REVOKE_DRAIN_S = 10.0


@dataclass
class PartitionState:
    recovered: asyncio.Event = field(default_factory=asyncio.Event)
    started_uids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # set when a rebalance takes the partition away: its sessions may log nothing more
    revoked: bool = False

    def remember(self, uid: str) -> None:
        self.started_uids[uid] = None
        while len(self.started_uids) > STARTED_UIDS_MEMORY:
            self.started_uids.popitem(last=False)


class SessionWorker:
    """The worker's state: what it owns, what runs, and how it resumes from the log."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.topics = Topics.from_config(cfg.kafka)
        self.partitions: dict[int, PartitionState] = {}
        self.ready = asyncio.Event()
        # one slot per group in flight; a slot belongs to the task that runs its group and is
        # given back when that task ends, however it ends (see _spawn)
        self._slots = asyncio.Semaphore(cfg.sessions.concurrency)
        self.metrics = SessionMetrics()
        self.stalls = StallWatch(cfg.sessions.stall_warn_s, self.metrics)
        self._background: set[asyncio.Task[Any]] = set()
        self.progress = ProgressLine("sessions", cfg.monitoring.progress_log_s, log)
        self._groups_running = 0
        # set once an assignment is in place, cleared when a rebalance revokes: a prompt is
        # never let go (acknowledged) in between, when it cannot be known whose it will be
        self.assignment_settled = asyncio.Event()
        self.consumer_watch = ConsumerWatch(
            cfg, self.topics.prompts, lambda: set(self.partitions), self._consumer_stalled
        )

    async def start(self) -> None:
        self.dlq = DeadLetterWriter(self.cfg.kafka, stage="sessions")
        self.producer = AsyncProducer(self.cfg.kafka)
        self.turn_log = TurnLog(self.cfg, self.producer, self.metrics)
        self.ctx = _build_context(self.cfg, self.dlq)
        await self.ctx.llm_client.probe_replicas()  # names every replica it cannot reach
        if self.cfg.sessions.metrics_port is not None:
            start_metrics_server(self.cfg.sessions.metrics_port, self.cfg.sessions.metrics_host)
        self._background.add(asyncio.ensure_future(self.stalls.run()))
        self._background.add(asyncio.ensure_future(self.consumer_watch.run()))
        if self.cfg.monitoring.progress_log_s > 0:
            self._background.add(asyncio.ensure_future(self._log_progress()))
        settle_start_up_heap()  # the start-up heap out of every later collection (issue 28)
        self.ready.set()

    async def _log_progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.monitoring.progress_log_s)
            self.progress.maybe_log({"groups in flight": self._groups_running})

    def _consumer_stalled(self, reason: str) -> None:
        """Flush what the sessions logged, then leave for the supervisor to restart us."""
        log.critical("session worker consumer stalled: %s; exiting so a restart rejoins", reason)
        self.producer.flush(REVOKE_DRAIN_S)
        _exit_for_restart(EXIT_CONSUMER_STALLED)

    # -- assignment --------------------------------------------------------------------
    def on_assigned(self, assigned: set[Any]) -> None:
        """Nothing slow here (a rebalance callback): recovery runs as a task."""
        self.consumer_watch.progressed()
        mine = {tp.partition for tp in assigned if tp.topic == self.topics.prompts}
        for partition in sorted(mine - set(self.partitions)):
            state = self.partitions[partition] = PartitionState()
            state.tasks.add(asyncio.ensure_future(self._recover(partition, state)))
        self.assignment_settled.set()

    async def on_revoked(self, revoked: set[Any]) -> None:
        """Stop the groups of partitions we lost: their new owner resumes them from the log.

        Faust awaits this before the rebalance goes on, so what the stopped sessions logged
        is durable before any worker (this one included) scans the log again: otherwise
        their last turns would land after the scan and be sampled a second time.
        """
        self.assignment_settled.clear()  # first: take() must not let a prompt go from here
        self.consumer_watch.progressed()
        stopped: list[asyncio.Task[Any]] = []
        for tp in revoked:
            state = (
                self.partitions.pop(tp.partition, None) if tp.topic == self.topics.prompts else None
            )
            if state is None:
                continue
            state.revoked = True
            state.recovered.set()  # a take() waiting on this partition lets its prompt go
            for task in state.tasks:
                task.cancel()
                stopped.append(task)
        if stopped:
            _, running = await asyncio.wait(stopped, timeout=REVOKE_DRAIN_S)
            if running:  # they stop at their next write at the latest (_emit_owned)
                log.warning("%d revoked groups still ran after %g s", len(running), REVOKE_DRAIN_S)
        if self.ready.is_set():
            await asyncio.to_thread(self.producer.flush, REVOKE_DRAIN_S)

    async def _recover(self, partition: int, state: PartitionState) -> None:
        await self.ready.wait()
        scan = await asyncio.to_thread(self._scan_turn_log, partition)
        for uid in scan.started_uids:
            state.remember(uid)
        # a gateway group's sessions are driven by an agent outside the bus: only the
        # gateway resumes them, when the agent calls again (streams/gateway)
        unfinished = [g for g in scan.unfinished() if g.group.driven_by != "gateway"]
        log.info(
            "turns[%d]: %d events scanned, %d groups to resume",
            partition,
            scan.events,
            len(unfinished),
        )
        for group in unfinished:
            await self._acquire_slot(group.group.uid)
            self._spawn(state, group.group.uid, self._resume_group(state, group))
        state.recovered.set()

    def _scan_turn_log(self, partition: int) -> TurnLogScan:
        return scan_turn_log(self.cfg, partition)

    # -- prompts -----------------------------------------------------------------------
    async def take(self, event: Any) -> None:
        """Write the group's ``group_started``, then run it in the background.

        Returns (and so lets Faust acknowledge the prompt) only when the group is in the turn
        log, the prompt was dead-lettered, or after a rebalance the partition is another
        worker's. Never in between: Faust keeps an acknowledgement made while the partition
        is revoked, and if the partition comes back to this worker it commits it, past a
        prompt whose group never started; a later crash then lost that group for good.
        """
        with self.consumer_watch.taking():  # a prompt in hand: the consumer delivers
            await self._take(event)

    async def _take(self, event: Any) -> None:
        partition = event.message.partition
        group: PromptGroup | None = None
        while (state := await self._owned_state(partition)) is not None:
            await state.recovered.wait()
            if self.partitions.get(partition) is not state:
                continue  # revoked while it recovered: whose it is shows after the rebalance
            group = group or self._parse(event)
            if group is None:
                return  # dead-lettered
            if group.uid in state.started_uids:
                log.info("prompt group %s is already in the turn log; not started again", group.uid)
                return
            if await self._start_on_a_slot(state, partition, group, event):
                return
        # another worker's after the rebalance: it reads the prompt from the committed offset

    async def _owned_state(self, partition: int) -> PartitionState | None:
        """This worker's state of ``partition`` once no rebalance is under way; None when the
        partition is another worker's."""
        await self.assignment_settled.wait()
        return self.partitions.get(partition)

    async def _start_on_a_slot(
        self, state: PartitionState, partition: int, group: PromptGroup, event: Any
    ) -> bool:
        """Start the group on a free slot. True when the prompt is done with (the group
        started, or dead-lettered); False when its partition was revoked first."""
        await self._acquire_slot(group.uid)
        outcome = "revoked"
        try:
            outcome = await self._start_group(state, partition, group, event)
        finally:
            if outcome != "started":  # however it ends short of a task, the slot goes back
                self._slots.release()
                self.stalls.forget_group(group.uid)
        return outcome != "revoked"

    async def _start_group(
        self, state: PartitionState, partition: int, group: PromptGroup, event: Any
    ) -> str:
        """Log ``group_started`` and run the group on the slot taken for it: "started",
        "dead_lettered" (too large to log) or "revoked" (not run)."""
        if self.partitions.get(partition) is not state:
            # revoked while every slot was busy (on_revoked cancels this partition's tasks,
            # but take() runs in Faust's agent): a group started now would run unowned
            # next to its new owner's and log turns after that owner's scan
            return "revoked"
        started = group_started(group, self.cfg)
        self.stalls.waiting(group.uid, group.uid, "the turn log (writing group_started)")
        try:
            await self.turn_log.emit(started)
        except RecordTooLargeError as exc:
            self.dlq.write(event.value, str(exc), source=_source(event))
            return "dead_lettered"
        except BrokerError as exc:
            _exit_unwritable(exc)
        if self.partitions.get(partition) is not state:
            # revoked while group_started was written: on_revoked flushed it before the
            # rebalance went on, so the next scan of this partition (by whichever worker
            # owns it then) finds the group and runs it; not here, under a revoked state
            return "revoked"
        state.remember(group.uid)
        self._spawn(state, group.uid, self._run_group(state, group, started.attempt))
        return "started"

    def _parse(self, event: Any) -> PromptGroup | None:
        if event.value is None:  # a tombstone: nothing to run, but never silently dropped
            self.dlq.write(
                b"",
                "a record without a value (tombstone) on the prompts topic",
                source=_source(event),
            )
            return None
        try:
            return decode_prompt_group(event.value)
        except (ValidationError, SchemaError) as exc:
            self.dlq.write(
                event.value, f"prompt group does not match its schema: {exc}", source=_source(event)
            )
            return None

    # -- running -----------------------------------------------------------------------
    async def _acquire_slot(self, uid: str) -> None:
        """Wait for one of the ``sessions.concurrency`` group slots for group ``uid``."""
        self.stalls.waiting(
            uid, uid, f"a free group slot (sessions.concurrency={self.cfg.sessions.concurrency})"
        )
        try:
            await self._slots.acquire()
        except BaseException:  # cancelled (a revocation) while waiting: nothing was taken
            self.stalls.forget_group(uid)
            raise

    def _spawn(self, state: PartitionState, uid: str, coro: Any) -> asyncio.Task[Any]:
        """Run group ``uid`` as a task of its partition, on the slot its caller acquired.

        The task owns the slot from here: a done callback gives it back. Not a ``finally``
        in the coroutine: a task cancelled before its first step (on_revoked cancels every
        task of a revoked partition, and _recover spawns several in one go) never runs its
        coroutine at all, so a ``finally`` there would leak the slot, and with every slot
        leaked the worker waits on ``_slots.acquire()`` forever.
        """
        task = asyncio.ensure_future(coro)
        state.tasks.add(task)
        self.stalls.settled(uid, uid)  # from here its sessions report their own progress
        task.add_done_callback(lambda done: self._group_ended(state, uid, done))
        return task

    def _group_ended(self, state: PartitionState, uid: str, task: asyncio.Task[Any]) -> None:
        state.tasks.discard(task)
        self._slots.release()
        self.stalls.forget_group(uid)

    async def _run_group(self, state: PartitionState, group: PromptGroup, attempt: str) -> None:
        await self._run_logged(state, group, attempt, None)

    async def _resume_group(self, state: PartitionState, unfinished: UnfinishedGroup) -> None:
        group = prompt_group_of(unfinished.group)
        log.info("resuming %s: sessions %s", group.uid, sorted(unfinished.sessions))
        await self._run_logged(state, group, unfinished.group.attempt, unfinished.sessions)

    async def _run_logged(
        self, state: PartitionState, group: PromptGroup, attempt: str, resume: Any
    ) -> None:
        emit = partial(self._emit_owned, state)
        before = _stats(self.ctx)
        self._groups_running += 1
        try:
            with self.metrics.track_group():
                results = await run_sessions(self.ctx, group, attempt, emit, resume)
            for result in results:
                self.metrics.count_session(failed=isinstance(result, SessionFailed))
            self.progress.add("groups", 1)
        except EmitError as exc:
            _exit_unwritable(exc)
        finally:
            self._groups_running -= 1
            self.metrics.count_recovery(before, _stats(self.ctx))

    async def _emit_owned(self, state: PartitionState, event: BaseModel) -> None:
        """Log an event of a group of ``state``'s partition while this worker owns it. A
        session that outlived the revocation's cancel (Python 3.11's wait_for can swallow
        one) would log turns beside the new owner's resumed attempt: it is cancelled here."""
        if state.revoked:
            raise asyncio.CancelledError(f"partition revoked: {type(event).__name__} not logged")
        await self._emit(event)

    async def _emit(self, event: BaseModel) -> None:
        """Log a session's event; each one is progress for the stall watch."""
        uid: str = event.uid  # type: ignore[attr-defined]  # every turn event has one
        session_id = getattr(event, "session_id", None)
        key = uid if session_id is None else session_key(uid, session_id)
        kind = getattr(event, "type", "event")
        self.stalls.waiting(uid, key, f"the turn log (writing its {kind})")
        await self.turn_log.emit(event)
        if kind == "generation":
            self.progress.add("turns", 1)
            self.progress.add("tokens sampled", len(event.token_ids))  # type: ignore[attr-defined]
        if isinstance(event, SessionFinished | SessionFailed):
            self.stalls.settled(uid, key)
        else:
            self.stalls.waiting(uid, key, waits_on(event))


def _stats(ctx: SessionContext) -> dict[str, int]:
    return dict(vars(ctx.stats))


def _source(event: Any) -> str:
    received = event.message  # Faust's message: topic, partition, offset as attributes
    return record_location(received.topic, received.partition, received.offset)


def _exit_unwritable(exc: BaseException) -> None:
    """The turn log cannot be written: stop before anything more is acknowledged."""
    log.critical(
        "cannot write the turn log (%s); exiting so a restarted worker resumes from the log", exc
    )
    _exit_for_restart(EXIT_TURN_LOG_UNWRITABLE)


def _exit_for_restart(code: int) -> None:
    """End the process at once (no Faust shutdown, nothing more acknowledged); the
    supervisor restarts it and the new worker resumes from the turn log."""
    logging.shutdown()
    os._exit(code)


def _build_context(cfg: Config, dlq: DeadLetterWriter) -> SessionContext:
    if cfg.rollout.agent.agent_loop_config_path:
        registry.load_agent_loop_config(cfg.rollout.agent.agent_loop_config_path)
    return SessionContext(
        config=cfg,
        tokenizer=load_tokenizer(cfg.model),
        # following rollout.control: a replica that restarts is routed to once it serves
        # the current policy version (streams/inference/admission.py)
        llm_client=LLMClient(cfg.replicas, cfg.rollout, versions=ControlVersionWatch(cfg)),
        dead_letter=lambda original, reason: dlq.write(original, reason),
    )


def _broker_url(cfg: Config) -> str:
    return ";".join(f"kafka://{hp}" for hp in cfg.kafka.bootstrap_servers.split(","))


def _broker_credentials(cfg: Config) -> Any:
    """Faust's consumer gets the same security settings as every confluent-kafka client."""
    kafka = cfg.kafka
    protocol = (kafka.security_protocol or "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol.endswith("SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_ca_location)
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    password = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return faust.SASLCredentials(
        username=kafka.sasl_username,
        password=password,
        mechanism=kafka.sasl_mechanism or "PLAIN",
        ssl_context=context,
    )


def build_app(cfg: Config) -> faust.App:
    """A Faust app that takes prompt groups in order; nothing is created at import time."""
    topics = Topics.from_config(cfg.kafka)
    datadir = cfg.sessions.data_dir.expanduser() / cfg.sessions.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)  # Faust makes only the last folder
    app = faust.App(
        cfg.sessions.app_id,
        broker=_broker_url(cfg),
        broker_credentials=_broker_credentials(cfg),
        value_serializer="raw",
        key_serializer="raw",
        web_enabled=False,
        datadir=str(datadir),
        topic_disable_leader=True,
        consumer_max_fetch_size=cfg.kafka.max_message_bytes,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,  # seconds; bounds how much a restart reads again
        broker_session_timeout=cfg.sessions.broker_session_timeout_s,
        stream_wait_empty=False,
    )
    prompts = app.topic(
        topics.prompts, key_type=bytes, value_type=bytes, partitions=cfg.kafka.partitions
    )
    worker = SessionWorker(cfg)

    @app.task
    async def start_worker() -> None:
        await worker.start()

    def on_assigned(sender: Any, assigned: Any, **kwargs: Any) -> None:
        worker.on_assigned(set(assigned))  # the new assignment: every topic's partitions

    async def on_revoked(sender: Any, revoked: Any, **kwargs: Any) -> None:
        await worker.on_revoked(set(revoked))

    # cast: mode's typing of Signal.connect does not admit a plain receiver function
    app.on_partitions_assigned.connect(cast(Any, on_assigned))
    app.on_partitions_revoked.connect(cast(Any, on_revoked))

    # concurrency 1: prompts are taken (and acknowledged) strictly in offset order; the
    # groups themselves run concurrently in the background
    @app.agent(prompts, concurrency=1)
    async def take_prompt_groups(stream: faust.StreamT) -> None:
        await worker.ready.wait()
        async for event in stream.events():
            await worker.take(event)

    return app


def run_session_worker(cfg: Config, loglevel: str = "info") -> None:
    """Blocking: run one session-processor worker until SIGTERM/SIGINT."""
    # a uid must land on the same partition number of every topic; stop before any work
    # if the cluster's topics disagree with each other or with kafka.partitions
    check_partition_counts(cfg.kafka)
    app = build_app(cfg)
    # the CLI's logging stays in charge (one format, Faust's and aiokafka's INFO lines
    # quiet unless -v): mode's own setup would install a second format on the root logger
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, override_logging=False)
    # no terminal spinner: Faust writes its cursor escapes (\x1b[?25h) to stdout even when
    # stdout is a file or a pipe, and stdout is for data (issue 30)
    worker.spinner = None
    worker.execute_from_commandline()


__all__ = ["RecordTooLargeError", "SessionWorker", "TurnLog", "build_app", "run_session_worker"]
