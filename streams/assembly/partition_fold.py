"""Per-partition fold state of the replay buffer (pure: offsets and events in, released
groups out).

Each prompt group is tracked from its first event; a session settles on the first
attempt that reaches a terminal event; a group is released when its sessions
``0..n-1`` all settled. ``low_watermark`` is the offset to commit: the first event of the
oldest open group, so a restart re-reads everything an open group needs. Released uids
are remembered (``released``): every later event of such a group — a duplicate, a
superseded attempt, a re-run — is ignored. The replay buffer seeds ``released`` from the
released-groups topic, so the memory survives restarts (``replay_buffer.py``).

A group may also be released *early*, its unsettled sessions as failed records:

* **deadline**: when an event's ``ts`` is more than ``group_deadline_s`` after the group's
  first ``ts``. Time is the log's own (event timestamps written by the session workers),
  never this process's clock, and each decision depends on the event being folded alone,
  so a fold started at the low watermark (a restart) and one started earlier (the
  offline replay) release the same groups with the same records. A partition that receives
  no events keeps its open groups open: there is no new time to compare.
* **too many open groups**: past ``max_open_groups`` on the partition, the oldest.
* **head missing**: events of a group whose ``group_started`` is not in the folded range
  (retention deleted it below the watermark) form a headless group; ``n`` and the row are
  unknown, so when one of the two bounds above releases it, every session it saw is
  released as failed, with a synthesized ``group_started`` (``n`` = sessions seen).

A ``group_started`` with ``n`` over ``max_n`` is *rejected*: remembered as released with no
trajectories, for the caller to dead-letter (no worker runs such a group).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rolloutbus.config import Config
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.turns import GroupStarted, SessionFailed, SessionFinished
from rolloutbus.streams.assembly.session_fold import SessionFold

# why a group was released: its n sessions settled; its n was over limits.max_n (no
# trajectories); it passed deadlines.group_s; it was the oldest past max_open_groups; or its
# group_started is not in the log (then one of the two bounds released it)
RELEASE_KINDS = ("completed", "rejected", "deadline", "too_many_open_groups", "head_missing")
MAX_UID_CHARS = 512  # a uid is in every key and record of its group; a longer one is poison
DEADLINE_HEAP_SLACK = 1024  # stale deadline entries tolerated before the heap is rebuilt
RELEASED_MEMORY = 100_000  # uids per partition when no limit is given (FoldLimits default)


@dataclass(frozen=True)
class FoldLimits:
    """The bounds of one partition's fold; None switches a bound off. The replay buffer and
    the offline replay take them from the same config, so they release the same groups."""

    group_deadline_s: float | None = None  # seconds of log time (event ts) a group may stay open
    max_open_groups: int | None = None  # open groups per partition
    max_released: int = RELEASED_MEMORY  # released uids remembered per partition
    max_n: int | None = None  # sessions per group

    @classmethod
    def from_config(cls, cfg: Config) -> FoldLimits:
        return cls(
            group_deadline_s=cfg.deadlines.group_s,
            max_open_groups=cfg.replay_buffer.max_open_groups,
            max_released=cfg.replay_buffer.max_released_uids,
            max_n=cfg.limits.max_n,
        )


@dataclass
class OpenGroup:
    uid: str
    first_offset: int
    started: GroupStarted | None = None
    attempts: dict[tuple[int, str], SessionFold] = field(default_factory=dict)
    settled: dict[int, SessionFold] = field(default_factory=dict)
    first_ts: float | None = None  # ts of its first event with a finite ts

    @property
    def complete(self) -> bool:
        # asked after every event: the count first, the ids only once it could be complete
        return (
            self.started is not None
            and len(self.settled) >= self.started.n
            and all(i in self.settled for i in range(self.started.n))
        )

    def session_ids(self) -> set[int]:
        """The sessions of the group: 0..n-1, or, with no ``group_started``, those seen."""
        if self.started is not None:
            return set(range(self.started.n))
        return set(self.settled) | {sid for sid, _ in self.attempts}


@dataclass
class ReleasedGroup:
    """A group to release: its ``group_started`` and one fold per session, by session id.

    ``failed`` names the sessions released as failed records whatever their fold holds
    (an early release: the reason). ``reason`` says why the group was released early or
    rejected; None for a group whose n sessions settled. ``kind`` is one of
    ``RELEASE_KINDS``.
    """

    group: GroupStarted
    sessions: list[SessionFold]
    failed: dict[int, str] = field(default_factory=dict)
    reason: str | None = None
    kind: str = "completed"
    first_offset: int = -1  # turn-log offsets: the group's first event ...
    last_offset: int = -1  # ... and the event that released it

    @property
    def rejected(self) -> bool:
        return self.kind == "rejected"


class PartitionFold:
    """The open groups of one turn-log partition and the uids already released there.

    ``traj_next_offset`` is accepted and ignored (it was where a restart rescanned the
    trajectory topic, before the released-groups topic).
    """

    def __init__(
        self,
        next_offset: int = 0,
        traj_next_offset: int = 0,
        released: Iterable[str] | None = None,
        *,
        limits: FoldLimits | None = None,
    ):
        self.next_offset = next_offset
        self.limits = limits or FoldLimits()
        self.open: dict[str, OpenGroup] = {}  # insertion order: oldest first
        self.released: OrderedDict[str, None] = OrderedDict()
        self.ignored = 0  # events of released groups, duplicates, superseded attempts
        # uid of the headless group the last fold() opened (its first event is not a
        # group_started), else None: the replay buffer dead-letters that event at once, so
        # the missing head is seen before the group is released at a bound
        self.opened_headless: str | None = None
        self.forgotten = 0  # released uids dropped from memory past limits.max_released
        self._deadlines: list[tuple[float, int, str]] = []  # (first_ts, first_offset, uid)
        for uid in released or ():
            self.mark_released(uid)

    # -- folding -------------------------------------------------------------------------
    def apply(self, offset: int, event: Any) -> ReleasedGroup | None:
        """Fold one event; the group it released, if any. Without deadline or open-group
        bounds (the default limits) an event releases at most one group; with them, use
        :meth:`fold`."""
        released = self.fold(offset, event)
        if len(released) > 1:
            raise SchemaError(
                f"event at offset {offset} released {len(released)} groups: "
                "a fold with bounds must be read with fold(), not apply()"
            )
        return released[0] if released else None

    def fold(self, offset: int, event: Any) -> list[ReleasedGroup]:
        """Fold one event at ``offset``; every group released by it, in a fixed order: the
        group it completed, then groups past the open-group bound, then past the deadline.

        Raises SchemaError, before changing anything but ``next_offset``, for an event that
        no group can take (an unusable uid): the caller dead-letters it.
        """
        self.next_offset = offset + 1
        self.opened_headless = None
        check_event_uid(event.uid)
        out: list[ReleasedGroup] = []
        if event.uid in self.released:
            self.ignored += 1
        else:
            group = self.open.get(event.uid)
            if group is None:
                group = self.open[event.uid] = OpenGroup(event.uid, offset)
                if not isinstance(event, GroupStarted):
                    self.opened_headless = event.uid
                out.extend(self._release_over_open_limit(offset))
            self._note_ts(group, event.ts)
            released = self._apply(group, offset, event)
            if released is not None:
                out.insert(0, released)
        out.extend(self._release_past_deadline(offset, event.ts))
        return out

    def _apply(self, group: OpenGroup, offset: int, event: Any) -> ReleasedGroup | None:
        if isinstance(event, GroupStarted):
            return self._apply_group_started(group, offset, event)
        sid = event.session_id
        if sid in group.settled or not self._takes_session(group, sid):
            self.ignored += 1  # a session that settled already, or one outside the group
            return None
        key = (sid, event.attempt)
        fold = group.attempts.get(key)
        if fold is None:
            fold = group.attempts[key] = SessionFold(sid, event.attempt)
        if not fold.apply(event):
            self.ignored += 1
        if isinstance(fold.terminal, SessionFinished | SessionFailed):
            group.settled[sid] = fold  # the first attempt to reach a terminal event wins
            for other in [k for k in group.attempts if k[0] == sid]:
                del group.attempts[other]
        return self._release_if_complete(group, offset)

    def _apply_group_started(
        self, group: OpenGroup, offset: int, event: GroupStarted
    ) -> ReleasedGroup | None:
        if group.started is not None:
            self.ignored += 1  # a duplicate, or a re-run's group_started: the first one holds
            return None
        max_n = self.limits.max_n
        if max_n is not None and event.n > max_n:
            self._close(group)
            return ReleasedGroup(
                event,
                [],
                reason=(
                    f"group {event.uid} asks for n = {event.n} sessions, over limits.max_n = "
                    f"{max_n}: "
                    "rejected, no trajectories"
                ),
                kind="rejected",
                first_offset=group.first_offset,
                last_offset=offset,
            )
        group.started = event
        return self._release_if_complete(group, offset)

    def _takes_session(self, group: OpenGroup, sid: int) -> bool:
        if group.started is not None:
            return sid < group.started.n
        # a headless group: sessions seen so far, at most max_n of them
        max_n = self.limits.max_n
        return max_n is None or sid in group.session_ids() or len(group.session_ids()) < max_n

    def _release_if_complete(self, group: OpenGroup, offset: int) -> ReleasedGroup | None:
        if not group.complete:
            return None
        assert group.started is not None
        self._close(group)
        sessions = [group.settled[i] for i in range(group.started.n)]
        return ReleasedGroup(
            group.started, sessions, first_offset=group.first_offset, last_offset=offset
        )

    # -- early release -------------------------------------------------------------------
    def _note_ts(self, group: OpenGroup, ts: float) -> None:
        if (
            group.first_ts is None
            and math.isfinite(ts)
            and self.limits.group_deadline_s is not None
        ):
            group.first_ts = ts
            heapq.heappush(self._deadlines, (ts, group.first_offset, group.uid))

    def _release_past_deadline(self, offset: int, ts: float) -> list[ReleasedGroup]:
        deadline_s = self.limits.group_deadline_s
        if deadline_s is None or not math.isfinite(ts):
            return []
        out = []
        while self._deadlines and self._deadlines[0][0] < ts - deadline_s:
            first_ts, first_offset, uid = heapq.heappop(self._deadlines)
            group = self.open.get(uid)
            if group is None or group.first_offset != first_offset:
                continue  # released meanwhile
            out.append(
                self._release_early(
                    group,
                    offset,
                    "deadline",
                    (
                        f"group open longer than deadlines.group_s = {deadline_s:g} s of log time: "
                        f"its first event has ts {first_ts:.3f}, the event at offset {offset} "
                        f"has ts {ts:.3f}"
                    ),
                )
            )
        return out

    def _release_over_open_limit(self, offset: int) -> list[ReleasedGroup]:
        limit = self.limits.max_open_groups
        out = []
        while limit is not None and len(self.open) > limit:
            oldest = next(iter(self.open.values()))
            out.append(
                self._release_early(
                    oldest,
                    offset,
                    "too_many_open_groups",
                    (
                        "too many open groups on this partition (replay_buffer.max_open_groups "
                        f"= {limit}): "
                        f"the oldest, opened at offset {oldest.first_offset}, is released "
                        "unfinished"
                    ),
                )
            )
        return out

    def _release_early(
        self, group: OpenGroup, offset: int, kind: str, reason: str
    ) -> ReleasedGroup:
        self._close(group)
        head_missing = group.started is None
        sids = sorted(group.session_ids())
        if head_missing:
            reason = (
                f"group_started of {group.uid} is not in the turn log (deleted by retention, "
                f"or read from after it), so its sessions are released as failed; {reason}"
            )
            head = GroupStarted(
                uid=group.uid,
                attempt="",
                n=max(1, len(sids)),
                row={},
                ts=group.first_ts if group.first_ts is not None else 0.0,
            )
        else:
            assert group.started is not None
            head = group.started
        sessions, failed = [], {}
        for sid in sids:
            fold = group.settled.get(sid)
            if fold is None or head_missing:
                fold = fold or self._latest_attempt(group, sid)
                failed[sid] = reason
            sessions.append(fold)
        return ReleasedGroup(
            head,
            sessions,
            failed=failed,
            reason=reason,
            kind="head_missing" if head_missing else kind,
            first_offset=group.first_offset,
            last_offset=offset,
        )

    @staticmethod
    def _latest_attempt(group: OpenGroup, sid: int) -> SessionFold:
        attempts = [fold for (s, _), fold in group.attempts.items() if s == sid]
        return attempts[-1] if attempts else SessionFold(sid, "")

    # -- memory --------------------------------------------------------------------------
    def _close(self, group: OpenGroup) -> None:
        del self.open[group.uid]
        self.mark_released(group.uid)
        if len(self._deadlines) > 2 * len(self.open) + DEADLINE_HEAP_SLACK:
            # entries of closed groups are dropped lazily; rebuild before they pile up
            self._deadlines = [
                (ts, first, uid)
                for ts, first, uid in self._deadlines
                if (g := self.open.get(uid)) is not None and g.first_offset == first
            ]
            heapq.heapify(self._deadlines)

    def mark_released(self, uid: str) -> None:
        self.released[uid] = None
        self.released.move_to_end(uid)
        while len(self.released) > self.limits.max_released:
            self.released.popitem(last=False)
            self.forgotten += 1

    def low_watermark(self) -> int:
        return min((g.first_offset for g in self.open.values()), default=self.next_offset)


def check_event_uid(uid: str) -> str:
    """A uid the fold can key records by: non-empty, at most MAX_UID_CHARS characters.

    A ``_`` is allowed: the uid is taken from event values, never parsed out of a key.
    """
    if not uid or len(uid) > MAX_UID_CHARS:
        raise SchemaError(f"uid of {len(uid)} characters: a uid must have 1..{MAX_UID_CHARS}")
    return uid
