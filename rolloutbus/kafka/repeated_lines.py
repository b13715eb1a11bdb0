"""librdkafka's repeated log lines, one per window: a client that cannot reach its broker
logs "Connect to ... failed: Connection refused" every 50-80 ms (its reconnect backoff does
not grow for a bootstrap broker it never reached), so a 30 s broker restart wrote about 490
such lines per client and buried every other line of the replay buffer's log (a CI run's
tail held nothing else).

``RepeatedLines`` is a logging filter: the first WARNING-or-worse line of its kind from one
client passes, the same kind from that client is counted and held back for
``REPEAT_WINDOW_S``, and the next one after the window passes saying how many were held
back. Lines below WARNING (shown only with -v) all pass: whoever asks for them wants them.

The CLI puts one on its log handler too, for aiokafka (Faust's Kafka client), which floods
the same way: "Unable connect to node", "Unable to update metadata", 3,600 lines of a
session worker's log in the same row (``rolloutbus/cli/console.py``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["REPEAT_WINDOW_S", "RepeatedLines"]

REPEAT_WINDOW_S = 30.0  # seconds one kind of line from one client is shown at most once
_MAX_KINDS = 512  # kinds remembered before the ones outside their window are forgotten
_NUMBER = re.compile(r"\d+")  # "after 0ms", ports, counters: the same kind of line


@dataclass
class _Shown:
    at: float  # when this kind was last shown
    held: int = 0  # lines of this kind held back since


class RepeatedLines(logging.Filter):
    """Holds back repeats of one client's WARNING+ line within ``window_s`` (see the module
    docstring). Thread-safe: confluent-kafka logs from whichever thread polls a client."""

    def __init__(
        self,
        window_s: float = REPEAT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        *,
        loggers: tuple[str, ...] | None = None,
    ):
        super().__init__()
        self.window_s, self._clock = window_s, clock
        # on a handler: only these loggers' lines (and their children's) are held back
        self._loggers = loggers
        self._shown: dict[tuple[str, ...], _Shown] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not self._applies_to(record.name):
            return True
        kind = _kind(record)
        now = self._clock()
        with self._lock:
            shown = self._shown.get(kind)
            if shown is not None and now - shown.at < self.window_s:
                shown.held += 1
                return False
            self._forget_old(now)
            self._shown[kind] = _Shown(at=now)
        if shown is not None and shown.held:
            since = now - shown.at
            held = f"{shown.held} more like it in the last {since:.0f} s"
            record.msg, record.args = f"{record.getMessage()} ({held})", None
        return True

    def _applies_to(self, name: str) -> bool:
        if self._loggers is None:
            return True
        return any(name == lg or name.startswith(lg + ".") for lg in self._loggers)

    def _forget_old(self, now: float) -> None:
        if len(self._shown) < _MAX_KINDS:
            return
        for kind in [k for k, s in self._shown.items() if now - s.at >= self.window_s]:
            del self._shown[kind]


def _kind(record: logging.LogRecord) -> tuple[str, ...]:
    """confluent-kafka logs ``"%s [%s] %s"`` with (facility, client name, text): the kind is
    those with the text's numbers left out; another logger's line is its template."""
    args = _args(record)
    *head, text = (str(a) for a in args) if args else ("",)
    return (record.name, str(record.msg), *head, _NUMBER.sub("#", text))


def _args(record: logging.LogRecord) -> tuple[object, ...]:
    args = record.args
    if args is None:
        return ()
    return args if isinstance(args, tuple) else (args,)
