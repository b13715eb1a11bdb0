"""Log every turn of a session as it happens, without help from the agent loop.

``RecordingLLMClient`` stands between an agent loop and the real LLM client. In
token-in/token-out the prompt of each generate() call is the whole stream so far, so the
new suffix after the tokens already logged *is* the observation (tool output, user turn,
template boundary tokens).

A prompt that shares a segment's initial prompt but is not an extension of its logged
stream means the loop re-rendered its history. Two cases, told apart by the text (when
the recorder has the tokenizer, as in the session runner):

- the same text in other tokens (a loop that decodes and re-encodes, verl #6719): the
  sampled tokens would be rewritten, so that is ``TokenDriftError``;
- other text (a loop that compresses or edits its context): the loop may do that, as in
  verl; the prompt starts a new segment, and the loop's outputs are recorded as it
  returns them (each must lie in one logged segment, as any output must).

Without a tokenizer every re-render is ``TokenDriftError``, as before.

MoE routed experts (``rollout.enable_rollout_routing_replay``): with routing replay on, a
turn's routed experts are logged on its generation event and handed back, from the log,
to a resumed loop; with it off, the loop gets none (as a verl engine started without the
flag returns none) and none are logged.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel

from rolloutbus.errors import AgentLoopError, SessionDivergedError, TokenDriftError
from rolloutbus.schemas.agent_loop import AgentLoopOutput, TokenOutput
from rolloutbus.schemas.control import as_policy_version
from rolloutbus.schemas.routed_experts import RoutedExperts
from rolloutbus.schemas.turns import (
    Generation,
    GenerationChunk,
    Observation,
    OutputSummary,
    SegmentStarted,
    SessionIds,
)
from rolloutbus.streams.agent_loop.tracing import trace_span
from rolloutbus.streams.sessions.chunking import (
    ChunkSettings,
    chunk_event,
    generate_in_chunks,
    generate_streamed,
)
from rolloutbus.streams.token_stream import SegmentStream, generation_versions, turn_version

Emit = Callable[[BaseModel], Awaitable[None]]
LOGPROB_TOLERANCE = 1e-3  # float32 on the wire vs. float64 in the loop


class RecordingLLMClient:
    """Exposes verl's ``generate`` signature; forwards to ``client`` and logs the turn."""

    def __init__(
        self,
        client: Any,
        emit: Emit,
        *,
        uid: str,
        session_id: int,
        attempt: str,
        replay: Sequence[Any] = (),
        tokenizer: Any = None,
        routing_replay: bool = False,
        chunks: ChunkSettings | None = None,
    ):
        self._client = client
        # None: every turn is one request, logged when it ends; else each turn is sampled
        # in chunks logged as they come, and a resumed turn goes on from its logged chunks
        self._chunks = chunks
        self._routing_replay = routing_replay  # keep and log each turn's routed experts
        self._tokenizer = tokenizer  # tells a re-tokenized history from an edited one
        self.rerendered_segments = 0  # segments started by a loop that edited its history
        self._emit = emit
        self._ids = SessionIds(uid=uid, session_id=session_id, attempt=attempt)
        self.segments: dict[int, SegmentStream] = {}
        self._turn = 0
        self._lock = asyncio.Lock()  # one session's turns are logged strictly in order
        # Resuming: the logged events of the attempt this one continues. Each event this
        # recorder would emit must be the next of them (it is re-logged under this attempt),
        # and a logged generation answers generate() instead of the replica.
        self._replay: deque[Any] = deque(replay)
        self.replayed_generations = 0
        self.replayed_chunks = 0  # chunks of turns in flight taken from the log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)  # extra client API (e.g. add_replica) passes through

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **kwargs: Any,
    ) -> TokenOutput:
        async with self._lock:
            segment = await self._log_prompt(list(prompt_ids))
            logged = await self._replay_chunks(segment)
            if self._replay:
                return await self._replay_generation(segment)
            started = time.monotonic()
            with trace_span("generate", segment=segment, turn=self._turn) as span:
                out = await self._sample(
                    request_id, list(prompt_ids), sampling_params, segment, logged, kwargs
                )
                span.update(prompt_tokens=len(prompt_ids), response_tokens=len(out.token_ids))
            routed = self._routed_experts(out)
            if not self._routing_replay:
                out = out.model_copy(update={"routed_experts": None})
            extra = out.extra_fields or {}
            version = turn_version(extra)
            if version is not None:  # verl's LLMServerClient fills these from global_steps
                for key in ("global_steps", "min_global_steps", "max_global_steps"):
                    extra.setdefault(key, version)
            await self._emit(
                Generation(
                    **self._ids,
                    segment=segment,
                    turn=self._turn,
                    token_ids=out.token_ids,
                    logprobs=out.log_probs,
                    replica=str(extra.get("replica_id", "")),
                    engine_request_id=str(extra.get("engine_request_id", "")),
                    policy_version=version,
                    stop_reason=out.stop_reason,
                    num_preempted=out.num_preempted,
                    latency_s=time.monotonic() - started,
                    extra_fields=_loggable(extra),
                    routed_experts=routed,
                )
            )
            self.segments[segment].add_generation(
                out.token_ids,
                out.log_probs,
                version,
                as_policy_version(extra.get("min_global_steps")),
            )
            self._turn += 1
            return out

    async def _sample(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        segment: int,
        logged: list[GenerationChunk],
        kwargs: dict[str, Any],
    ) -> TokenOutput:
        """The turn from the replica: in one request, or in chunks logged as they come."""
        if self._chunks is None or (self._chunks.chunk_tokens <= 0 and not logged):
            if logged:
                raise self._diverged("a turn without chunks", logged[0])
            out: TokenOutput = await self._client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
            return out

        async def log_chunk(index: int, start: int, piece: TokenOutput) -> None:
            await self._emit(chunk_event(self._ids, segment, self._turn, index, start, piece))

        # one streamed request when the replica streams (a turn with images is not streamed)
        streams = getattr(self._client, "streams", False) and kwargs.get("image_data") is None
        sample = generate_streamed if streams else generate_in_chunks
        return await sample(
            self._client,
            request_id,
            prompt_ids,
            sampling_params,
            self._chunks,
            log_chunk,
            logged=logged,
            **kwargs,
        )

    async def _replay_chunks(self, segment: int) -> list[GenerationChunk]:
        """The logged chunks of the turn in flight, logged again under this attempt: the
        turn goes on after them (or a logged generation of the whole turn follows)."""
        logged: list[GenerationChunk] = []
        while self._replay and isinstance(self._replay[0], GenerationChunk):
            chunk = self._replay[0]
            start = sum(len(c.token_ids) for c in logged)
            if (chunk.segment, chunk.index, chunk.start) != (segment, len(logged), start):
                raise self._diverged(f"chunk {len(logged)} of a turn on segment {segment}", chunk)
            self._replay.popleft()
            await self._emit(chunk.model_copy(update={**self._ids, "turn": self._turn}))
            logged.append(chunk)
        self.replayed_chunks += len(logged)
        return logged

    def _routed_experts(self, out: TokenOutput) -> RoutedExperts | None:
        """The turn's routed experts as logged; None without routing replay."""
        if not self._routing_replay or out.routed_experts is None:
            return None
        try:
            return RoutedExperts.from_array(out.routed_experts)
        except ValueError as exc:
            raise AgentLoopError(
                f"session {self._ids['uid']}_{self._ids['session_id']}: the replica's "
                f"routed_experts cannot be logged: {exc}"
            ) from exc

    async def _replay_generation(self, segment: int) -> TokenOutput:
        """Answer generate() from the log: no token is sampled twice."""
        logged = self._replay.popleft()
        if not isinstance(logged, Generation) or logged.segment != segment:
            raise self._diverged(f"a generation on segment {segment}", logged)
        await self._emit(logged.model_copy(update={**self._ids, "turn": self._turn}))
        self.segments[segment].add_generation(
            logged.token_ids,
            logged.logprobs,
            logged.policy_version,
            generation_versions(logged.policy_version, logged.extra_fields)[0],
        )
        self._turn += 1
        self.replayed_generations += 1
        routed = logged.routed_experts if self._routing_replay else None
        return TokenOutput(
            token_ids=list(logged.token_ids),
            log_probs=None if logged.logprobs is None else list(logged.logprobs),
            routed_experts=None if routed is None else routed.to_numpy(),
            stop_reason=logged.stop_reason,
            num_preempted=logged.num_preempted,
            extra_fields=dict(logged.extra_fields),
        )

    async def _record(self, event: BaseModel) -> None:
        """Log ``event``; while resuming it must equal the next logged event."""
        if self._replay:
            logged = self._replay[0]
            if _content(logged) != _content(event):
                raise self._diverged(f"{getattr(event, 'type', type(event).__name__)}", logged)
            self._replay.popleft()
        await self._emit(event)

    def _diverged(self, wanted: str, logged: Any) -> SessionDivergedError:
        return SessionDivergedError(
            f"session {self._ids['uid']}_{self._ids['session_id']}: the resumed agent loop "
            f"produced {wanted} where its log holds {getattr(logged, 'type', logged)!r}; "
            "it restarts as a new attempt"
        )

    def check_replayed(self) -> None:
        """A loop that returned before using its whole log did not run as it did before."""
        if self._replay:
            raise self._diverged("its result", self._replay[0])

    async def _log_prompt(self, prompt: list[int]) -> int:
        """Place a prompt in the logged streams; emit its observation or a new segment."""
        extended = [(i, s) for i, s in self.segments.items() if _is_prefix(s.tokens, prompt)]
        if extended:
            index, seg = max(extended, key=lambda item: len(item[1].tokens))
            suffix = prompt[len(seg.tokens) :]
            if suffix:
                await self._record(
                    Observation(**self._ids, segment=index, turn=self._turn, token_ids=suffix)
                )
                seg.add_observation(suffix)
            return index
        for index, seg in self.segments.items():
            initial = seg.tokens[: seg.prompt_len]
            if _is_prefix(initial, prompt) and not _is_prefix(prompt, seg.tokens):
                at = _first_difference(prompt, seg.tokens)
                if self._edited_history(seg.tokens, prompt):
                    self.rerendered_segments += 1
                    break  # a context edit: the prompt starts a new segment
                raise TokenDriftError(
                    f"session {self._ids['uid']}_{self._ids['session_id']}: generate() prompt "
                    f"diverges from the logged stream of segment {index} at token {at} "
                    f"(logged {seg.tokens[at : at + 4]}, got {prompt[at : at + 4]}); the loop "
                    "re-rendered its history instead of appending to the token stream"
                )
        index = len(self.segments)
        await self._record(SegmentStarted(**self._ids, segment=index, prompt_ids=prompt))
        self.segments[index] = SegmentStream.start(prompt)
        return index

    def _edited_history(self, logged: list[int], prompt: list[int]) -> bool:
        """True when ``prompt`` says something else than the logged stream (an edit);
        False when it is the same text in other tokens (drift)."""
        if self._tokenizer is None:
            return False
        logged_text = self._tokenizer.decode(logged)
        prompt_text = self._tokenizer.decode(prompt)
        return not prompt_text.startswith(logged_text)

    def summarize(
        self, outputs: list[AgentLoopOutput], response_length: int
    ) -> list[OutputSummary]:
        """Locate each output in the logged streams (the fold of the log equals what run()
        returned)."""
        return [self._summarize_one(i, o) for i, o in enumerate(outputs)]

    def _summarize_one(self, index: int, output: AgentLoopOutput) -> OutputSummary:
        prompt, response = list(output.prompt_ids), list(output.response_ids)
        if len(output.response_mask) != len(response):
            raise AgentLoopError(
                f"output {index}: response_mask has {len(output.response_mask)} "
                f"entries for {len(response)} response tokens"
            )
        if output.response_logprobs is not None and len(output.response_logprobs) != len(response):
            raise AgentLoopError(
                f"output {index}: response_logprobs has "
                f"{len(output.response_logprobs)} entries for {len(response)} tokens"
            )
        for seg_index, seg in self.segments.items():
            if (
                seg.tokens[: len(prompt)] == prompt
                and seg.tokens[len(prompt) : len(prompt) + len(response)] == response
            ):
                return self._summary(index, output, seg_index, seg)
        raise AgentLoopError(
            f"output {index} of session {self._ids['uid']}_{self._ids['session_id']} does not "
            "match any logged token stream: the loop returned tokens that were neither "
            "generated nor passed to generate() as observations"
        )

    def _summary(
        self, index: int, output: AgentLoopOutput, seg_index: int, seg: SegmentStream
    ) -> OutputSummary:
        start, end = len(output.prompt_ids), len(output.prompt_ids) + len(output.response_ids)
        logged_mask = seg.mask[start:end]
        mask = list(output.response_mask)
        if any(m == 1 and lm == 0 for m, lm in zip(mask, logged_mask, strict=True)):
            raise AgentLoopError(
                f"output {index}: response_mask is 1 on tokens the policy did "
                "not sample (observation or boundary tokens)"
            )
        if output.response_logprobs is not None:
            for pos, (got, logged, m) in enumerate(
                zip(output.response_logprobs, seg.logprobs[start:end], logged_mask, strict=True)
            ):
                if m and not math.isclose(got, logged, abs_tol=LOGPROB_TOLERANCE):
                    raise AgentLoopError(
                        f"output {index}: logprob at response position {pos} "
                        f"is {got}, but the replica returned {logged}"
                    )
        return OutputSummary(
            segment=seg_index,
            prompt_len=start,
            response_len=end - start,
            mask_override=None if mask == logged_mask else mask,
            has_logprobs=output.response_logprobs is not None,
            reward_score=output.reward_score,
            num_turns=output.num_turns,
            metrics=output.metrics,
            extra_fields=output.extra_fields,
        )


def _content(event: Any) -> dict[str, Any]:
    """What an event says, without whose it is or when it was written."""
    return event.model_dump(exclude={"uid", "session_id", "attempt", "seq", "ts"})


def _loggable(extra: dict[str, Any]) -> dict[str, Any]:
    """The JSON-safe part of a TokenOutput's extra_fields (engines put plain values there)."""
    out = {}
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue  # e.g. an array; a resumed turn goes without it
        out[key] = value
    return out


def _is_prefix(prefix: list[int], seq: list[int]) -> bool:
    return len(prefix) <= len(seq) and seq[: len(prefix)] == prefix


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
