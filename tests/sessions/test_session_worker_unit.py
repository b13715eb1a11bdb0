"""The session worker's own decisions, without Faust or a broker (pure, with small stand-ins
for Faust's event and the turn-log writer — test doubles, named as such below).

What these pin: a prompt is never acknowledged (``take`` never returns) when its
``group_started`` could not be written, and a group whose sessions cannot be logged ends the
process rather than leaving the group open forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections import namedtuple
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.schemas.turns import GroupStarted, SessionStarted
from rolloutbus.streams.sessions import worker as worker_module
from rolloutbus.streams.sessions.metrics import SessionMetrics
from rolloutbus.streams.sessions.recovery import UnfinishedGroup
from rolloutbus.streams.sessions.runner import SessionContext, _within_deadline
from rolloutbus.streams.sessions.stall import StallWatch
from rolloutbus.streams.sessions.worker import PartitionState, SessionWorker

TP = namedtuple("TP", "topic partition")  # test double for a Kafka topic-partition


class Exited(Exception):
    """Stands in for os._exit in these tests: the process would end here."""


class UnwritableTurnLog:
    """Test double for TurnLog: every write fails as a broker outage would, after retries."""

    def __init__(self) -> None:
        self.attempts = 0

    async def emit(self, event) -> None:
        self.attempts += 1
        raise BrokerError("producing failed at rollout.turns[0]: Local: Message timed out")


class RecordingDLQ:
    """Test double for the dead-letter writer."""

    def __init__(self) -> None:
        self.letters: list[tuple[bytes, str]] = []

    def write(self, original: bytes, reason: str, source: str = "") -> None:
        self.letters.append((original, reason))


def _event(value: bytes | None, partition: int = 0):
    """Test double for a Faust event: the value and where it was read."""
    message = SimpleNamespace(
        topic="rollout.prompts",
        partition=partition,
        offset=7,
        tp=SimpleNamespace(topic="rollout.prompts", partition=partition),
    )
    return SimpleNamespace(value=value, message=message)


def _worker(monkeypatch) -> SessionWorker:
    def exit_now(exc: BaseException) -> None:
        raise Exited(str(exc))

    monkeypatch.setattr(worker_module, "_exit_unwritable", exit_now)
    worker = SessionWorker(Config())
    worker.turn_log = UnwritableTurnLog()  # type: ignore[assignment]
    worker.dlq = RecordingDLQ()  # type: ignore[assignment]
    worker.ctx = SessionContext(config=Config(), tokenizer=None, llm_client=None)
    state = worker.partitions[0] = PartitionState()
    state.recovered.set()
    worker.assignment_settled.set()  # partition 0 assigned, as on_assigned leaves it
    return worker


def _scan_finds(worker: SessionWorker, monkeypatch, started: set[str]) -> None:
    """Test double for the turn-log scan on (re)assignment: these groups started, none open."""
    scan = SimpleNamespace(started_uids=started, events=len(started), unfinished=lambda: [])
    monkeypatch.setattr(worker, "_scan_turn_log", lambda partition: scan)


def _group() -> bytes:
    group = PromptGroup(
        uid="g1",
        n=2,
        sampling_params=GroupSamplingParams(),
        row={"prompt": [{"role": "user", "content": "hi"}]},
    )
    return group.model_dump_json(by_alias=True).encode()


async def test_a_prompt_whose_group_started_cannot_be_written_is_never_acknowledged(monkeypatch):
    worker = _worker(monkeypatch)
    with pytest.raises(Exited, match="Message timed out"):
        await worker.take(_event(_group()))  # Faust acks only after take() returns
    assert worker.turn_log.attempts == 1
    assert "g1" not in worker.partitions[0].started_uids


async def test_a_group_whose_turns_cannot_be_written_ends_the_process(monkeypatch):
    worker = _worker(monkeypatch)
    group = PromptGroup.model_validate_json(_group())
    await worker._slots.acquire()  # as take() does before it starts a group
    state = worker.partitions[0]
    task = worker._spawn(state, group.uid, worker._run_logged(state, group, "a0", None))
    with pytest.raises(Exited):
        await task
    await asyncio.sleep(0)  # the task's done callbacks
    assert worker._slots._value == worker.cfg.sessions.concurrency  # its slot was given back


async def test_a_tombstone_and_a_bad_prompt_are_dead_lettered_and_skipped(monkeypatch):
    worker = _worker(monkeypatch)
    await worker.take(_event(None))
    await worker.take(_event(b'{"uid": "x", "row": {"prompt": "a string"}}'))
    reasons = [reason for _, reason in worker.dlq.letters]
    assert len(reasons) == 2 and "tombstone" in reasons[0] and "schema" in reasons[1]
    assert worker.turn_log.attempts == 0  # nothing reached the turn log


async def test_a_prompt_of_a_revoked_partition_is_left_for_its_new_owner(monkeypatch):
    worker = _worker(monkeypatch)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    state = worker.partitions[0]
    state.recovered.clear()
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    await asyncio.sleep(0)
    assert not waiting.done()  # whose the prompt is shows only after the rebalance
    _scan_finds(worker, monkeypatch, started=set())
    worker.on_assigned({TP(worker.topics.prompts, 1)})  # partition 0 went to another worker
    await waiting  # returns without writing: the new owner reads the prompt again
    assert worker.turn_log.attempts == 0


async def test_a_prompt_waiting_for_a_slot_when_its_partition_is_revoked_is_not_started(
    monkeypatch,
):
    """Every slot busy, the partition revoked meanwhile: the group must not start on the
    old owner once a slot frees (it would run unowned next to the new owner's resumption
    and log turns after that owner's scan: turns sampled twice)."""
    worker = _worker(monkeypatch)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    for _ in range(worker.cfg.sessions.concurrency):
        await worker._slots.acquire()  # every slot taken by groups already running
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    worker._slots.release()  # a running group ends
    worker.on_assigned(set())  # partition 0 went to another worker
    await waiting
    assert worker.turn_log.attempts == 0  # no group_started written by the old owner
    assert worker._slots._value == 1  # the slot it took was given back


class SlowTurnLog:
    """Test double for TurnLog: a write that is acknowledged only when ``done`` is set."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = asyncio.Event()

    async def emit(self, event) -> None:
        self.events.append(event)
        await self.done.wait()


async def test_a_group_whose_partition_is_revoked_while_group_started_is_written_is_left(
    monkeypatch,
):
    """group_started is durable once on_revoked has flushed, so the new owner's scan runs
    the group; the old owner must not run it too."""
    worker = _worker(monkeypatch)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    worker.turn_log = SlowTurnLog()  # type: ignore[assignment]
    started = []
    monkeypatch.setattr(
        worker, "_spawn", lambda state, uid, coro: (started.append(coro), coro.close())
    )
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    assert [e.type for e in worker.turn_log.events] == ["group_started"]
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    worker.turn_log.done.set()
    worker.on_assigned(set())  # partition 0 went to another worker
    await waiting
    assert started == []  # not run by the old owner
    assert worker._slots._value == worker.cfg.sessions.concurrency  # its slot was given back


async def test_a_prompt_whose_group_is_already_in_the_turn_log_is_not_started_again(monkeypatch):
    worker = _worker(monkeypatch)
    worker.partitions[0].remember("g1")  # the recovery scan found its group_started
    await worker.take(_event(_group()))  # a re-published or redelivered prompt
    assert worker.turn_log.attempts == 0


def test_faust_keeps_its_folder_under_sessions_data_dir_not_the_working_directory(tmp_path):
    """Faust's default folder is ``{app_id}-data`` in the working directory: every worker
    run left one in the checkout. It goes under ``sessions.data_dir`` instead."""
    cfg = Config.model_validate(
        {"sessions": {"app_id": "workers-a", "data_dir": str(tmp_path / "var" / "faust")}}
    )
    app = worker_module.build_app(cfg)
    assert app.conf.datadir.resolve() == (tmp_path / "var" / "faust" / "workers-a").resolve()
    assert (tmp_path / "var" / "faust").is_dir()


def _unfinished(uid: str, offset: int) -> UnfinishedGroup:
    started = GroupStarted(
        uid=uid, attempt="a0", n=1, row={"prompt": [{"role": "user", "content": "hi"}]}
    )
    return UnfinishedGroup(started, offset, {0: None})  # its one session never started


class ScanWith:
    """Test double for the turn-log scan: these groups started and did not finish."""

    def __init__(self, groups: list[UnfinishedGroup]):
        self.groups = groups

    def __call__(self, partition: int) -> SimpleNamespace:
        return SimpleNamespace(
            started_uids={g.group.uid for g in self.groups},
            events=len(self.groups),
            unfinished=lambda: list(self.groups),
        )


async def _assigned_then_revoked_at_once(worker: SessionWorker) -> None:
    """Assign partition 0 and revoke it the moment its recovery has spawned its groups,
    before their tasks took a step (as a rebalance that follows another can)."""
    worker.on_assigned({TP(worker.topics.prompts, 0)})
    state = worker.partitions[0]
    while not state.recovered.is_set():
        await asyncio.sleep(0)  # spinning: this task runs next, before the spawned ones
    assert len([t for t in state.tasks if not t.done()]) == 2  # its two groups, spawned
    await worker.on_revoked({TP(worker.topics.prompts, 0)})


async def test_groups_revoked_before_their_first_step_give_their_slots_back(monkeypatch):
    """A task cancelled before its first step never runs its coroutine (not even a
    ``finally``), so a slot released there leaked: with every slot leaked, the next
    recovery waited on a slot forever and its groups never ran (a silent hang)."""
    worker = _worker(monkeypatch)
    worker.cfg = Config.model_validate({"sessions": {"concurrency": 2}})
    worker._slots = asyncio.Semaphore(2)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    del worker.partitions[0]
    monkeypatch.setattr(
        worker, "_scan_turn_log", ScanWith([_unfinished(f"g{i}", i) for i in (0, 1)])
    )
    ran: list[str] = []

    async def run_sessions(ctx, group, attempt, emit, resume):  # test double for the runner
        ran.append(group.uid)
        return []

    monkeypatch.setattr(worker_module, "run_sessions", run_sessions)
    await _assigned_then_revoked_at_once(worker)
    assert ran == []  # cancelled before they ran
    await asyncio.sleep(0)
    assert worker._slots._value == 2  # both slots given back
    worker.on_assigned({TP(worker.topics.prompts, 0)})  # the partition comes back
    await asyncio.wait_for(worker.partitions[0].recovered.wait(), timeout=5)
    await asyncio.wait_for(asyncio.gather(*worker.partitions[0].tasks), timeout=5)
    assert sorted(ran) == ["g0", "g1"]  # resumed, not waiting on a leaked slot


class FakeClock:
    """Test double for time.monotonic: advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_session_without_progress_is_reported_once_with_what_it_waits_on(caplog):
    clock = FakeClock()
    metrics = SessionMetrics(CollectorRegistry())
    watch = StallWatch(60.0, metrics, clock=clock)
    watch.waiting("g1", "g1", "a free group slot (sessions.concurrency=2)")
    watch.waiting("g2", "g2_0", "the replica's answer to its next turn")
    clock.now = 59.0
    assert watch.check() == []
    watch.waiting("g2", "g2_0", "the agent loop after turn 0 (a tool, the reward or ...)")
    clock.now = 61.0
    with caplog.at_level(logging.WARNING):
        stalls = watch.check()
    assert [(s.key, s.what) for s in stalls] == [
        ("g1", "a free group slot (sessions.concurrency=2)")
    ]
    assert "g1 has made no progress for 61 s" in caplog.text and "group slot" in caplog.text
    assert watch.check() == []  # reported once per stall
    assert metrics.stalls._value.get() == 1 and metrics.stalled._value.get() == 1
    clock.now = 200.0
    assert [s.key for s in watch.check()] == ["g2_0"]  # its progress at 59 s was the last
    watch.settled("g2", "g2_0")
    watch.forget_group("g1")
    assert metrics.stalls._value.get() == 2 and metrics.stalled._value.get() == 0


async def test_the_worker_reports_a_group_waiting_for_a_slot_and_a_session_on_the_replica(
    monkeypatch,
):
    worker = _worker(monkeypatch)
    worker.turn_log = SlowTurnLog()  # type: ignore[assignment]
    worker.turn_log.done.set()  # every write acknowledged at once
    clock = FakeClock()
    worker.stalls = StallWatch(30.0, SessionMetrics(CollectorRegistry()), clock=clock)
    await worker._emit(
        SessionStarted(uid="g0", session_id=1, attempt="a", agent_name="single_turn_agent")
    )
    for _ in range(worker.cfg.sessions.concurrency):
        await worker._slots.acquire()  # every slot busy
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    clock.now = 31.0
    stalls = {s.key: s.what for s in worker.stalls.check()}
    assert stalls == {
        "g0_1": "the replica's answer to its next turn",
        "g1": f"a free group slot (sessions.concurrency={worker.cfg.sessions.concurrency})",
    }
    waiting.cancel()


async def test_a_prompt_revoked_while_waiting_for_a_slot_starts_when_its_partition_comes_back(
    monkeypatch,
):
    """An eager rebalance revokes every partition and may hand one straight back. The
    prompt that waited for a slot meanwhile used to return unstarted, and Faust committed its
    acknowledgement once the partition was back: a crash before the prompt came round again
    lost its group for good (4 sessions lost in the rebalance fault row)."""
    worker = _worker(monkeypatch)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    worker.turn_log = SlowTurnLog()  # type: ignore[assignment]
    worker.turn_log.done.set()  # every write acknowledged at once
    spawned = []
    monkeypatch.setattr(
        worker, "_spawn", lambda state, uid, coro: (spawned.append(uid), coro.close())
    )
    for _ in range(worker.cfg.sessions.concurrency):
        await worker._slots.acquire()  # every slot taken by groups already running
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    _scan_finds(worker, monkeypatch, started=set())  # the group is not in the turn log
    worker.on_assigned({TP(worker.topics.prompts, 0)})  # ... and the partition comes back
    worker._slots.release()  # a running group ends
    await asyncio.wait_for(waiting, timeout=5)
    assert [e.type for e in worker.turn_log.events] == ["group_started"]
    assert spawned == ["g1"]  # run here, under the partition's new state


async def test_a_group_started_during_a_revocation_is_not_started_twice_when_it_comes_back(
    monkeypatch,
):
    """group_started was being written when the partition was revoked: on_revoked flushed
    it, the partition's next scan finds it, and the prompt is not started a second time."""
    worker = _worker(monkeypatch)
    worker.ready.set()
    worker.producer = SimpleNamespace(flush=lambda timeout: 0)  # test double: nothing queued
    worker.turn_log = SlowTurnLog()  # type: ignore[assignment]
    spawned = []
    monkeypatch.setattr(
        worker, "_spawn", lambda state, uid, coro: (spawned.append(uid), coro.close())
    )
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    worker.turn_log.done.set()
    _scan_finds(worker, monkeypatch, started={"g1"})  # the flushed group_started
    worker.on_assigned({TP(worker.topics.prompts, 0)})
    await asyncio.wait_for(waiting, timeout=5)
    assert [e.type for e in worker.turn_log.events] == ["group_started"]  # written once
    assert spawned == []  # the new state's recovery resumes it (its scan found it)


async def test_a_session_that_outlives_its_revocation_logs_nothing_more(monkeypatch):
    """A group task can miss the cancel of a revocation (Python 3.11's asyncio.wait_for
    returns the inner result when the cancel arrives as that finishes). It must still log
    nothing once its partition is revoked: its new owner has scanned the log and resumed the
    session, so a turn logged now is a turn sampled twice. The stand-in session below
    swallows its cancel as wait_for did."""
    worker = _worker(monkeypatch)
    worker.turn_log = SlowTurnLog()  # type: ignore[assignment]
    worker.turn_log.done.set()
    state = worker.partitions[0]
    first = SessionStarted(uid="g1", session_id=0, attempt="a", agent_name="single_turn_agent")
    second = SessionStarted(uid="g1", session_id=1, attempt="a", agent_name="single_turn_agent")

    async def sessions_that_swallow_their_cancel(ctx, group, attempt, emit, resume):
        # test double for run_sessions: it logs through the emit the worker hands it
        await emit(first)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # swallowed
        await emit(second)
        return []

    monkeypatch.setattr(worker_module, "run_sessions", sessions_that_swallow_their_cancel)
    group = PromptGroup.model_validate_json(_group())
    await worker._slots.acquire()  # as take() does before it starts a group
    task = worker._spawn(state, group.uid, worker._run_logged(state, group, "a", None))
    await asyncio.sleep(0)
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    assert task.cancelled()  # ended at its next write, well inside the revocation's drain
    assert worker.turn_log.events == [first]


async def test_the_session_deadline_lets_a_revocation_through_as_the_loop_finishes():
    """The race Python 3.11's wait_for loses: the agent loop finishes and the group's task is
    cancelled in the same step. The cancel must reach the task at its next await at the
    latest; with wait_for it was dropped and the session went on."""
    finish = asyncio.Event()
    reached: list[str] = []

    async def agent_loop() -> list:
        await finish.wait()
        return []

    async def session() -> None:
        await _within_deadline(agent_loop(), 60.0)
        reached.append("after the loop")
        await asyncio.sleep(0)
        reached.append("went on")

    task = asyncio.ensure_future(session())
    await asyncio.sleep(0)
    finish.set()
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "went on" not in reached
