"""run_watched: a call into a client library that may never return is given up on, with
its stack; a call that keeps answering is not. MainLoopWatch: a loop that stops beating
ends its process with its stack logged; one that keeps beating does not."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from rolloutbus.kafka.watchdog import (
    EXIT_STALLED,
    MainLoopWatch,
    NoAnswer,
    Progress,
    run_watched,
)


def test_the_result_and_the_error_of_a_call_come_back_to_the_caller():
    assert run_watched(lambda: 42, 5.0, "answering", thread_name="t") == 42

    def fails() -> None:
        raise KeyError("raised on the helper thread")

    with pytest.raises(KeyError, match="raised on the helper thread"):
        run_watched(fails, 5.0, "failing", thread_name="t")


def test_a_call_that_never_returns_is_left_with_its_stack():
    release = threading.Event()

    def blocks_like_a_poll() -> None:
        release.wait(60.0)

    try:
        with pytest.raises(NoAnswer, match="polling: no answer within 0.3 s") as caught:
            run_watched(blocks_like_a_poll, 0.3, "polling", thread_name="stuck-helper")
        assert "blocks_like_a_poll" in caught.value.stack
        [helper] = [t for t in threading.enumerate() if t.name == "stuck-helper"]
        assert helper.is_alive()  # left where it is, not killed
    finally:
        release.set()


def test_a_call_that_keeps_beating_runs_past_the_limit():
    progress = Progress()

    def slow_but_moving() -> str:
        for _ in range(12):
            time.sleep(0.25)
            progress.beat()
        return "done"

    # 3 s in all against a 2 s limit; every gap between beats is an eighth of it
    assert (
        run_watched(slow_but_moving, 2.0, "reading", thread_name="t", progress=progress) == "done"
    )


def _loop(progress: Progress, beats: int, then_block: threading.Event | None) -> None:
    """A main loop (a test double of the replay buffer's): ``beats`` steps of 0.1 s, then,
    given ``then_block``, a call that does not return until it is set."""
    for _ in range(beats):
        progress.beat()
        time.sleep(0.1)
    if then_block is not None:
        then_block.wait(30.0)


def _watched_loop(beats: int, block: bool, exit_process, caplog) -> threading.Event:
    release, progress = threading.Event(), Progress()
    log = logging.getLogger("test.main_loop")

    def main() -> None:
        watch = MainLoopWatch(progress, 0.5, "test loop", log=log, exit_process=exit_process)
        watch.start()
        try:
            _loop(progress, beats, release if block else None)
        finally:
            watch.stop()

    with caplog.at_level(logging.CRITICAL, logger=log.name):
        loop = threading.Thread(target=main, name="test-loop")
        loop.start()
        loop.join(3.0 + beats * 0.1)
    release.set()
    loop.join()
    return release


def test_a_main_loop_that_stops_beating_ends_the_process_with_its_stack(caplog):
    exits: list[int] = []
    _watched_loop(beats=3, block=True, exit_process=exits.append, caplog=caplog)
    assert exits == [EXIT_STALLED]
    [line] = [r.getMessage() for r in caplog.records]
    assert "test loop: no progress for" in line and "exiting with 75" in line
    assert "_loop" in line and "then_block.wait" in line  # where the loop's thread was


def test_a_main_loop_that_keeps_beating_runs_on(caplog):
    """2 s of beats every 0.1 s against a 0.5 s limit."""
    exits: list[int] = []
    _watched_loop(beats=20, block=False, exit_process=exits.append, caplog=caplog)
    assert exits == [] and caplog.records == []


def test_a_loop_off_the_main_thread_is_logged_not_ended(caplog):
    _watched_loop(beats=1, block=True, exit_process=None, caplog=caplog)
    [line] = [r.getMessage() for r in caplog.records]
    assert "no progress for" in line and "; left." in line
