"""The pause gate both engines share: vLLM's RL pause modes and the rules around them.

vLLM's RL API (dev mode) pauses an engine in one of three modes (``PauseMode``): ``abort``
ends the running requests with the tokens sampled so far, ``wait`` lets them finish,
``keep`` freezes them where they are. In every mode nothing new starts until ``resume``,
and weights may be reloaded only while paused. ``PauseGate`` holds that state and those
rules once; each engine adds only how it carries them out (the decode thread of
``DecodeEngine`` under its lock, the asyncio calls of the ``ScriptedEngine`` double).

**A pause has an owner** (a Rollout Bus addition; vLLM's pause has none). A pause may come
with a lease (``POST /pause?lease_s=``): whoever paused (the weight sync) renews it while it
works, and once the lease runs out with no reload under way, the server resumes the engine
on the weights it holds (``server._watch_pause_lease``). So a weight sync killed between
its pause and its resume leaves the replica paused for at most the lease, never forever.

The label must then tell the truth. The gate remembers a reload that completed since the
label was last set: a weight sync killed after its reload but before its
``/update_weight_version`` leaves new weights under the old label, and resuming as is would
stamp the new weights' tokens with the old version. ``label_after_lease`` then gives
``"unknown:<weights_path>"``, which no reader takes for a policy version (the tokens carry
no version rather than a wrong one) and which the weight sync sees as "not synced" and
applies the current version again.

Not thread-safe by itself: ``DecodeEngine`` changes the mode under its condition lock; the
scripted double only from its event loop. The lease fields are read and written from the
server's event loop only; ``reload_finished`` may run in the decode thread (a plain
attribute write). ``wait_open`` must be awaited from one event loop (the server's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal, Protocol

from rolloutbus.errors import ReplicaError

__all__ = [
    "PAUSE_MODES",
    "UNKNOWN_LABEL_PREFIX",
    "EngineNotPausedError",
    "PauseGate",
    "PauseMode",
    "check_pause_mode",
    "resume_after_lease",
    "watch_pause_lease",
]

# vLLM's PauseMode: abort in-flight requests (default), wait for them, or keep them frozen.
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


class EngineNotPausedError(ReplicaError):
    """A weight reload was asked of an engine that is not paused: an HTTP 409."""


log = logging.getLogger(__name__)

# the label of weights whose version the replica does not know: a reload completed but the
# label that should follow it never came (``as_policy_version`` reads it as no version)
UNKNOWN_LABEL_PREFIX = "unknown:"
# seconds between two looks at the lease: a lease lasts tens of seconds, so an expired
# pause ends at most this much later than its lease
LEASE_CHECK_S = 0.25


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if it is one of vLLM's pause modes, else a ValueError naming them."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return mode  # narrowed to PauseMode by the membership test


class PauseGate:
    """Open (``mode is None``: requests start) or closed in one ``PauseMode``, maybe leased."""

    def __init__(self) -> None:
        self.mode: PauseMode | None = None
        self._reopened: asyncio.Event | None = None  # made by the first waiter of a pause
        self.paused_since: float | None = None  # seconds since the epoch (for /health)
        self.lease_s: float | None = None  # None: a pause without a lease lasts until resume
        self._lease_until: float | None = None  # time.monotonic()
        self.reloads_running = 0
        # weights_path of a reload that completed since the label was last set
        self.unlabelled_reload: str | None = None
        self.lease_expiries = 0  # pauses ended by their lease (for /metrics)

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    def close(self, mode: PauseMode, lease_s: float | None = None) -> None:
        """Pause in ``mode`` (checked); a second pause changes the mode and the lease."""
        self.mode = check_pause_mode(mode)
        if self.paused_since is None:
            self.paused_since = time.time()
        self._set_lease(lease_s)

    def renew(self, mode: PauseMode, lease_s: float) -> bool:
        """Extend the lease of a pause in ``mode``; False (nothing changed) when the gate is
        open or paused in another mode: the caller pauses instead."""
        if self.mode != mode:
            return False
        self._set_lease(lease_s)
        return True

    def _set_lease(self, lease_s: float | None) -> None:
        self.lease_s = lease_s
        self._lease_until = None if lease_s is None else time.monotonic() + lease_s

    def open(self) -> None:
        """Resume: requests held by ``wait_open`` go on."""
        self.mode = None
        self.paused_since = None
        self._set_lease(None)
        if self._reopened is not None:
            self._reopened.set()
            self._reopened = None

    @property
    def lease_expired(self) -> bool:
        """Paused under a lease that ran out, with no reload under way (a reload in progress
        holds the pause: its weights would change under running requests otherwise)."""
        return (
            self.mode is not None
            and self._lease_until is not None
            and time.monotonic() >= self._lease_until
            and self.reloads_running == 0
        )

    # -- reloads and labels ---------------------------------------------------------------

    def reload_started(self) -> None:
        self.reloads_running += 1

    def reload_ended(self) -> None:
        self.reloads_running = max(0, self.reloads_running - 1)

    def reload_finished(self, weights_path: str) -> None:
        """The weights of ``weights_path`` are now served (called right after they are)."""
        self.unlabelled_reload = weights_path

    def labelled(self) -> None:
        """``/update_weight_version`` named the served weights."""
        self.unlabelled_reload = None

    def label_after_lease(self, label: int | str) -> int | str:
        """The truthful label once a lease ran out: ``label`` unless a reload completed
        after it was set."""
        if self.unlabelled_reload is None:
            return label
        return f"{UNKNOWN_LABEL_PREFIX}{self.unlabelled_reload}"

    async def wait_open(self) -> None:
        """Return once the gate is open: a request submitted while paused is held until
        ``resume``, as vLLM holds it (it is not refused)."""
        while self.mode is not None:
            if self._reopened is None:
                self._reopened = asyncio.Event()
            await self._reopened.wait()

    def require_paused(self, weights_path: str) -> None:
        """Raise EngineNotPausedError (HTTP 409) unless paused: vLLM's RL API reloads only
        a paused engine, so no request sees its weights change without a pause first."""
        if self.mode is None:
            raise EngineNotPausedError(
                f"refusing to reload weights from {weights_path!r}: the engine is not paused; "
                "POST /pause (mode abort, wait or keep) first, then /resume after the reload"
            )


# -- the lease's end (the server runs this in its event loop) ----------------------------


class _Leased(Protocol):
    """What ending a lease needs of an engine (``generation.Engine`` has it)."""

    model_name: str
    weight_version: int | str

    @property
    def pause_gate(self) -> PauseGate: ...

    async def resume(self) -> None: ...


async def watch_pause_lease(engine: _Leased) -> None:
    """Forever: resume ``engine`` when its pause lease has run out."""
    while True:
        await asyncio.sleep(LEASE_CHECK_S)
        if engine.pause_gate.lease_expired:
            await resume_after_lease(engine)


async def resume_after_lease(engine: _Leased) -> None:
    """Resume on the weights served now, labelled truthfully, and say so in the log."""
    gate = engine.pause_gate
    paused_s = time.time() - (gate.paused_since or time.time())
    lease_s, reloaded = gate.lease_s, gate.unlabelled_reload
    before = engine.weight_version
    engine.weight_version = gate.label_after_lease(before)
    gate.lease_expiries += 1
    await engine.resume()
    if reloaded is None:
        what = f"the weights it served before, still labelled {before!r}"
    else:
        what = (
            f"the weights reloaded from {reloaded}, whose label never came: labelled "
            f"{engine.weight_version!r} (was {before!r}) until a weight sync applies a version"
        )
    log.warning(
        "%s: pause lease of %s s ran out after %.1f s paused (its holder, a weight sync, "
        "stopped renewing it); resuming on %s",
        engine.model_name,
        f"{lease_s:g}" if lease_s is not None else "?",
        paused_s,
        what,
    )
