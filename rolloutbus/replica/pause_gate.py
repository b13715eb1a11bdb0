"""The pause gate both engines share: vLLM's RL pause modes and the rules around them.

vLLM's RL API (dev mode) pauses an engine in one of three modes (``PauseMode``): ``abort``
ends the running requests with the tokens sampled so far, ``wait`` lets them finish,
``keep`` freezes them where they are. In every mode nothing new starts until ``resume``,
and weights may be reloaded only while paused. ``PauseGate`` holds that state and those
rules once; each engine adds only how it carries them out (the decode thread of
``DecodeEngine`` under its lock, the asyncio calls of the ``ScriptedEngine`` double).

Not thread-safe by itself: ``DecodeEngine`` changes it under its condition lock; the
scripted double only from its event loop. ``wait_open`` must be awaited from one event
loop (the server's).
"""

from __future__ import annotations

import asyncio

from rolloutbus.replica.generation import PAUSE_MODES, EngineNotPausedError, PauseMode

__all__ = ["PauseGate", "check_pause_mode"]


def check_pause_mode(mode: str) -> PauseMode:
    """``mode`` if it is one of vLLM's pause modes, else a ValueError naming them."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return mode  # narrowed to PauseMode by the membership test


class PauseGate:
    """Open (``mode is None``: requests start) or closed in one ``PauseMode``."""

    def __init__(self) -> None:
        self.mode: PauseMode | None = None
        self._reopened: asyncio.Event | None = None  # made by the first waiter of a pause

    @property
    def is_paused(self) -> bool:
        return self.mode is not None

    def close(self, mode: PauseMode) -> None:
        """Pause in ``mode`` (checked); a second pause changes the mode."""
        self.mode = check_pause_mode(mode)

    def open(self) -> None:
        """Resume: requests held by ``wait_open`` go on."""
        self.mode = None
        if self._reopened is not None:
            self._reopened.set()
            self._reopened = None

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
