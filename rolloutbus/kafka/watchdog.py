"""Calls into librdkafka that may never return, run on a helper thread and given up on.

librdkafka can block a call far past its own timeout after a broker restart (a transactional
``send_offsets_to_transaction``: confluentinc/librdkafka#5456; a CI run's stack dump
found the replay buffer in a ``poll`` of its released-topic read after eight silent
minutes). A
thread inside librdkafka cannot be interrupted, so the caller stops waiting for it instead:
``run_watched`` runs the call on a daemon thread and raises :class:`NoAnswer`, with the
thread's Python stack, once the call has shown no progress for the limit. The abandoned
call keeps its own clients; the caller makes new ones and never touches those again.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

EXIT_STALLED = 75  # EX_TEMPFAIL: a main loop stalled; starting the process again is the cure
WATCH_EVERY_S = 5.0  # seconds between a MainLoopWatch's looks at its loop's progress


class NoAnswer(Exception):
    """A watched call showed no progress for its limit; it is left on its thread."""

    def __init__(self, action: str, limit_s: float, stack: str):
        super().__init__(f"{action}: no answer within {limit_s:g} s")
        self.action = action
        self.limit_s = limit_s
        self.stack = stack  # where the abandoned thread was, for the log


class Progress:
    """What a watched call beats each time it gets something back (a record, a stage
    done), so a long read that keeps moving is not taken for a hung one. A beat is also
    one of ``parent`` (the main loop's, for :class:`MainLoopWatch`)."""

    def __init__(self, parent: Progress | None = None) -> None:
        self.at = time.monotonic()
        self.parent = parent

    def beat(self) -> None:
        self.at = time.monotonic()
        if self.parent is not None:
            self.parent.beat()


def run_watched(
    call: Callable[[], T],
    limit_s: float,
    action: str,
    *,
    thread_name: str,
    progress: Progress | None = None,
) -> T:
    """``call()`` on a daemon thread: its result, or its exception re-raised here; NoAnswer
    once it has gone ``limit_s`` seconds without returning or beating ``progress``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # re-raised on the caller's thread below
            box["error"] = exc

    progress = progress or Progress()
    helper = threading.Thread(target=run, name=thread_name, daemon=True)
    helper.start()
    while True:
        helper.join(max(0.0, progress.at + limit_s - time.monotonic()))
        if not helper.is_alive():
            break
        if time.monotonic() - progress.at >= limit_s:
            raise NoAnswer(action, limit_s, _stack_of(helper))
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("result")  # type: ignore[return-value]


class MainLoopWatch:
    """Ends a process whose main loop has not beaten ``progress`` for ``limit_s``: a call
    into librdkafka that never returns (and no run_watched around it) would otherwise
    leave a worker alive, owning its partitions and releasing nothing, without a line.
    The watch logs the main thread's stack and exits with EXIT_STALLED; the supervisor
    (``rolloutbus run``, or any service manager) starts it again and it recovers from its
    committed offsets. ``limit_s`` must exceed the longest wait the loop bounds itself.
    ``exit_process=None`` (a loop on another thread than the process's: a test, a program
    embedding it) logs the stack and exits nothing."""

    def __init__(
        self,
        progress: Progress,
        limit_s: float,
        what: str,
        *,
        log: logging.Logger,
        exit_process: Callable[[int], object] | None = os._exit,
    ):
        self.progress, self.limit_s, self.what = progress, limit_s, what
        self._log, self._exit = log, exit_process
        self._loop_thread = threading.current_thread()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="main-loop-watch", daemon=True)

    def start(self) -> MainLoopWatch:
        self.progress.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def __enter__(self) -> MainLoopWatch:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stopped.wait(min(WATCH_EVERY_S, self.limit_s / 4)):
            silent_s = time.monotonic() - self.progress.at
            if silent_s >= self.limit_s:
                then = f"exiting with {EXIT_STALLED} to be started again" if self._exit else "left"
                self._log.critical(
                    "%s: no progress for %.0f s (limit %g s); %s. Its thread is at:\n%s",
                    self.what,
                    silent_s,
                    self.limit_s,
                    then,
                    _stack_of(self._loop_thread).rstrip(),
                )
                if self._exit is not None:
                    self._exit(EXIT_STALLED)
                return


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(ended)\n"


__all__ = ["EXIT_STALLED", "MainLoopWatch", "NoAnswer", "Progress", "run_watched"]
