"""The sessions a gateway serves: opened here as a prompt group of n, or resumed from the
turn log after a restart, and failed when idle.

Opening a group writes ``group_started`` (``driven_by: gateway``, so no session worker
resumes it) and one ``session_started`` per session, so the group belongs to the log at
once. A call for a session this process does not hold scans its partition of the turn log
from the replay buffer's committed offset, as a session worker does when it gains a
partition (``streams/sessions/recovery.py``): the session is resumed if its group started
there and the session did not settle; the scan's other unfinished gateway sessions are
kept as candidates, so the next session of the same restart needs no scan of its own.

One gateway serves a session at a time: the URLs a group's open returns point at the
gateway that opened it. Two gateways resuming the same session would each log an attempt
(the replay buffer folds the first to finish).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from rolloutbus.errors import AgentLoopError, SchemaError
from rolloutbus.schemas.prompts import DatasetRow, check_uid_text, group_sampling_params
from rolloutbus.schemas.turns import GroupStarted
from rolloutbus.streams.gateway.metrics import GatewayMetrics
from rolloutbus.streams.gateway.session import GatewayContext, GatewaySession, SessionClosedError
from rolloutbus.streams.gateway.wire import OpenSessionsRequest
from rolloutbus.streams.sessions.recovery import LoggedAttempt, TurnLogScan
from rolloutbus.streams.sessions.runner import group_settings, new_attempt_id
from rolloutbus.topics import KEY_SEPARATOR, partition_for, session_key

log = logging.getLogger(__name__)

CLOSED_MEMORY = 100_000  # settled session keys remembered (~100 bytes each) to answer 409
_PLACEHOLDER_PROMPT = [{"role": "user", "content": ""}]  # a row without a prompt, to check


class SessionNotFoundError(AgentLoopError):
    """No open gateway session has this id, here or in the turn log."""


class BadOpenRequestError(AgentLoopError, ValueError):
    """``POST /v1/sessions`` asked for a group the bus cannot log."""


Scan = Callable[[int], TurnLogScan]  # fold one partition of the turn log (blocking)
CurrentVersion = Callable[[], tuple[int, int]]  # (policy version, global step), blocking


class GatewaySessions:
    def __init__(self, ctx: GatewayContext, scan: Scan, current_version: CurrentVersion):
        self.ctx = ctx
        self._scan = scan
        self._current_version = current_version
        self.open: dict[str, GatewaySession] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # key -> finished | failed
        self._sizes: dict[str, int] = {}  # n of the groups opened here or seen in a scan
        # per partition: unfinished gateway sessions a scan found that no call resumed yet
        self._candidates: dict[int, dict[str, tuple[GroupStarted, LoggedAttempt | None]]] = {}
        self._scan_locks: dict[int, asyncio.Lock] = {}
        self.resumed = 0  # sessions resumed from the turn log

    # -- opening ---------------------------------------------------------------------------

    async def open_group(self, request: OpenSessionsRequest) -> list[GatewaySession]:
        """Log a new group of n sessions; returns its sessions, started."""
        started = await self._group_started(request)
        self._sizes[started.uid] = started.n
        await self.ctx.emit(started)
        sessions = [GatewaySession(self.ctx, started, sid) for sid in range(started.n)]
        for session in sessions:
            await session.begin()
            self.open[session.key] = session
        return sessions

    async def _group_started(self, request: OpenSessionsRequest) -> GroupStarted:
        cfg = self.ctx.config
        uid = request.uid or uuid.uuid4().hex[:16]
        try:
            check_uid_text(uid)
            DatasetRow.model_validate({"prompt": _PLACEHOLDER_PROMPT, **request.row})
        except ValueError as exc:
            raise BadOpenRequestError(f"cannot open a group: {exc}") from exc
        if uid in self._sizes:
            raise BadOpenRequestError(f"uid {uid!r} was opened before: a group's uid is unique")
        rollout = cfg.rollout
        n = request.n or (rollout.val_kwargs.n if request.validate_ else rollout.n)
        if n > cfg.limits.max_n:
            raise BadOpenRequestError(f"n={n} is over limits.max_n={cfg.limits.max_n}")
        version, step = request.policy_version, request.global_steps
        if version is None or step is None:
            current, current_step = await asyncio.to_thread(self._current_version)
            version = current if version is None else version
            step = current_step if step is None else step
        params = request.sampling_params or group_sampling_params(rollout, request.validate_)
        return GroupStarted(
            uid=uid,
            attempt=new_attempt_id(),
            n=n,
            row=dict(request.row),
            validate=request.validate_,
            global_steps=step,
            policy_version=version,
            sampling_params=params.model_dump(),
            settings=group_settings(cfg),
            driven_by="gateway",
        )

    # -- finding a session -----------------------------------------------------------------

    async def get(self, key: str) -> GatewaySession:
        """The open session ``key``: held here, or resumed from the turn log."""
        session = self.open.get(key)
        if session is not None:
            return session
        uid, session_id = parse_session_key(key)
        self._raise_if_closed(key)
        self._raise_if_not_in_group(uid, session_id)
        partition = partition_for(uid, self.ctx.config.kafka.partitions)
        lock = self._scan_locks.setdefault(partition, asyncio.Lock())
        async with lock:
            if key in self.open:  # resumed while this call waited for the scan
                return self.open[key]
            if key not in self._candidates.get(partition, {}):
                await self._rescan(partition, uid, key)
            group, logged = self._candidates[partition].pop(key)
            session = GatewaySession(self.ctx, group, session_id)
            await session.begin(resume=logged)
            self.resumed += 1
            GatewayMetrics().sessions.labels(event="resumed").inc()
            self.open[key] = session
            log.info(
                "resumed gateway session %s from the turn log (%d turns replayed)",
                key,
                len(session.transcript.turns()),
            )
            return session

    async def _rescan(self, partition: int, uid: str, key: str) -> None:
        scan = await asyncio.to_thread(self._scan, partition)
        candidates = self._candidates[partition] = {}
        for unfinished in scan.unfinished():
            group = unfinished.group
            if group.driven_by != "gateway":
                continue
            self._sizes[group.uid] = group.n
            for sid, logged in unfinished.sessions.items():
                candidate = session_key(group.uid, sid)
                if candidate not in self.open:
                    candidates[candidate] = (group, logged)
        if key not in candidates:
            self._raise_if_not_in_group(uid, int(key.rpartition(KEY_SEPARATOR)[2]))
            if uid in scan.started_uids:
                raise SessionClosedError(
                    f"session {key} has settled (finished or failed), or its group has no "
                    "such session"
                )
            raise SessionNotFoundError(
                f"no open gateway session {key}: never opened, or finished and released"
            )

    def _raise_if_not_in_group(self, uid: str, session_id: int) -> None:
        n = self._sizes.get(uid)
        if n is not None and session_id >= n:
            raise SessionNotFoundError(
                f"no gateway session {session_key(uid, session_id)}: group {uid} has {n} "
                f"sessions (0..{n - 1})"
            )

    def _raise_if_closed(self, key: str) -> None:
        state = self._closed.get(key)
        if state is not None:
            raise SessionClosedError(f"session {key} has {state}")

    # -- closing ---------------------------------------------------------------------------

    def held(self, key: str) -> GatewaySession:
        """The session ``key`` if this process holds it open (nothing is resumed)."""
        session = self.open.get(key)
        if session is None:
            self._raise_if_closed(key)
            raise SessionNotFoundError(
                f"this gateway holds no open session {key} (a call resumes it from the log)"
            )
        return session

    def settle(self, session: GatewaySession) -> None:
        """Forget a session that finished, failed, or broke (a broken one resumes from the
        log on its next call); an open one stays."""
        if session.state == "open" and not session.broken:
            return
        if self.open.get(session.key) is session:
            del self.open[session.key]
        if session.state != "open":
            self._closed[session.key] = session.state
            while len(self._closed) > CLOSED_MEMORY:
                self._closed.popitem(last=False)

    async def expire_idle(self, timeout_s: float) -> list[str]:
        """Fail the sessions without a call for ``timeout_s`` (none that is mid-call)."""
        expired = []
        for session in list(self.open.values()):
            if session.idle_s() < timeout_s or session.lock.locked():
                continue
            async with session.lock:
                if session.state != "open":
                    continue
                try:
                    await session.abort(
                        f"no call for {timeout_s:g} s (gateway.session_idle_timeout_s)"
                    )
                except SchemaError as exc:
                    log.warning("could not fail idle session %s: %s", session.key, exc)
                finally:
                    self.settle(session)
            expired.append(session.key)
        return expired

    def status(self) -> dict[str, Any]:
        return {"open_sessions": len(self.open), "resumed_sessions": self.resumed}


def parse_session_key(key: str) -> tuple[str, int]:
    """``(uid, session_id)`` of a session id ``{uid}_{session_id}``."""
    uid, sep, sid = key.rpartition(KEY_SEPARATOR)
    if not sep or not uid or not sid.isdigit():
        raise SessionNotFoundError(
            f"{key!r} is not a session id: expected {{uid}}{KEY_SEPARATOR}{{session_id}}, as "
            "POST /v1/sessions returns it"
        )
    return uid, int(sid)
