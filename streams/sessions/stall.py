"""Sessions that make no progress, named with what they wait on (a silent hang made loud).

Every group a worker holds and every session it runs has an entry: what it waits on now
("a free group slot", "the replica's answer to turn 2", "the agent loop after turn 1"),
and since when. Any event the session logs, and any step the worker takes for the group,
is progress and renews the entry. An entry older than ``sessions.stall_warn_s`` is
logged once per stall with its key and what it waits on, and counted
(``rolloutbus_sessions_stalls_total``; ``rolloutbus_sessions_stalled`` is how many are
stalled now). It only reports: a session is ended by its own deadlines
(``deadlines.session_s``, ``replicas.request_timeout_s``), never by this watch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutbus.streams.sessions.metrics import SessionMetrics

log = logging.getLogger(__name__)

# seconds between checks, at most: a stall is reported within this much of stall_warn_s
CHECK_INTERVAL_MAX_S = 30.0


@dataclass
class Waiting:
    what: str
    since: float  # monotonic: the last progress
    stalled: bool = False  # reported already (once per stall)


@dataclass(frozen=True)
class Stall:
    key: str
    what: str
    seconds: float


def waits_on(event: Any) -> str:
    """What a session waits on after logging ``event`` (its last progress)."""
    kind = getattr(event, "type", "")
    if kind == "generation":
        return f"the agent loop after turn {event.turn} (a tool, the reward or the next request)"
    if kind in ("session_started", "segment_started", "observation"):
        return "the replica's answer to its next turn"
    if kind == "generation_chunk":
        return f"the replica's next chunk of turn {event.turn}"
    return f"the agent loop after {kind or 'an event'}"


class StallWatch:
    """Per group (uid), the entries of the group and its sessions; see the module docstring."""

    def __init__(
        self,
        warn_after_s: float,
        metrics: SessionMetrics,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.warn_after_s = warn_after_s
        self._metrics = metrics
        self._clock = clock
        self._groups: dict[str, dict[str, Waiting]] = {}
        self._stalled = 0  # entries reported and not moved since

    def waiting(self, uid: str, key: str, what: str) -> None:
        """Progress: ``key`` (the group's uid, or a session's key) now waits on ``what``."""
        entries = self._groups.setdefault(uid, {})
        previous = entries.get(key)
        if previous is not None and previous.stalled:
            log.info("%s moves again after %.0f s", key, self._clock() - previous.since)
            self._unstall(1)
        entries[key] = Waiting(what, self._clock())

    def settled(self, uid: str, key: str) -> None:
        """``key`` waits on nothing any more (a session reached its terminal event)."""
        entry = self._groups.get(uid, {}).pop(key, None)
        if entry is not None and entry.stalled:
            self._unstall(1)

    def forget_group(self, uid: str) -> None:
        """The group left this worker: done, stopped by a revocation, or never started."""
        entries = self._groups.pop(uid, {})
        self._unstall(sum(e.stalled for e in entries.values()))

    def check(self) -> list[Stall]:
        """Report every entry that became stalled since the last check."""
        now = self._clock()
        found = []
        for entries in self._groups.values():
            for key, entry in entries.items():
                if entry.stalled or now - entry.since < self.warn_after_s:
                    continue
                entry.stalled = True
                found.append(Stall(key, entry.what, now - entry.since))
        self._stalled += len(found)
        self._metrics.stalled.set(self._stalled)
        for stall in found:
            self._metrics.stalls.inc()
            log.warning(
                "%s has made no progress for %.0f s (sessions.stall_warn_s=%g): waiting on %s",
                stall.key,
                stall.seconds,
                self.warn_after_s,
                stall.what,
            )
        return found

    async def run(self) -> None:
        """Check until cancelled."""
        interval = min(self.warn_after_s / 2, CHECK_INTERVAL_MAX_S)
        while True:
            await asyncio.sleep(interval)
            self.check()

    def _unstall(self, entries: int) -> None:
        if entries:
            self._stalled -= entries
            self._metrics.stalled.set(self._stalled)


__all__ = ["Stall", "StallWatch", "waits_on"]
