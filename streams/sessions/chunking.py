"""A turn sampled in chunks, each logged as soon as it is sampled (``sessions.chunk_tokens``).

Without chunks a turn is one request, logged when it ends: a worker killed in the middle
of a 16k-token turn loses every token of it, and the resumed session samples the turn
again. With ``chunk_tokens`` > 0 the recorder asks the replica for at most that many
tokens at a time; each piece that does not end the turn is logged at once as a
``generation_chunk`` event (its token ids, logprobs and policy version), and the next
request continues from prompt ‖ the turn's tokens so far. A resumed session gets the
chunks back from the log and continues the turn after them (``generate_in_chunks`` with
``logged``): it keeps their tokens and logprobs and samples only what was not logged, so a
kill costs at most one chunk of sampling.

The turn's budget (verl's per-turn ``max_tokens`` from ``response_length`` and
``max_model_len``, or a smaller one the loop asked for) counts the logged tokens: every
request asks for what is left of it. The pieces are joined into one ``TokenOutput`` as the
loop would get it from one request: tokens and logprobs concatenated, the last piece's
finish reason and extra fields, preemptions summed, verl's ``min_global_steps`` /
``max_global_steps`` over every piece and logged chunk (the weights may have changed
between them).

Each chunk is one more request: the replica prefills prompt ‖ tokens again (vLLM's prefix
cache makes that cheap; the embedded replica recomputes it). A seeded turn (a fixture's
``seed``) gives each chunk request the seed plus the chunk's start, so a continuation does
not replay the first chunk's random draws and a resumed turn draws what the lost one drew.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.schemas.turns import GenerationChunk, SessionIds
from rolloutbus.streams.inference.llm_client import per_turn_max_tokens
from rolloutbus.streams.token_stream import turn_version

__all__ = ["ChunkSettings", "LogChunk", "TurnPieces", "chunk_event", "generate_in_chunks"]

SEED_MODULUS = 1 << 31  # a chunk's seed stays in the range every engine accepts (31 bits)

# (chunk index, tokens of the turn before it, the piece sampled): log it before going on
LogChunk = Callable[[int, int, TokenOutput], Awaitable[None]]


@dataclass(frozen=True)
class ChunkSettings:
    """How a session's turns are chunked: ``chunk_tokens`` (0: one request per turn, as
    without chunking) and the rollout budgets the turn's tokens count against."""

    chunk_tokens: int
    rollout: RolloutConfig

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


async def generate_in_chunks(
    client: Any,
    request_id: str,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    settings: ChunkSettings,
    log_chunk: LogChunk,
    *,
    logged: Sequence[GenerationChunk] = (),
    **kwargs: Any,
) -> TokenOutput:
    """Sample one turn in requests of at most ``settings.chunk_tokens`` tokens, after the
    ``logged`` chunks of it; ``log_chunk`` logs every piece that does not end the turn."""
    budget = settings.turn_budget(len(prompt_ids), sampling_params)
    turn = TurnPieces.from_logged(logged)
    while True:
        remaining = budget - len(turn.tokens)
        if remaining <= 0:
            return turn.out_of_budget()
        ask = remaining if settings.chunk_tokens <= 0 else min(settings.chunk_tokens, remaining)
        start = len(turn.tokens)
        piece: TokenOutput = await client.generate(
            request_id,
            prompt_ids=prompt_ids + turn.tokens,
            sampling_params=_chunk_params(sampling_params, ask, start),
            **kwargs,
        )
        turn.add(piece)
        if not _turn_goes_on(piece, ask) or len(turn.tokens) >= budget:
            return turn.output(piece)
        await log_chunk(turn.chunks, start, piece)
        turn.chunks += 1


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
