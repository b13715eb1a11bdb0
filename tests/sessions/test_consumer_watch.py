"""The session worker's consumer watch, without a broker: when a worker whose Faust
consumer stopped delivering is judged stalled, and when it is not (busy taking a prompt,
prompts owned by another worker, nothing waiting). The broker's answer is a test double
(``GroupLag`` values built here); ``test_consumer_watch_kafka.py`` runs the real thing."""

from __future__ import annotations

import asyncio
import time

import pytest

from rolloutbus.config import Config
from rolloutbus.kafka.consumer_lag import GroupLag, PartitionLag
from rolloutbus.streams.sessions.consumer_watch import ConsumerWatch, consumer_stalled

TOPIC = "x.prompts"


def _lag(waiting: dict[int, int], members: int = 1, partitions: int = 2) -> GroupLag:
    rows = [
        PartitionLag("sessions", TOPIC, p, 0, waiting.get(p, 0), waiting.get(p, 0), None)
        for p in range(partitions)
    ]
    return GroupLag("sessions", TOPIC, members, rows)


def test_prompts_waiting_on_an_owned_partition_are_a_stall_that_names_it():
    reason = consumer_stalled(_lag({1: 3}), owned={0, 1}, idle_s=130)
    assert reason is not None
    assert "3 prompt group(s) wait on x.prompts partition(s) [1]" in reason
    assert "130 s" in reason


def test_prompts_waiting_on_another_workers_partition_are_not_this_workers_stall():
    assert consumer_stalled(_lag({1: 3}, members=2), owned={0}, idle_s=500) is None


def test_a_group_without_a_live_member_while_prompts_wait_is_a_stall():
    reason = consumer_stalled(_lag({0: 2}, members=0), owned=set(), idle_s=200)
    assert reason is not None and "no live member" in reason and "'sessions'" in reason


def test_nothing_waiting_is_never_a_stall():
    assert consumer_stalled(_lag({}, members=0), owned={0, 1}, idle_s=10_000) is None


def _watch(stall_s: float, owned: set[int], lag: GroupLag | None) -> tuple[ConsumerWatch, list]:
    cfg = Config.model_validate({"sessions": {"consumer_stall_s": stall_s}})
    stalled: list[str] = []
    watch = ConsumerWatch(cfg, TOPIC, lambda: owned, stalled.append)
    watch._read_lag = lambda: lag  # test double for the broker's answer
    return watch, stalled


def test_a_prompt_in_hand_is_never_idle_however_long_it_waits():
    watch, _ = _watch(60, {0}, _lag({0: 1}))
    watch._last_progress = time.monotonic() - 1000
    with watch.taking():
        assert watch.idle_s() == 0.0
    assert watch.idle_s() < 1.0  # letting a prompt go is progress too


def test_a_rebalance_is_progress():
    watch, _ = _watch(60, {0}, _lag({0: 1}))
    watch._last_progress = time.monotonic() - 1000
    watch.progressed()
    assert watch.idle_s() < 1.0


async def test_run_reports_a_stalled_consumer_once_the_window_has_passed():
    watch, stalled = _watch(0.2, {0}, _lag({0: 4}))
    await asyncio.wait_for(watch.run(), timeout=5)
    assert len(stalled) == 1 and "partition(s) [0]" in stalled[0]


@pytest.mark.parametrize("lag", [None, _lag({})], ids=["broker silent", "nothing waiting"])
async def test_run_goes_on_watching_when_nothing_is_wrong(lag):
    watch, stalled = _watch(0.2, {0}, lag)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(watch.run(), timeout=1.0)
    assert stalled == []


async def test_run_does_not_report_a_worker_that_is_taking_a_prompt():
    watch, stalled = _watch(0.2, {0}, _lag({0: 4}))
    with watch.taking(), pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(watch.run(), timeout=1.0)
    assert stalled == []


async def test_a_broker_that_does_not_answer_starts_the_window_again():
    watch, _ = _watch(60, {0}, None)
    watch._last_progress = time.monotonic() - 1000
    assert await watch.check() is None
    assert watch.idle_s() < 1.0  # judged over a whole window once the broker is back
