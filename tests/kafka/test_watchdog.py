"""run_watched: a call into a client library that may never return is given up on, with
its stack; a call that keeps answering is not."""

from __future__ import annotations

import threading
import time

import pytest

from rolloutbus.kafka.watchdog import NoAnswer, Progress, run_watched


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
