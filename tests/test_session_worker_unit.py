"""The session worker's own decisions, without Faust or a broker (pure, with small stand-ins
for Faust's event and the turn-log writer — test doubles, named as such below).

What these pin: a prompt is never acknowledged (``take`` never returns) when its
``group_started`` could not be written, and a group whose sessions cannot be logged ends the
process rather than leaving the group open forever.
"""

from __future__ import annotations

import asyncio
from collections import namedtuple
from types import SimpleNamespace

import pytest

from rolloutbus.config import Config
from rolloutbus.errors import BrokerError
from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup
from rolloutbus.streams.sessions import worker as worker_module
from rolloutbus.streams.sessions.runner import SessionContext
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
    return worker


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
    with pytest.raises(Exited):
        await worker._run_logged(group, "a0", None)
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
    monkeypatch.setattr(worker, "_spawn", lambda state, coro: (started.append(coro), coro.close()))
    waiting = asyncio.ensure_future(worker.take(_event(_group())))
    await asyncio.sleep(0)
    assert [e.type for e in worker.turn_log.events] == ["group_started"]
    await worker.on_revoked({TP(worker.topics.prompts, 0)})
    worker.turn_log.done.set()
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
