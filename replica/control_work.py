"""Work the decode loop runs between two steps, never during a forward pass (a weight reload).

Queued from any thread while holding the engine's condition; run in the decode thread;
each piece of work has a future that says how it went. Work whose caller went away before
it started is skipped: nothing was changed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["ControlWork"]

Work = Callable[[], None]


class ControlWork:
    """A queue of work for the decode thread: ``submit``, ``__bool__`` and ``drain`` under
    the engine's condition, ``run_pending`` from the decode thread."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Work, concurrent.futures.Future[None]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def submit(self, work: Work) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.append((work, future))
        return future

    def run_pending(self, cond: threading.Condition) -> None:
        """Run every queued work in turn (the decode thread, between steps): each is taken
        under ``cond`` and run outside it, its future settled."""
        while True:
            with cond:
                if not self._queue:
                    return
                work, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started: nothing was changed
            try:
                work()
            except Exception as exc:  # reported to the caller that asked for the work
                future.set_exception(exc)
            else:
                future.set_result(None)

    def drain(self) -> list[concurrent.futures.Future[None]]:
        """Every queued work's future, the queue emptied (under the condition)."""
        futures = [future for _, future in self._queue]
        self._queue.clear()
        return futures
