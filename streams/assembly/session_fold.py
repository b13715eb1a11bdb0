"""The fold of one session attempt: its turn events, in log order, into token streams.

Pure (no Kafka, no clock): the live replay buffer and the offline replay fold the same
events into the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.turns import (
    Generation,
    Observation,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
)
from rolloutbus.streams.token_stream import SegmentStream


@dataclass
class SessionFold:
    """The events of one attempt of one session, in log order."""

    session_id: int
    attempt: str
    agent_name: str | None = None
    segments: dict[int, SegmentStream] = field(default_factory=dict)
    terminal: SessionFinished | SessionFailed | None = None

    def apply(self, event: Any) -> None:
        if isinstance(event, SessionStarted):
            self.agent_name = event.agent_name
        elif isinstance(event, SegmentStarted):
            self.segments[event.segment] = SegmentStream.start(event.prompt_ids)
        elif isinstance(event, Generation):
            self._segment(event).add_generation(event.token_ids, event.logprobs, event.policy_version)
        elif isinstance(event, Observation):
            self._segment(event).add_observation(event.token_ids)
        elif isinstance(event, SessionFinished | SessionFailed):
            self.terminal = event
        else:
            raise SchemaError(f"unexpected event type {type(event).__name__} in session fold")

    def _segment(self, event: Generation | Observation) -> SegmentStream:
        try:
            return self.segments[event.segment]
        except KeyError:
            raise SchemaError(
                f"session {event.uid}_{event.session_id} attempt {event.attempt}: "
                f"{event.type} for segment {event.segment} before its segment_started"
            ) from None

    @property
    def num_records(self) -> int:
        """Trajectory records this session contributes (a failure is one explicit record)."""
        if isinstance(self.terminal, SessionFinished):
            return len(self.terminal.outputs)
        return 1
