"""Gate recovered replicas: one that (re)starts is routed to once it serves the current policy.

A replica that comes back after a restart serves the weights it loaded at start, usually the
initial ones, until the weight sync catches it up (seconds to minutes later). Routed to at
once, it would sample with old weights: honestly labelled, but stale, and on a fleet that
is otherwise current. (Peers shipped exactly this bug: radixark/miles PR #1805, "gate
recovered engines on weight publication".) So the LLM client holds such a replica back
until it reports the current policy version, or until ``replicas.admit_stale_s`` has
passed, whichever comes first; each admission is counted by its reason.

"The current policy version" is the newest on ``rollout.control``, followed here
(:class:`ControlVersionWatch`, through ``rolloutbus.kafka.control``'s follower); what a
replica serves is the label of its weights (the embedded replica's ``/health`` body, vLLM's
``GET /weight_info``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal, Protocol

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.errors import BrokerError
from rolloutbus.kafka.control import PolicyVersionFollower, latest_policy_version
from rolloutbus.schemas.control import as_policy_version

__all__ = ["AdmissionReason", "ControlVersionWatch", "VersionSource", "admission_reason"]

log = logging.getLogger(__name__)

AdmissionReason = Literal[
    "current_version", "stale_timeout", "no_version_published", "no_version_reported"
]
FOLLOW_POLL_S = 0.5  # seconds one control-topic poll waits: how late a new version is seen
RETRY_S = 5.0  # seconds before following again after the broker could not be read


class VersionSource(Protocol):
    """Where the client learns the current policy version."""

    @property
    def known(self) -> bool:
        """The control topic was read once: ``current_version`` can be trusted."""
        ...

    def current_version(self) -> int | None:
        """The newest published version; None when none was ever published."""
        ...

    def start(self) -> None: ...

    async def close(self) -> None: ...


def admission_reason(
    source: VersionSource,
    label: Any,
    *,
    reports_version: bool,
    waited_s: float,
    admit_stale_s: float,
) -> AdmissionReason | None:
    """Why a held-back replica that serves ``label`` may be routed to now; None: not yet."""
    stale = waited_s >= admit_stale_s
    if not source.known:
        return "stale_timeout" if stale else None
    current = source.current_version()
    if current is None:
        return "no_version_published"
    if not reports_version:
        return "no_version_reported"
    served = as_policy_version(label)
    if served is not None and served >= current:
        return "current_version"
    return "stale_timeout" if stale else None


class ControlVersionWatch:
    """The current policy version, from ``rollout.control``: read to its end once, then
    followed in a background task (each poll in a thread)."""

    def __init__(self, cfg: Config | KafkaConfig):
        self._cfg = cfg
        self._known = False
        self._current: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def known(self) -> bool:
        return self._known

    def current_version(self) -> int | None:
        return self._current

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._follow_forever(), name="rolloutbus-control-watch"
            )

    async def close(self) -> None:
        """Stop following; returns once the last poll (at most ``FOLLOW_POLL_S``) is done."""
        self._stopping = True
        if self._task is not None:
            await self._task
            self._task = None

    async def _follow_forever(self) -> None:
        while not self._stopping:
            try:
                await self._follow()
            except BrokerError as exc:
                log.warning(
                    "cannot follow policy versions on rollout.control (%s); replicas that "
                    "restart are admitted after replicas.admit_stale_s until it can",
                    exc,
                )
                await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
        latest = await asyncio.to_thread(latest_policy_version, self._cfg)
        self._note(latest.policy_version if latest is not None else None)
        follower = await asyncio.to_thread(PolicyVersionFollower, self._cfg)
        try:
            while not self._stopping:
                event = await asyncio.to_thread(follower.poll, FOLLOW_POLL_S)
                if event is not None:
                    self._note(event.policy_version)
        finally:
            await asyncio.to_thread(follower.close)

    def _note(self, version: int | None) -> None:
        if version != self._current or not self._known:
            log.info("current policy version: %s", "none published" if version is None else version)
        self._current, self._known = version, True
