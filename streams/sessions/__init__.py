"""The session processor: fan a prompt group out into n sessions, run each agent loop, and
log every turn to ``rollout.turns`` (the runner, the turn recorder and the Faust worker)."""

from rolloutbus.streams.sessions.runner import SessionContext, run_group, run_session

__all__ = ["SessionContext", "run_group", "run_session"]
