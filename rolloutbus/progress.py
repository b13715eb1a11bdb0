"""One progress line at a steady interval from a long-running process, so a terminal shows
that work moves without Prometheus: what was done since the last line, with rates, and what
is open now. An idle process writes one line saying so, then nothing until work comes.

    replay buffer: 12 groups (0.20/s), 48 trajectories (0.80/s), 1204 turn events
    (20.07/s) in the last 60 s; 3 open groups
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ProgressLine"]


class ProgressLine:
    def __init__(
        self,
        name: str,
        interval_s: float,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``interval_s`` 0: never log."""
        self.name = name
        self.interval_s = interval_s
        self._log = logger
        self._clock = clock
        self._since = clock()
        self._counts: dict[str, int] = {}
        self._idle_said = False

    def add(self, what: str, n: int = 1) -> None:
        """Count ``n`` more of ``what`` (e.g. "groups"); the first add fixes the order."""
        self._counts[what] = self._counts.get(what, 0) + n

    def due(self) -> bool:
        """Whether the next maybe_log writes a line: a caller on a hot path asks first, and
        computes its open figures only then."""
        return self.interval_s > 0 and self._clock() - self._since >= self.interval_s

    def maybe_log(self, open_now: dict[str, int] | None = None) -> str | None:
        """Log (and return) the line when the interval has passed; ``open_now``: figures of
        the present (e.g. {"open groups": 3}), shown when non-zero."""
        now = self._clock()
        elapsed = now - self._since
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return None
        moved = {what: n for what, n in self._counts.items() if n}
        held = {what: n for what, n in (open_now or {}).items() if n}
        self._since, self._counts = now, dict.fromkeys(self._counts, 0)
        if not moved and not held:
            if self._idle_said:
                return None
            self._idle_said = True
            line = f"{self.name}: idle (nothing done in the last {elapsed:.0f} s, nothing open)"
        else:
            self._idle_said = False
            line = f"{self.name}: {_done(moved, elapsed)}{_open(held)}"
        self._log.info("%s", line)
        return line


def _done(moved: dict[str, int], elapsed: float) -> str:
    if not moved:
        return f"nothing done in the last {elapsed:.0f} s"
    parts = [f"{n} {what} ({n / elapsed:.2f}/s)" for what, n in moved.items()]
    return f"{', '.join(parts)} in the last {elapsed:.0f} s"


def _open(held: dict[str, int]) -> str:
    return "; " + ", ".join(f"{n} {what}" for what, n in held.items()) if held else ""
