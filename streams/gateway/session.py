"""One agent session served by the gateway: every call a turn on the turn log.

A gateway session is a session of a prompt group, logged exactly as a session worker logs
one (``session_started``, ``segment_started``, ``observation``, ``generation``, then
``session_finished`` or ``session_failed``, numbered by ``seq``), through the same recorder
(``RecordingLLMClient``). Only who decides the next turn differs: an agent outside the bus
instead of an agent loop. The replay buffer folds, releases and replays it like any other.

A call, step by step:

1. align the request's messages with the logged streams (``alignment.HistoryAligner``): the
   prompt is the logged tokens the history extends, then the new messages rendered by the
   Continuous Token builder;
2. a request that repeats the one that sampled the last turn (a retry) is answered from
   the log; nothing is sampled or logged;
3. the recorder places the prompt (an observation after its segment, or a new segment),
   generates through the replicas and logs the generation;
4. the sampled tokens are parsed into the agent's reply (text, tool calls in OpenAI form).

Resuming after a gateway restart is the session worker's recovery: a new attempt replays
the logged attempt's generations through the recorder (re-logged under the new attempt,
none sampled again), so the transcript is rebuilt from the log and the agent's next call
aligns with it. A turn-log write that fails leaves the session ``broken``: it is dropped,
and the next call resumes it from the log.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from rolloutbus.config import Config
from rolloutbus.errors import AgentLoopError, PromptTooLongError, SessionDivergedError
from rolloutbus.schemas.agent_loop import AgentLoopOutput
from rolloutbus.schemas.prompts import GroupSamplingParams
from rolloutbus.schemas.trace import TraceSpan
from rolloutbus.schemas.turns import (
    Generation,
    GroupStarted,
    SessionFailed,
    SessionFinished,
    SessionIds,
    SessionStarted,
)
from rolloutbus.streams.agent_loop.continuous_token import ContinuousTokenBuilder
from rolloutbus.streams.agent_loop.tool_calls import with_stop_tokens
from rolloutbus.streams.agent_loop.tool_parser import ToolParser
from rolloutbus.streams.agent_loop.tracing import collect_spans
from rolloutbus.streams.gateway.alignment import Alignment, HistoryAligner, LoggedTurn, Transcript
from rolloutbus.streams.gateway.messages import Reply, check_messages, comparable, parse_reply
from rolloutbus.streams.gateway.outputs import segment_output
from rolloutbus.streams.gateway.stops import STOP_FIELD, StopWatch, cut_at_stop
from rolloutbus.streams.gateway.streamed_turns import StreamingLLMClient, TokenSink
from rolloutbus.streams.reward import ComputeScore, score_outputs_async
from rolloutbus.streams.sessions.recorder import RecordingLLMClient
from rolloutbus.streams.sessions.recovery import LoggedAttempt
from rolloutbus.streams.sessions.runner import new_attempt_id
from rolloutbus.topics import session_key

log = logging.getLogger(__name__)

GATEWAY_AGENT_NAME = "gateway"  # the trajectories' agent_name: the agent ran outside the bus


class SessionClosedError(AgentLoopError):
    """The session already finished or failed: nothing more can be logged for it."""


class NothingToFinishError(AgentLoopError, ValueError):
    """A finish for a session without a single completion: there is no trajectory."""


@dataclass
class GatewayContext:
    """What every session of a gateway shares."""

    config: Config
    tokenizer: Any
    llm_client: Any
    emit: Callable[[BaseModel], Awaitable[None]]  # one event onto the turn log, durably
    builder: ContinuousTokenBuilder
    parser: ToolParser
    scorer: ComputeScore


@dataclass(frozen=True)
class TurnResult:
    """One call's answer: the prompt it sampled from, the sampled tokens and the reply."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    reply: Reply
    outcome: Literal["sampled", "repeated", "length"]
    stop_sequence: str | None = None  # the stop string the turn ended with (``stops.py``)


@dataclass
class _Budget:
    max_tokens: int | None  # this turn's cap; None when the response budget is spent
    segment: int | None  # the logged segment the prompt extends


class GatewaySession:
    """One session of a gateway group; callers hold ``lock`` around each call."""

    def __init__(self, ctx: GatewayContext, group: GroupStarted, session_id: int):
        self.ctx = ctx
        self.group = group
        self.session_id = session_id
        self.key = session_key(group.uid, session_id)
        self.sampling = GroupSamplingParams(**group.sampling_params)
        self.lock = asyncio.Lock()
        self.state: Literal["open", "finished", "failed"] = "open"
        self.broken = False  # a write failed: drop this object, resume from the log
        self.last_active = time.monotonic()
        self.spans: list[TraceSpan] = []
        self._new_attempt(new_attempt_id())

    def _new_attempt(self, attempt: str) -> None:
        self.attempt = attempt
        self.ids = SessionIds(uid=self.group.uid, session_id=self.session_id, attempt=attempt)
        self.transcript = Transcript()
        self.aligner = HistoryAligner(self.ctx.builder, self.transcript)
        self._seq = itertools.count()

    # -- start and resume ----------------------------------------------------------------

    async def begin(self, resume: LoggedAttempt | None = None) -> None:
        """Log ``session_started``; with ``resume``, replay that attempt's generations."""
        if resume is not None:
            try:
                await self._start(resume)
                return
            except SessionDivergedError as exc:  # a log this process cannot replay
                log.warning("%s; session %s starts over without its history", exc, self.key)
                self._new_attempt(new_attempt_id())
        await self._start(None)

    async def _start(self, resume: LoggedAttempt | None) -> None:
        await self._emit(
            SessionStarted(
                **self.ids,
                agent_name=GATEWAY_AGENT_NAME,
                resumed_from=resume.attempt if resume else None,
            )
        )
        replay = replayable(resume.history()) if resume else []
        self.recorder = RecordingLLMClient(
            StreamingLLMClient(self.ctx.llm_client, self.ctx.config.rollout),
            self._emit,
            **self.ids,
            replay=replay,
            tokenizer=self.ctx.tokenizer,
            routing_replay=self.ctx.config.rollout.enable_rollout_routing_replay,
        )
        for prompt in logged_prompts(replay):
            await self.recorder.generate(self.key, prompt_ids=prompt, sampling_params={})
        self.recorder.check_replayed()

    async def _emit(self, event: BaseModel) -> None:
        numbered = event.model_copy(update={"seq": next(self._seq)})
        try:
            await self.ctx.emit(numbered)
        except BaseException:
            self.broken = True  # the log and this object may now disagree
            raise
        self.transcript.apply(numbered)

    # -- turns ---------------------------------------------------------------------------

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None,
        on_tokens: TokenSink | None = None,
        on_prompt: Callable[[list[int]], None] | None = None,
        stop: list[str] | None = None,
    ) -> TurnResult:
        """One chat completion: align, then answer from the log or sample a turn (its new
        tokens go to ``on_tokens`` as they are sampled, where the replicas stream; the
        prompt's ids to ``on_prompt`` before that), ended at a ``stop`` string if one is
        sampled."""
        self._check_open()
        check_messages(messages)
        self._check_stops(stop)
        await self._parse_replies(tools)
        alignment: Alignment = await asyncio.to_thread(self.aligner.align, messages, tools)
        if on_prompt is not None:
            on_prompt(alignment.prompt_ids)
        if alignment.repeats is not None:
            return await self._repeat(alignment.repeats, alignment.prompt_ids, tools)
        watch = StopWatch(self.ctx.tokenizer, stop) if stop else None
        result = await self._sample(alignment.prompt_ids, max_tokens, tools, on_tokens, watch)
        if result.outcome == "sampled":
            self.aligner.remember(self._last_segment(), messages, tools)
        return result

    async def complete(self, prompt: str | list[int], max_tokens: int | None) -> TurnResult:
        """One text completion: a token prompt as given, a text prompt continued after the
        logged stream it starts with (only the new text is encoded)."""
        self._check_open()
        prompt_ids = await asyncio.to_thread(self._text_prompt_ids, prompt)
        for seg in self.transcript.segments.values():
            if seg.turns and prompt_ids == seg.tokens[: seg.turns[-1].start]:
                return await self._repeat(seg.turns[-1], prompt_ids, None)
        return await self._sample(prompt_ids, max_tokens, None)

    def _text_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        tokenizer = self.ctx.tokenizer
        logged = [
            (seg.tokens, text)
            for seg in self.transcript.segments.values()
            for text in _stream_texts(tokenizer, seg.tokens)
            if prompt.startswith(text)
        ]
        if not logged:
            return list(tokenizer.encode(prompt))
        tokens, text = max(logged, key=lambda item: (len(item[0]), len(item[1])))
        rest = prompt[len(text) :]
        return tokens + (tokenizer.encode(rest, add_special_tokens=False) if rest else [])

    async def _sample(
        self,
        prompt_ids: list[int],
        max_tokens: int | None,
        tools: list[dict[str, Any]] | None,
        on_tokens: TokenSink | None = None,
        stop: StopWatch | None = None,
    ) -> TurnResult:
        budget = self._budget(prompt_ids, max_tokens)
        if budget.max_tokens is None:  # the observation would spend the response budget
            reply = Reply(content="", tool_calls=[], finish_reason="length")
            return TurnResult(prompt_ids, [], None, reply, "length")
        params = {**self.sampling.model_dump(), "max_tokens": budget.max_tokens}
        params = with_stop_tokens(params, self.ctx.parser.stop_token_ids)
        streamed: dict[str, Any] = {} if on_tokens is None else {"on_tokens": on_tokens}
        if stop is not None:
            streamed["stop"] = stop
        with collect_spans() as spans:
            out = await self.recorder.generate(
                self.key, prompt_ids=prompt_ids, sampling_params=params, **streamed
            )
        self.spans.extend(spans)
        segment = self._last_segment()
        turn = self.transcript.segments[segment].turns[-1]
        reply = await self._reply(turn.generation, tools)
        turn.reply = comparable(reply.message())
        stopped = turn.generation.extra_fields.get(STOP_FIELD)
        return TurnResult(prompt_ids, list(out.token_ids), out.log_probs, reply, "sampled", stopped)

    async def _repeat(
        self, turn: LoggedTurn, prompt_ids: list[int], tools: list[dict[str, Any]] | None
    ) -> TurnResult:
        g = turn.generation
        reply = await self._reply(g, tools)
        stopped = g.extra_fields.get(STOP_FIELD)
        return TurnResult(prompt_ids, list(g.token_ids), g.logprobs, reply, "repeated", stopped)

    def _budget(self, prompt_ids: list[int], cap: int | None) -> _Budget:
        """The turn's token cap within ``rollout.response_length`` (a budget for the whole
        trajectory, as in verl): the segment the recorder will extend, as it chooses it."""
        rollout = self.ctx.config.rollout
        extended = [
            (len(seg.tokens), index, seg)
            for index, seg in self.transcript.segments.items()
            if prompt_ids[: len(seg.tokens)] == seg.tokens
        ]
        if not extended:
            if len(prompt_ids) > rollout.prompt_length:
                raise PromptTooLongError(
                    f"the prompt has {len(prompt_ids)} tokens, over rollout.prompt_length="
                    f"{rollout.prompt_length} (the gateway does not truncate a history)"
                )
            left = rollout.response_length
            segment = None
        else:
            _, segment, seg = max(extended, key=lambda item: item[0])
            left = rollout.response_length - (len(prompt_ids) - seg.prompt_len)
        if left <= 0:
            return _Budget(None, segment)
        return _Budget(min(left, cap) if cap else left, segment)

    def _check_stops(self, stop: list[str] | None) -> None:
        """Stop strings are found in the gateway as the replica streams (``stops.py``)."""
        if not stop:
            return
        if not getattr(self.ctx.llm_client, "streams", False):
            raise ValueError(
                "stop sequences are not supported with this replica backend: the gateway "
                "finds them as the replica streams a turn, and this backend does not stream "
                "(the embedded replica's and vLLM's completions backends do)"
            )
        if self.ctx.config.rollout.enable_rollout_routing_replay:
            raise ValueError(
                "stop sequences are not supported with routing replay: a turn cut at a stop "
                "string has no routed experts from the replica"
            )

    async def _reply(self, generation: Generation, tools: list[dict[str, Any]] | None) -> Reply:
        """The reply parsed from the logged tokens, its text before the stop string it
        ended with (logged with the generation)."""
        reply = await parse_reply(
            self.ctx.parser,
            self.ctx.tokenizer,
            list(generation.token_ids),
            tools=tools,
            engine_finish_reason=generation.extra_fields.get("finish_reason"),
            call_id_prefix=f"call_{self.key}_{generation.turn}",
        )
        stopped = generation.extra_fields.get(STOP_FIELD)
        if not stopped:
            return reply
        content = cut_at_stop(reply.content, stopped)
        return Reply(content, reply.tool_calls, reply.finish_reason)

    async def _parse_replies(self, tools: list[dict[str, Any]] | None) -> None:
        """Replies of turns replayed from the log, parsed as the request's tools say."""
        for turn in self.transcript.turns():
            if turn.reply is None:
                turn.reply = comparable((await self._reply(turn.generation, tools)).message())

    def _last_segment(self) -> int:
        last = self.transcript.last_turn()
        assert last is not None, "a turn was just logged"
        return last[0]

    # -- the end -------------------------------------------------------------------------

    async def finish(self, reward: float | None, extra_fields: dict[str, Any]) -> SessionFinished:
        """``session_finished`` with the reward given, or the row's scorer's."""
        self._check_open()
        outputs = self.outputs()
        if not outputs:
            raise NothingToFinishError(
                f"session {self.key} has no completion to train on; abort it instead"
            )
        for output in outputs:
            output.extra_fields.update(extra_fields)
            if reward is not None:
                output.reward_score = reward
        row = self.group.row
        if reward is None and row.get("reward_model") is not None:
            await score_outputs_async(outputs, row, self.ctx.tokenizer, self.ctx.scorer)
        summaries = self.recorder.summarize(outputs, self.ctx.config.rollout.response_length)
        terminal = SessionFinished(**self.ids, outputs=summaries, spans=self.spans)
        await self._emit(terminal)
        self.state = "finished"
        return terminal

    async def abort(self, error: str) -> SessionFailed:
        """``session_failed``: an explicit record, so the group is not silently short."""
        self._check_open()
        terminal = SessionFailed(
            **self.ids, agent_name=GATEWAY_AGENT_NAME, error=error, spans=self.spans
        )
        await self._emit(terminal)
        self.state = "failed"
        return terminal

    def outputs(self) -> list[AgentLoopOutput]:
        """One output per segment with a generation, in segment order."""
        limit = self.ctx.config.rollout.response_length
        found = [
            segment_output(seg, self.recorder.segments[index], limit)
            for index, seg in sorted(self.transcript.segments.items())
        ]
        return [output for output in found if output is not None]

    def _check_open(self) -> None:
        if self.state != "open":
            raise SessionClosedError(f"session {self.key} has {self.state}")

    def idle_s(self) -> float:
        return time.monotonic() - self.last_active

    def touch(self) -> None:
        self.last_active = time.monotonic()


def _stream_texts(tokenizer: Any, tokens: list[int]) -> list[str]:
    """The texts an agent's prompt may continue a logged stream with: the stream decoded,
    and, when it ends with a special token (the stop token the reply text leaves out),
    decoded without it; the tokens stay as logged either way."""
    texts = [tokenizer.decode(tokens)]
    if tokens and tokens[-1] in set(getattr(tokenizer, "all_special_ids", ())):
        texts.append(tokenizer.decode(tokens[:-1]))
    return texts


def replayable(events: list[Any]) -> list[Any]:
    """A logged attempt's events up to its last generation: what a resumed attempt replays.
    An observation or segment logged after it (its generation failed) is not replayed: the
    agent's next call renders it again, and the recorder logs it again."""
    last = max((i for i, e in enumerate(events) if isinstance(e, Generation)), default=-1)
    return list(events[: last + 1])


def logged_prompts(events: list[Any]) -> list[list[int]]:
    """The prompt of each logged generation, in order: its segment's tokens before it."""
    streams: dict[int, list[int]] = {}
    prompts = []
    for event in events:
        if event.type == "segment_started":
            streams[event.segment] = list(event.prompt_ids)
        elif event.type == "observation":
            streams[event.segment].extend(event.token_ids)
        elif event.type == "generation":
            prompts.append(list(streams[event.segment]))
            streams[event.segment].extend(event.token_ids)
    return prompts
