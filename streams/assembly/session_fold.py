"""The fold of one session attempt: its turn events, in log order, into token streams.

Pure (no Kafka, no clock): the live replay buffer and the offline replay fold the same
events into the same state.

Every event of an attempt carries ``seq``, its position in the attempt's stream
(``session_started`` is 0). The fold applies seq ``last + 1`` and nothing else:

* ``seq <= last``: a duplicate (a producer retry, or a resumed worker writing an event the
  log already holds) — ignored, so a duplicated generation is folded once;
* ``seq > last + 1``: an event after a gap. It is held back (not applied): a worker that
  resumes the attempt rewrites the missing events, and their successors, in order. A
  terminal event after a gap settles the attempt; ``session_finished`` then fails it
  (its tokens are not all in the log), ``session_failed`` keeps its own error.

A log written before events were numbered has seq 0 on every event: after
``session_started`` such an event is applied as it comes (there is nothing to
de-duplicate it by). A turn log that cannot be folded (a generation before its
``segment_started``: the attempt's head is not in the log) marks the attempt broken
instead of raising; it settles as one failed record when its terminal event arrives, or
when its group is released early (``partition_fold``).

A token-carrying event (a segment start too) may come as the wire decoder's ``WireTokens``
(``fold_events.py``) instead of its pydantic model: it is folded into the same state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutbus.errors import SchemaError
from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    Observation,
    SegmentStarted,
    SessionFailed,
    SessionFinished,
    SessionStarted,
)
from rolloutbus.schemas.wire_turns import WireTokens
from rolloutbus.streams.token_stream import FoldSegment, generation_versions

ERROR_CHARS = 1000  # characters of an error kept in a failed record (pydantic echoes inputs)


@dataclass
class SessionFold:
    """The events of one attempt of one session, in log order."""

    session_id: int
    attempt: str
    agent_name: str | None = None
    segments: dict[int, FoldSegment] = field(default_factory=dict)
    terminal: SessionFinished | SessionFailed | None = None
    error: str | None = None  # why this attempt's log cannot be folded; it settles as failed
    last_seq: int = -1  # seq of the last event applied
    ignored: int = 0  # duplicates and events held back after a gap
    # the chunks logged of the turn in flight, until its generation event (which holds all
    # its tokens) arrives: they give it their policy versions (``token_stream``)
    chunks: list[GenerationChunk | WireTokens] = field(default_factory=list)

    def apply(self, event: Any) -> bool:
        """Fold one event; False when it was ignored (a duplicate, or after a gap)."""
        if self.terminal is not None:
            self.ignored += 1
            return False
        if event.seq == 0 and self.last_seq >= 0 and not isinstance(event, SessionStarted):
            return self._apply_unnumbered(event)
        expected = self.last_seq + 1
        if event.seq < expected:
            self.ignored += 1
            return False
        if event.seq > expected:
            return self._apply_after_gap(event, expected)
        self.last_seq = event.seq
        self._fold(event)
        return True

    def _apply_unnumbered(self, event: Any) -> bool:
        self._fold(event)  # a log from before seq numbers: every event has seq 0
        return True

    def _apply_after_gap(self, event: Any, expected: int) -> bool:
        if not isinstance(event, SessionFinished | SessionFailed):
            self.ignored += 1  # held back: the missing events may still come, rewritten
            return False
        if isinstance(event, SessionFinished) and self.error is None:
            self.error = (
                f"session {event.uid}_{event.session_id} attempt {event.attempt}: "
                f"events with seq {expected}..{event.seq - 1} are not in the turn log"
            )
        self.last_seq = event.seq
        self.terminal = event
        return True

    def _fold(self, event: Any) -> None:
        if isinstance(event, SessionFinished | SessionFailed):
            self.terminal = event
            return
        if self.error is not None:
            return  # broken: only the terminal event still matters
        try:
            self._fold_tokens(event)
        except (SchemaError, ValueError, TypeError) as exc:
            self.error = short_error(exc)

    def _fold_tokens(self, event: Any) -> None:
        if isinstance(event, WireTokens):
            self._fold_wire(event)
        elif isinstance(event, SessionStarted):
            self.agent_name = event.agent_name
        elif isinstance(event, SegmentStarted):
            self.segments[event.segment] = FoldSegment(event.prompt_ids)
        elif isinstance(event, Generation):
            first, last = generation_versions(event.policy_version, event.extra_fields)
            self._segment(event).add_generation(
                event.token_ids,
                event.logprobs,
                last,
                first,
                event.routed_experts,
                self._chunk_versions(event, event.token_ids),
            )
        elif isinstance(event, GenerationChunk):
            self._add_chunk(event)
        elif isinstance(event, Observation):
            self._segment(event).add_observation(event.token_ids)
        else:
            raise SchemaError(f"unexpected event type {type(event).__name__} in session fold")

    def _fold_wire(self, event: WireTokens) -> None:
        """``_fold_tokens`` of a wire-decoded event: the same calls with the same values,
        the arrays kept as numpy (``FoldSegment`` keeps them as chunks)."""
        if event.type == "generation_chunk":
            self._add_chunk(event)
            return
        if event.type == "segment_started":
            self.segments[event.segment] = FoldSegment(event.token_ids)
            return
        segment = self._segment(event)
        if event.type == "observation":
            segment.add_observation(event.token_ids)
            return
        extra = {"min_global_steps": event.min_global_steps}
        first, last = generation_versions(event.policy_version, extra)
        chunk_versions = self._chunk_versions(event, event.token_ids)
        segment.add_generation(event.token_ids, event.logprobs, last, first, None, chunk_versions)

    def _add_chunk(self, event: GenerationChunk | WireTokens) -> None:
        self._segment(event)  # a chunk of a segment that never started breaks the log
        if self.chunks and (self.chunks[0].segment, self.chunks[0].turn) != (
            event.segment,
            event.turn,
        ):
            self.chunks = []  # a turn that ended without its generation: not in the fold
        self.chunks.append(event)

    def _chunk_versions(
        self, event: Generation | WireTokens, token_ids: list[int] | np.ndarray
    ) -> list[tuple[int, int | None]]:
        """``(end, version)`` of the logged chunks of ``event``'s turn that its tokens
        (``token_ids``) begin with (the generation is the truth; a chunk it does not hold
        is dropped)."""
        chunks, self.chunks = self.chunks, []
        spans = []
        for chunk in chunks:
            start = chunk.start or 0  # a chunk's start is never None
            end = start + len(chunk.token_ids)
            if (chunk.segment, chunk.turn) == (event.segment, event.turn) and _same(
                token_ids[start:end], chunk.token_ids
            ):
                spans.append((end, chunk.policy_version))
        return spans

    def _segment(
        self, event: Generation | GenerationChunk | Observation | WireTokens
    ) -> FoldSegment:
        try:
            return self.segments[event.segment]
        except KeyError:
            raise SchemaError(
                f"session {event.uid}_{event.session_id} attempt {event.attempt}: "
                f"{event.type} for segment {event.segment} before its segment_started "
                "(the head of the attempt is not in the turn log)"
            ) from None

    @property
    def failed(self) -> bool:
        """Settles as one failed record: it failed, or its log cannot be folded."""
        return self.error is not None or not isinstance(self.terminal, SessionFinished)

    @property
    def num_records(self) -> int:
        """Trajectory records this session contributes (a failure is one explicit record)."""
        if isinstance(self.terminal, SessionFinished) and self.error is None:
            return len(self.terminal.outputs)
        return 1


def _same(a: list[int] | np.ndarray, b: list[int] | np.ndarray) -> bool:
    """Equal token ids, either side a list or numpy (as ``==`` of their lists)."""
    if isinstance(a, list) and isinstance(b, list):
        return a == b
    return len(a) == len(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))


def short_error(exc: BaseException, limit: int = ERROR_CHARS) -> str:
    """One line naming the error, at most ``limit`` characters: a failed record's reason."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
