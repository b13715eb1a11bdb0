"""What a session worker learns from the turn log when it gains a partition (pure).

The turn log is the source of truth for sessions: a group whose ``group_started`` is in
``rollout.turns`` belongs to the log, whatever happened to the worker that started it. A
worker that gains a partition folds that partition's turn log from the first event of the
oldest group not yet released and gets, per group that started and did not finish, the
sessions still to run and, for each, the logged events of the attempt to resume. Sessions
are resumed by replaying those events into the agent loop (``streams/sessions/resume.py``),
so no token is sampled twice.

Memory is bounded by the groups still open in the scanned range: a group is dropped from
the scan as soon as every one of its sessions reached a terminal event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutbus.schemas.turns import (
    GroupStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
)


@dataclass
class LoggedAttempt:
    """The events of one attempt of one session, in log order, without duplicates."""

    session_id: int
    attempt: str
    agent_name: str | None
    events: list[Any] = field(default_factory=list)  # after session_started
    next_seq: int = 1  # session_started is seq 0
    # the attempt this one resumed (its session_started's resumed_from), if in the scan
    predecessor: LoggedAttempt | None = None

    def add(self, event: Any) -> None:
        if event.seq < self.next_seq:
            return  # a duplicate write of an event already folded
        self.events.append(event)
        self.next_seq = event.seq + 1

    def history(self) -> list[Any]:
        """Everything this session logged along its chain of attempts, to replay on resume.

        A resumed attempt re-logs its predecessor's events one for one, in order, before it
        logs anything new (``recorder.py``). An attempt stopped part way through that replay
        (its worker killed or its partition revoked) logged only a prefix of them: the rest
        stays in the predecessor's events, and resuming from this attempt's own events alone
        would sample those logged turns again.
        """
        if self.predecessor is None:
            return self.events
        inherited = self.predecessor.history()
        return self.events + inherited[len(self.events) :]


@dataclass
class UnfinishedGroup:
    group: GroupStarted
    first_offset: int
    # session id -> the attempt to resume (the latest one started; its history() is what to
    # replay), or None: never started
    sessions: dict[int, LoggedAttempt | None]


@dataclass
class _ScanGroup:
    started: GroupStarted | None
    first_offset: int
    settled: set[int] = field(default_factory=set)
    latest: dict[int, LoggedAttempt] = field(default_factory=dict)
    attempts: dict[tuple[int, str], LoggedAttempt] = field(default_factory=dict)

    def finished(self) -> bool:
        return self.started is not None and len(self.settled) >= self.started.n


class TurnLogScan:
    """Fold one partition of rollout.turns into the groups that still need a worker."""

    def __init__(self) -> None:
        self._groups: dict[str, _ScanGroup] = {}
        self.started_uids: set[str] = set()  # every group started in the scanned range
        self.events = 0

    def apply(self, offset: int, event: Any) -> None:
        self.events += 1
        group = self._groups.get(event.uid)
        if group is None:
            if event.uid in self.started_uids:
                return  # a late event of a group that already finished
            group = self._groups[event.uid] = _ScanGroup(None, offset)
        if isinstance(event, GroupStarted):
            group.started = group.started or event
            self.started_uids.add(event.uid)
        elif event.session_id not in group.settled:
            self._apply_session_event(group, event)
        if group.finished():
            del self._groups[event.uid]

    def _apply_session_event(self, group: _ScanGroup, event: Any) -> None:
        if isinstance(event, SessionFinished | SessionFailed):
            group.settled.add(event.session_id)
            group.latest.pop(event.session_id, None)
            return
        key = (event.session_id, event.attempt)
        if isinstance(event, SessionStarted):
            if key not in group.attempts:
                resumed = group.attempts.get((event.session_id, event.resumed_from or ""))
                attempt = LoggedAttempt(
                    event.session_id, event.attempt, event.agent_name, predecessor=resumed
                )
                group.attempts[key] = group.latest[event.session_id] = attempt
            return
        logged = group.attempts.get(key)
        if logged is not None:
            logged.add(event)

    def unfinished(self) -> list[UnfinishedGroup]:
        """Groups started in the scanned range whose sessions did not all settle, oldest first.

        A group whose ``group_started`` lies before the scanned range is not returned: the
        scan starts at the oldest group the replay buffer has not released, so such a group
        was released, and every one of its sessions settled.
        """
        out = []
        for g in sorted(self._groups.values(), key=lambda g: g.first_offset):
            if g.started is None:
                continue
            sessions = {
                sid: g.latest.get(sid) for sid in range(g.started.n) if sid not in g.settled
            }
            out.append(UnfinishedGroup(g.started, g.first_offset, sessions))
        return out
