"""Align an agent's chat history with the session's logged token streams (Continuous Token).

An agent sends its whole history on every call. The gateway never renders the history it
already logged again: it finds the longest part of the request that the logged stream
already holds, keeps those tokens exactly as logged (sampled ones as the replica returned
them), and renders only the messages after it as an observation with the Continuous Token
builder (boundary tokens + the new messages + the generation prompt; mask 0). The prompt of
the turn is then ``logged tokens ‖ observation``, and the recorder logs the observation as
the suffix after what it holds, as for any agent loop.

Matching one logged segment against ``messages``:

1. the segment's prompt must be the render of the messages before some assistant message
   (or of all of them), with the request's tools;
2. each logged generation must be answered, in order, by an assistant message equal to the
   reply built from its tokens (``messages.comparable``), and the messages between two
   replies must render to exactly the observation logged between the two generations;
3. the messages after the last matched reply are new.

The request may stop right before the reply of the segment's last generation: it repeats
the request that sampled it (an SDK retrying a call whose answer was lost), and the
session answers it from the log instead of sampling again. Anything else that matches
only in part (a history the agent edited) keeps what matched and renders the rest; the
recorder then starts a new segment, or refuses token drift, by its own rules
(``streams/sessions/recorder.py``). A request that matches no segment is rendered whole.

The walk is the same whether the session's turns were logged by this process or replayed
from the turn log after a restart: a restarted gateway aligns the first request it gets
from the request alone. A process that served the previous call skips the walk when the
request starts with the history it answered last (``Covered``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rolloutbus.schemas.turns import Generation, Observation, SegmentStarted
from rolloutbus.streams.agent_loop.continuous_token import ContinuousTokenBuilder
from rolloutbus.streams.gateway.messages import comparable, template_message


@dataclass
class LoggedTurn:
    """One generation of a segment: where its tokens start in the segment's stream."""

    start: int
    generation: Generation
    reply: tuple[Any, ...] | None = None  # the reply message, comparable; set when parsed

    @property
    def end(self) -> int:
        return self.start + len(self.generation.token_ids)


@dataclass
class Covered:
    """The history a segment's stream answered last: the request's messages and the reply
    (comparable), the tools it was rendered with, and where that reply ended."""

    messages: list[tuple[Any, ...]]
    tools_key: str
    end: int


@dataclass
class SegmentTranscript:
    prompt_len: int
    tokens: list[int]
    turns: list[LoggedTurn] = field(default_factory=list)
    covered: Covered | None = None


class Transcript:
    """The logged token streams of one session attempt, per segment, with each generation's
    place: a fold of the attempt's events as they are written (live or replayed)."""

    def __init__(self) -> None:
        self.segments: dict[int, SegmentTranscript] = {}

    def apply(self, event: Any) -> None:
        if isinstance(event, SegmentStarted):
            self.segments[event.segment] = SegmentTranscript(
                len(event.prompt_ids), list(event.prompt_ids)
            )
        elif isinstance(event, Observation):
            self.segments[event.segment].tokens.extend(event.token_ids)
        elif isinstance(event, Generation):
            segment = self.segments[event.segment]
            segment.turns.append(LoggedTurn(len(segment.tokens), event))
            segment.tokens.extend(event.token_ids)

    def turns(self) -> list[LoggedTurn]:
        return [turn for seg in self.segments.values() for turn in seg.turns]

    def last_turn(self) -> tuple[int, LoggedTurn] | None:
        """The most recent generation (the highest turn number) and its segment."""
        found = [
            (turn.generation.turn, index, turn)
            for index, seg in self.segments.items()
            for turn in seg.turns
        ]
        if not found:
            return None
        _, index, turn = max(found, key=lambda item: item[0])
        return index, turn


@dataclass(frozen=True)
class Alignment:
    """The prompt of the request's turn, or the logged turn the request repeats."""

    prompt_ids: list[int]
    segment: int | None = None  # the segment whose history the request matched
    turns_matched: int = 0
    repeats: LoggedTurn | None = None  # answer this logged turn again: nothing is sampled


@dataclass(frozen=True)
class _Match:
    segment: int
    turns: int  # logged generations answered by the request's history
    end: int  # where the matched part of the stream ends
    position: int  # the first message after the matched part
    repeats: LoggedTurn | None = None


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class HistoryAligner:
    """Aligns requests with one session's transcript (blocking: it renders templates)."""

    def __init__(self, builder: ContinuousTokenBuilder, transcript: Transcript):
        self.builder = builder
        self.transcript = transcript

    def align(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> Alignment:
        """The request's prompt: the logged tokens it extends, then the rendered new part."""
        key = tools_key(tools)
        compared = [comparable(m) for m in messages]
        match = self._covered_match(compared, key)
        if match is None:
            matches = [
                m
                for index, seg in reversed(self.transcript.segments.items())
                if (m := self._match(index, seg, messages, compared, tools)) is not None
            ]
            match = max(matches, key=lambda m: m.turns, default=None)  # latest on a tie
        if match is None:
            return Alignment(prompt_ids=self.render_initial(messages, tools))
        seg = self.transcript.segments[match.segment]
        if match.repeats is not None:
            prompt = seg.tokens[: match.repeats.start]
            return Alignment(prompt, match.segment, match.turns, match.repeats)
        new = messages[match.position :]
        prompt = seg.tokens[: match.end] + self.observation(seg.tokens[: match.end], new)
        return Alignment(prompt, match.segment, match.turns)

    def remember(
        self, segment: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """After a turn on ``segment``: its stream now answers ``messages`` with its last reply."""
        seg = self.transcript.segments[segment]
        last = seg.turns[-1]
        compared = [comparable(m) for m in messages]
        if last.reply is not None:
            seg.covered = Covered([*compared, last.reply], tools_key(tools), last.end)

    def render_initial(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        return self.builder.build_initial_tokens(
            [template_message(m) for m in messages], tools=tools
        )

    def observation(self, stream: list[int], new: list[dict[str, Any]]) -> list[int]:
        """Boundary + the new messages + the generation prompt, after ``stream``; a request
        with nothing new after a logged stream gets what closes its last turn."""
        merge = self.builder.merge_context_tokens([], [template_message(m) for m in new], stream)
        return merge.token_ids[len(stream) :]

    # -- matching ---------------------------------------------------------------------------

    def _covered_match(self, compared: list[tuple[Any, ...]], key: str) -> _Match | None:
        """The request extends the history a segment answered last (no walk needed)."""
        for index, seg in reversed(self.transcript.segments.items()):
            covered = seg.covered
            if (
                covered is not None
                and covered.tools_key == key
                and len(compared) > len(covered.messages)
                and compared[: len(covered.messages)] == covered.messages
                and seg.turns
                and covered.end == seg.turns[-1].end
            ):
                return _Match(index, len(seg.turns), covered.end, len(covered.messages))
        return None

    def _match(
        self,
        index: int,
        seg: SegmentTranscript,
        messages: list[dict[str, Any]],
        compared: list[tuple[Any, ...]],
        tools: list[dict[str, Any]] | None,
    ) -> _Match | None:
        position = self._prompt_end(seg, messages, tools)
        if position is None:
            return None
        end, matched = seg.prompt_len, 0
        for turn in seg.turns:
            reply_at = _next_assistant(compared, position)
            between = messages[position:reply_at]
            if matched and (
                not between
                or self.observation(seg.tokens[:end], between) != seg.tokens[end : turn.start]
            ):
                break  # the history between two replies is not what was logged there
            if reply_at == len(messages):  # stops before this turn's reply: repeats its request
                last = turn is seg.turns[-1]
                return _Match(index, matched, end, position, turn if last else None)
            if turn.reply is None or compared[reply_at] != turn.reply:
                break
            position, end, matched = reply_at + 1, turn.end, matched + 1
        return _Match(index, matched, end, position)

    def _prompt_end(
        self,
        seg: SegmentTranscript,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> int | None:
        """How many of the messages the segment's prompt renders (they end before an
        assistant message, or at the end); None when no such render is the logged prompt."""
        prompt = seg.tokens[: seg.prompt_len]
        cuts = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]
        for cut in [*cuts, len(messages)]:
            rendered = self.render_initial(messages[:cut], tools)
            if rendered == prompt:
                return cut
            if len(rendered) > len(prompt):
                return None  # more messages only render longer
        return None


def _next_assistant(compared: list[tuple[Any, ...]], start: int) -> int:
    for index in range(start, len(compared)):
        if compared[index][0] == "assistant":
            return index
    return len(compared)
