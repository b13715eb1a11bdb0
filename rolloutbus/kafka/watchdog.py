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

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class NoAnswer(Exception):
    """A watched call showed no progress for its limit; it is left on its thread."""

    def __init__(self, action: str, limit_s: float, stack: str):
        super().__init__(f"{action}: no answer within {limit_s:g} s")
        self.action = action
        self.limit_s = limit_s
        self.stack = stack  # where the abandoned thread was, for the log


class Progress:
    """What a watched call beats each time it gets something back (a record, a stage
    done), so a long read that keeps moving is not taken for a hung one."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def beat(self) -> None:
        self.at = time.monotonic()


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


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(ended)\n"


__all__ = ["NoAnswer", "Progress", "run_watched"]
