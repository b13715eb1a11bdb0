"""Per-partition fold state of the replay buffer (pure: offsets in, released groups out).

Each prompt group is tracked from its first event; a session settles on the first
attempt that reaches a terminal event; a group is released when all n sessions settled.
``low_watermark`` is the offset to commit: the first event of the oldest open group, so
a restart re-reads everything an open group needs. Groups released after that point are
remembered in ``released`` and rebuilt on restart from the trajectory topic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rolloutbus.schemas.turns import GroupStarted, SessionFailed, SessionFinished
from rolloutbus.streams.assembly.session_fold import SessionFold

RELEASED_MEMORY = 100_000  # uids; groups re-run after this many later releases are not caught


@dataclass
class OpenGroup:
    uid: str
    first_offset: int
    scan_from: int  # trajectory-partition offset when the group opened
    started: GroupStarted | None = None
    attempts: dict[tuple[int, str], SessionFold] = field(default_factory=dict)
    settled: dict[int, SessionFold] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.started is not None and len(self.settled) >= self.started.n


@dataclass
class ReleasedGroup:
    group: GroupStarted
    sessions: list[SessionFold]


class PartitionFold:
    def __init__(self, next_offset: int, traj_next_offset: int, released: set[str] | None = None):
        self.next_offset = next_offset
        self.traj_next_offset = traj_next_offset
        self.open: dict[str, OpenGroup] = {}
        self.released: OrderedDict[str, None] = OrderedDict((u, None) for u in released or ())
        self.ignored = 0

    def apply(self, offset: int, event: Any) -> ReleasedGroup | None:
        """Fold one event at ``offset``; returns the group it completed, if any."""
        self.next_offset = offset + 1
        uid = event.uid
        if uid in self.released:
            self.ignored += 1
            return None
        group = self.open.get(uid)
        if group is None:
            group = self.open[uid] = OpenGroup(uid, offset, self.traj_next_offset)
        if isinstance(event, GroupStarted):
            group.started = group.started or event
            return self._release_if_complete(group)
        if event.session_id in group.settled:
            self.ignored += 1  # a later attempt of a session that already settled
            return None
        fold = group.attempts.setdefault(
            (event.session_id, event.attempt), SessionFold(event.session_id, event.attempt))
        fold.apply(event)
        if isinstance(event, SessionFinished | SessionFailed):
            group.settled[event.session_id] = fold
            for key in [k for k in group.attempts if k[0] == event.session_id]:
                del group.attempts[key]
        return self._release_if_complete(group)

    def _release_if_complete(self, group: OpenGroup) -> ReleasedGroup | None:
        if not group.complete:
            return None
        assert group.started is not None
        del self.open[group.uid]
        self.mark_released(group.uid)
        sessions = [group.settled[i] for i in sorted(group.settled)][: group.started.n]
        return ReleasedGroup(group.started, sessions)

    def mark_released(self, uid: str) -> None:
        self.released[uid] = None
        while len(self.released) > RELEASED_MEMORY:
            self.released.popitem(last=False)

    def low_watermark(self) -> int:
        return min((g.first_offset for g in self.open.values()), default=self.next_offset)

    def scan_from(self) -> int:
        return min((g.scan_from for g in self.open.values()), default=self.traj_next_offset)
