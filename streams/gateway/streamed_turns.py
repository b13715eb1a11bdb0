"""A gateway turn streamed from the replica: its tokens handed on as they are sampled.

``StreamingLLMClient`` is the LLM client a gateway session's recorder calls. Given
``on_tokens`` (a streamed request) and a backend that streams, the turn is one streamed
request whose new tokens go to ``on_tokens`` as they come; the recorder still gets the whole
turn and logs it when it ends, as an unstreamed turn is logged. A try that is cut or aborted
goes on after the tokens already sent (an agent cannot take text back), with the seed moved
on as a session worker's streamed turn moves it (``streams/sessions/chunking.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.streams.gateway.stops import STOP_FIELD, StopMatchedError, StopWatch
from rolloutbus.streams.inference.llm_client import per_turn_max_tokens
from rolloutbus.streams.sessions.chunking import SEED_MODULUS, TurnPieces

__all__ = ["StreamingLLMClient", "TokenSink"]

TokenSink = Callable[[list[int]], Awaitable[None]]  # the new tokens of a turn, as sampled


class StreamingLLMClient:
    """``client``, whose ``generate`` streams the turn to ``on_tokens`` when it is given."""

    def __init__(self, client: Any, rollout: RolloutConfig):
        self._client, self._rollout = client, rollout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        on_tokens: TokenSink | None = None,
        stop: StopWatch | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if (on_tokens is None and stop is None) or not getattr(self._client, "streams", False):
            out: TokenOutput = await self._client.generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs
            )
            return out
        budget = per_turn_max_tokens(
            len(prompt_ids), self._rollout, sampling_params.get("max_tokens")
        )
        turn = _ForwardedTurn(list(prompt_ids), sampling_params, budget, on_tokens or _unsent, stop)
        try:
            last: TokenOutput = await self._client.stream_turn(request_id, turn, **kwargs)
        except StopMatchedError:
            return turn.pieces.output(turn.stopped_at())
        if last.stop_reason == "aborted" and turn.remaining() <= 0:
            return turn.pieces.out_of_budget()
        return turn.pieces.output(last)


class _ForwardedTurn:
    """A turn as it streams (``StreamedTurn``): every token kept and forwarded."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        budget: int,
        sink: TokenSink,
        stop: StopWatch | None,
    ):
        self._prompt_ids, self._params, self._budget, self._sink = prompt_ids, params, budget, sink
        self.stop = stop  # ends the turn at the token completing a stop string (None: no stops)
        self.pieces = TurnPieces()
        self._last: TokenOutput | None = None  # the last piece kept

    def remaining(self) -> int:
        return self._budget - len(self.pieces.tokens)

    def request(self) -> tuple[list[int], dict[str, Any]]:
        """A (new) try goes on after the tokens sent, its seed moved on by their count."""
        start = len(self.pieces.tokens)
        params = {**self._params, "max_tokens": self.remaining()}
        if start and params.get("seed") is not None:
            params["seed"] = (int(params["seed"]) + start) % SEED_MODULUS
        return self._prompt_ids + self.pieces.tokens, params

    async def take(self, delta: TokenOutput) -> None:
        kept = self.stop.scan(list(delta.token_ids)) if self.stop is not None else None
        if kept is not None:  # the tokens up to the stop string's last; the rest dropped
            logprobs = delta.log_probs[:kept] if delta.log_probs is not None else None
            delta = delta.model_copy(
                update={"token_ids": list(delta.token_ids[:kept]), "log_probs": logprobs}
            )
        self.pieces.add(delta)
        self._last = delta
        if delta.token_ids:
            await self._sink(list(delta.token_ids))
        if kept is not None:
            raise StopMatchedError  # ends the replica's stream: the request is cut

    def stopped_at(self) -> TokenOutput:
        """The last piece as the end of a turn that stopped at a stop string."""
        assert self._last is not None and self.stop is not None, "a stop string was sampled"
        extra = {**self._last.extra_fields, "finish_reason": "stop"}
        extra[STOP_FIELD] = self.stop.matched
        return self._last.model_copy(update={"stop_reason": "completed", "extra_fields": extra})

    async def aborted(self) -> bool:
        return self.remaining() > 0


async def _unsent(token_ids: list[int]) -> None:
    """The sink of an unstreamed request's turn: its tokens go out whole at the end."""
