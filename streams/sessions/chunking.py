"""A turn logged in chunks as it is sampled (``sessions.chunk_tokens``, ``sessions.chunk_s``).

Without chunks a turn is one request, logged when it ends: a worker killed in the middle
of a 16k-token turn loses every token of it, and the resumed session samples the turn
again. With ``chunk_tokens`` > 0 the tokens sampled so far are logged as a
``generation_chunk`` event (token ids, logprobs, policy version) every ``chunk_tokens``
tokens, or every ``chunk_s`` seconds, whichever comes first; the tokens that end the turn
go with its ``generation`` only. Two ways to sample:

- a client that streams (``vllm_completions``; ``generate_streamed``): one streamed
  request per turn, a chunk logged every ``chunk_tokens`` tokens or ``chunk_s`` seconds;
- one that does not (other backends, a turn with images; ``generate_in_chunks``): one
  request per chunk of at most ``chunk_tokens`` tokens, each piece but the last logged.

A resumed session gets the chunks back from the log and continues the turn after them: it
asks for prompt ‖ the logged tokens, keeps their logprobs and samples only what was not
logged, so a kill costs at most one chunk of sampling. A stream cut mid-way (the replica
died) is retried as a failed request is, from the chunks logged before the cut.

The turn's budget (verl's per-turn ``max_tokens`` from ``response_length`` and
``max_model_len``, or a smaller one the loop asked for) counts the logged tokens: every
request asks for what is left of it. The pieces are joined into one ``TokenOutput`` as the
loop would get it from one request: tokens and logprobs concatenated, the last request's
finish reason and extra fields, preemptions summed, verl's ``min_global_steps`` /
``max_global_steps`` over every piece and logged chunk (the weights may have changed
between them).

Seeds (a fixture's ``seed``): a request that continues a turn ``start`` tokens in gets the
seed plus ``start``, so it does not replay the first request's random draws. Streamed, one
request draws the whole turn with the seed itself (the same tokens as without chunks); a
resumed or retried continuation draws with seed + its start. Unstreamed, every chunk
request after the first is such a continuation, so a resumed turn draws what the lost
request drew.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.schemas.turns import GenerationChunk, SessionIds
from rolloutbus.streams.inference.llm_client import per_turn_max_tokens
from rolloutbus.streams.token_stream import turn_version

__all__ = [
    "ChunkSettings",
    "LogChunk",
    "TurnPieces",
    "chunk_event",
    "generate_in_chunks",
    "generate_streamed",
    "sample_turn",
]

SEED_MODULUS = 1 << 31  # a chunk's seed stays in the range every engine accepts (31 bits)

# (chunk index, tokens of the turn before it, the piece sampled): log it before going on
LogChunk = Callable[[int, int, TokenOutput], Awaitable[None]]


@dataclass(frozen=True)
class ChunkSettings:
    """How a session's turns are chunked: ``chunk_tokens`` (0: one request per turn, as
    without chunking) and the rollout budgets the turn's tokens count against."""

    chunk_tokens: int
    rollout: RolloutConfig
    chunk_s: float | None = None  # also log the tokens sampled so far this often (streamed)

    def turn_budget(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        """verl's per-turn ``max_tokens`` for a prompt of ``prompt_len`` tokens."""
        requested = sampling_params.get("max_tokens")
        return per_turn_max_tokens(
            prompt_len, self.rollout, None if requested is None else int(requested)
        )


@dataclass
class TurnPieces:
    """The turn so far: the logged chunks' tokens, then each piece sampled live."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # every version that sampled a piece
    chunks: int = 0  # chunks logged (or replayed) so far
    preempted: int | None = None

    @classmethod
    def from_logged(cls, logged: Sequence[GenerationChunk]) -> TurnPieces:
        turn = cls()
        for chunk in logged:
            turn.tokens += chunk.token_ids
            turn.logprobs = _joined(turn.logprobs, chunk.logprobs, len(chunk.token_ids))
            if chunk.policy_version is not None:
                turn.versions.append(chunk.policy_version)
            turn.chunks += 1
        return turn

    def add(self, piece: TokenOutput) -> None:
        self.tokens += piece.token_ids
        self.logprobs = _joined(self.logprobs, piece.log_probs, len(piece.token_ids))
        extra = piece.extra_fields
        for key in ("min_global_steps", "max_global_steps"):
            if extra.get(key) is not None:
                self.versions.append(int(extra[key]))
        if piece.num_preempted is not None:
            self.preempted = (self.preempted or 0) + piece.num_preempted

    def output(self, last: TokenOutput) -> TokenOutput:
        """The whole turn as one request would have returned it."""
        extra = dict(last.extra_fields)
        if self.versions:
            extra["min_global_steps"], extra["max_global_steps"] = (
                min(self.versions),
                max(self.versions),
            )
        return TokenOutput(
            token_ids=list(self.tokens),
            log_probs=None if self.logprobs is None else list(self.logprobs),
            routed_experts=last.routed_experts,  # the last request fed the whole turn
            stop_reason=last.stop_reason,
            num_preempted=self.preempted if self.preempted is not None else last.num_preempted,
            extra_fields=extra,
        )

    def out_of_budget(self) -> TokenOutput:
        """The logged chunks already fill the turn's budget: the turn ends at its length."""
        versions = {"max_global_steps": max(self.versions)} if self.versions else {}
        return self.output(
            TokenOutput(
                token_ids=[],
                stop_reason="completed",
                extra_fields={"finish_reason": "length", **versions},
            )
        )


async def sample_turn(
    client: Any,
    request_id: str,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    settings: ChunkSettings,
    log_chunk: LogChunk,
    *,
    logged: Sequence[GenerationChunk] = (),
    streamed: bool,
    **kwargs: Any,
) -> TokenOutput:
    """Sample one turn after the ``logged`` chunks of it, within the turn's budget: in one
    streamed request (``streamed``), or in requests of at most ``settings.chunk_tokens``
    tokens; ``log_chunk`` logs the chunks on the way (``generate_streamed`` and
    ``generate_in_chunks`` say which)."""
    sampling = (_StreamedTurn if streamed else _TurnSampling)(
        prompt_ids, sampling_params, settings, log_chunk, logged
    )
    if sampling.remaining() <= 0:
        return sampling.turn.out_of_budget()
    if isinstance(sampling, _StreamedTurn):
        return await _sample_streamed(client, request_id, sampling, kwargs)
    return await _sample_in_chunks(client, request_id, sampling, kwargs)


# Sample one turn in requests of at most ``settings.chunk_tokens`` tokens, after the
# ``logged`` chunks of it; ``log_chunk`` logs every piece that does not end the turn.
generate_in_chunks = functools.partial(sample_turn, streamed=False)
# Sample one turn in one streamed request after the ``logged`` chunks of it, logging a
# chunk every ``chunk_tokens`` tokens or ``chunk_s`` seconds, whichever comes first.
generate_streamed = functools.partial(sample_turn, streamed=True)


@dataclass(eq=False)  # compared and hashed by identity
class _TurnSampling:
    """What sampling a turn starts from, either way: its prompt and sampling params, its
    budget, and ``turn``: the logged chunks' tokens, then what is sampled after them."""

    prompt_ids: list[int]
    params: dict[str, Any]
    settings: ChunkSettings
    log_chunk: LogChunk
    logged: InitVar[Sequence[GenerationChunk]]
    budget: int = field(init=False)
    turn: TurnPieces = field(init=False)

    def __post_init__(self, logged: Sequence[GenerationChunk]) -> None:
        self.budget = self.settings.turn_budget(len(self.prompt_ids), self.params)
        self.turn = TurnPieces.from_logged(logged)

    def remaining(self) -> int:
        return self.budget - len(self.turn.tokens)

    def continuation(self, max_tokens: int) -> tuple[list[int], dict[str, Any]]:
        """The request that goes on after the turn's tokens so far: prompt ‖ those tokens,
        the params asking for ``max_tokens`` more (and the seed moved past them)."""
        start = len(self.turn.tokens)
        return self.prompt_ids + self.turn.tokens, _chunk_params(self.params, max_tokens, start)


async def _sample_in_chunks(
    client: Any, request_id: str, sampling: _TurnSampling, kwargs: dict[str, Any]
) -> TokenOutput:
    """One request per chunk until a piece ends the turn or the budget is spent; every
    piece but the last is logged."""
    turn, chunk_tokens = sampling.turn, sampling.settings.chunk_tokens
    while True:
        remaining = sampling.remaining()
        ask = remaining if chunk_tokens <= 0 else min(chunk_tokens, remaining)
        start = len(turn.tokens)
        prompt_ids, params = sampling.continuation(ask)
        piece: TokenOutput = await client.generate(
            request_id, prompt_ids=prompt_ids, sampling_params=params, **kwargs
        )
        turn.add(piece)
        if not _turn_goes_on(piece, ask) or sampling.remaining() <= 0:
            return turn.output(piece)
        await sampling.log_chunk(turn.chunks, start, piece)
        turn.chunks += 1


async def _sample_streamed(
    client: Any, request_id: str, streamed: _StreamedTurn, kwargs: dict[str, Any]
) -> TokenOutput:
    last: TokenOutput = await client.stream_turn(request_id, streamed, **kwargs)
    if last.stop_reason == "aborted" and streamed.remaining() <= 0:
        return streamed.turn.out_of_budget()
    return streamed.finish(last)


@dataclass(eq=False)
class _StreamedTurn(_TurnSampling):
    """A turn as it streams: ``turn`` holds what is logged, ``pending`` what came since."""

    _pending: list[TokenOutput] = field(default_factory=list, init=False)
    _since: float = field(default_factory=time.monotonic, init=False)

    def request(self) -> tuple[list[int], dict[str, Any]]:
        """A (new) try goes on from the logged tokens: what was not logged is sampled again."""
        self._pending.clear()
        self._since = time.monotonic()
        return self.continuation(self.remaining())

    async def take(self, delta: TokenOutput) -> None:
        self._pending.append(delta)
        if delta.stop_reason is not None:
            return  # the turn ends here: its last tokens go with the turn, not as a chunk
        size = self.settings.chunk_tokens
        while size > 0 and self._pending_count() >= size:
            await self._log(size)
        timer = self.settings.chunk_s
        if timer and self._pending_count() and time.monotonic() - self._since >= timer:
            await self._log(self._pending_count())

    async def aborted(self) -> bool:
        """The engine aborted the request (a weight sync): its tokens are logged as a chunk,
        so the next request (and a resumed session) goes on after them."""
        if self._pending_count():
            await self._log(self._pending_count())
        return self.remaining() > 0

    def finish(self, last: TokenOutput) -> TokenOutput:
        """The whole turn, as one request would have returned it."""
        count = self._pending_count()
        if count:
            joined = _joined_piece(self._pending, {})
            self.turn.add(_slice_piece(joined, 0, count, self._pending))
        return self.turn.output(last)

    def _pending_count(self) -> int:
        return sum(len(d.token_ids) for d in self._pending)

    async def _log(self, count: int) -> None:
        """Log the first ``count`` pending tokens as the turn's next chunk."""
        joined = _joined_piece(self._pending, self._pending[-1].extra_fields)
        piece = _slice_piece(joined, 0, count, self._pending)
        rest = _slice_piece(joined, count, len(joined.token_ids), self._pending)
        start = len(self.turn.tokens)
        await self.log_chunk(self.turn.chunks, start, piece)
        self.turn.add(piece)
        self.turn.chunks += 1
        self._pending = [rest] if rest.token_ids else []
        self._since = time.monotonic()


def _joined_piece(deltas: list[TokenOutput], extra: dict[str, Any]) -> TokenOutput:
    tokens: list[int] = []
    logprobs: list[float] | None = []
    versions: list[tuple[int, int]] = []  # (token index, version)
    for delta in deltas:
        version = turn_version(delta.extra_fields)
        if version is not None:
            versions.append((len(tokens), version))
        logprobs = _joined(logprobs, delta.log_probs, len(delta.token_ids))
        tokens += delta.token_ids
    out = TokenOutput(token_ids=tokens, log_probs=logprobs, extra_fields=dict(extra))
    out.extra_fields["_versions"] = versions
    return out


def _slice_piece(
    joined: TokenOutput, begin: int, end: int, deltas: list[TokenOutput]
) -> TokenOutput:
    """Tokens ``begin:end`` of the pending deltas, with the versions that sampled them."""
    marks: list[tuple[int, int]] = joined.extra_fields["_versions"]
    inside = [v for at, v in marks if begin <= at < end]
    before = [v for at, v in marks if at < begin]
    versions = inside + before[-1:]
    extra: dict[str, Any] = {
        "replica_id": deltas[-1].extra_fields.get("replica_id", ""),
        "finish_reason": "length",
    }
    if versions:
        extra["min_global_steps"], extra["max_global_steps"] = min(versions), max(versions)
        extra["weight_version"] = (inside or before)[-1]
    return TokenOutput(
        token_ids=joined.token_ids[begin:end],
        log_probs=None if joined.log_probs is None else joined.log_probs[begin:end],
        stop_reason="completed",
        extra_fields=extra,
    )


def chunk_event(
    ids: SessionIds, segment: int, turn: int, index: int, start: int, piece: TokenOutput
) -> GenerationChunk:
    """The event that logs ``piece``, chunk ``index`` of a turn, ``start`` tokens into it."""
    return GenerationChunk(
        **ids,
        segment=segment,
        turn=turn,
        index=index,
        start=start,
        token_ids=piece.token_ids,
        logprobs=piece.log_probs,
        policy_version=turn_version(piece.extra_fields),  # the version of its last token
        replica=str(piece.extra_fields.get("replica_id", "")),
    )


def _turn_goes_on(piece: TokenOutput, asked: int) -> bool:
    """The piece stopped only because it reached the tokens asked for: the turn goes on.
    A stop token, an abort or anything else the engine reports ends the turn there."""
    return (
        len(piece.token_ids) >= asked
        and piece.stop_reason == "completed"
        and piece.extra_fields.get("finish_reason", "length") == "length"
    )


def _chunk_params(params: dict[str, Any], max_tokens: int, start: int) -> dict[str, Any]:
    out = {**params, "max_tokens": max_tokens}
    if start and params.get("seed") is not None:
        out["seed"] = (int(params["seed"]) + start) % SEED_MODULUS
    return out


def _joined(
    logprobs: list[float] | None, more: Sequence[float] | None, count: int
) -> list[float] | None:
    """Logprobs of the turn so far: None once a piece came without them."""
    if logprobs is None or more is None:
        return None
    return logprobs + list(more[:count])
