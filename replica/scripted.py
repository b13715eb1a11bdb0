"""A TEST DOUBLE engine: it answers with scripted token ids, not a model.

Served by the same HTTP server as the real engine, so an LLM client cannot tell them
apart except by ``GET /v1/models`` (``owned_by: "scripted-test-double"``). Tests of
tool-calling agents use it because the small real models cannot emit tool calls; fault
tests use ``hang()`` and ``fail()``.

Its control surface is scripted too: ``pause``/``resume`` hold and abort calls as the real
engine does, but ``reload_weights`` only checks that the folder exists and records it in
``reloads`` (there are no weights to load).

``routed_experts=(layers, top_k)`` makes it answer as a MoE engine started for routing
replay (verl's R3): every token it "fed through the model" (the prompt and the sampled
tokens but the last) gets scripted experts, ``scripted_expert(token, layer, k)``, a pure
function of the token id, so a test can tell which token each row belongs to.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutbus.errors import ReplicaError
from rolloutbus.replica.generation import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    RequestRejectedError,
    Timings,
    VersionSpan,
    WeightsRejectedError,
)
from rolloutbus.replica.pause_gate import PauseGate

__all__ = ["ScriptedEngine", "ScriptedTurn", "scripted_expert"]

SCRIPTED_OWNER = "scripted-test-double"
DEFAULT_LOGPROB = -0.5  # a plausible, non-zero logprob when the script gives none


@dataclass(frozen=True)
class ScriptedTurn:
    """What one generate() call returns; ``logprobs`` defaults to DEFAULT_LOGPROB each."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    # None: "stop" if the last token is a stop/eos, else "length"
    finish_reason: FinishReason | None = None


Script = Iterable[ScriptedTurn | list[int]] | Callable[[list[int]], ScriptedTurn | list[int]]


@dataclass
class ScriptedEngine:
    """Returns scripted tokens per call: from a list consumed in order, or a callable of the
    prompt ids."""

    script: Script
    token_delay_s: float = 0.0  # seconds per output token, to look like a decode
    tokenizer: Any = None  # optional: lets the server fill in ``text``
    model_name: str = "scripted"
    max_model_len: int = 4096
    eos_token_ids: frozenset[int] = frozenset()
    owned_by: str = SCRIPTED_OWNER
    stats: EngineStats = field(default_factory=EngineStats)
    calls: list[GenerationRequest] = field(default_factory=list)  # every request, in order
    weight_version: int | str = 0
    reloads: list[str] = field(default_factory=list)  # weights_path of each reload_weights
    routed_experts: tuple[int, int] | None = None  # (layers, top_k): answer as a MoE engine

    def __post_init__(self) -> None:
        self._turns = None if callable(self.script) else iter(list(self.script))
        self._fault: str | None = None
        self._fault_message = ""
        self._release = asyncio.Event()
        self._running = False
        self._gate = PauseGate()
        self._abort: asyncio.Event | None = None
        self._decoding = 0  # calls inside their token delay

    # -- control surface (as the real engine's, without weights) -----------------------

    @property
    def is_paused(self) -> bool:
        return self._gate.is_paused

    @property
    def pause_gate(self) -> PauseGate:
        return self._gate

    async def pause(self, mode: PauseMode = "abort", lease_s: float | None = None) -> None:
        self._gate.close(mode, lease_s)
        if mode == "abort" and self._abort is not None:
            self._abort.set()  # calls in their token delay end now with the tokens so far
        while mode == "wait" and self._decoding:
            await asyncio.sleep(0.005)  # seconds; a scripted call ends within its delay

    async def resume(self) -> None:
        self._gate.open()

    async def reload_weights(self, weights_path: str) -> None:
        self._gate.require_paused(weights_path)
        if not Path(weights_path).is_dir():
            raise WeightsRejectedError(
                f"weights_path {weights_path!r} is not a folder on the replica"
            )
        self.reloads.append(weights_path)
        self._gate.reload_finished(weights_path)

    # -- faults for tests ---------------------------------------------------------------

    def hang(self) -> None:
        """Calls from now on wait until ``recover()`` (or until the client gives up)."""
        self._fault = "hang"
        self._release = asyncio.Event()

    def fail(self, message: str = "scripted failure") -> None:
        """Calls from now on raise ReplicaError (HTTP 500) and /health answers 503."""
        self._fault, self._fault_message = "fail", message

    def recover(self) -> None:
        self._fault = None
        self._release.set()

    # -- the Engine interface -----------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._running and self._fault != "fail"

    def start(self) -> None:
        self._running = True

    def stop(self) -> None:
        self._running = False
        self._release.set()

    async def submit(self, request: GenerationRequest) -> GenerationResult:
        if len(request.prompt_ids) + request.max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(request.prompt_ids)} prompt tokens + max_tokens {request.max_tokens} "
                "exceed it"
            )
        self.calls.append(request)
        start = asyncio.get_running_loop().time()
        await self._apply_fault()
        await self._gate.wait_open()  # held until /resume, as vLLM
        turn = self._next_turn(request.prompt_ids)
        self.stats.running += 1
        try:
            turn = await self._decode(turn, request.max_tokens)
        finally:
            self.stats.running -= 1
        return self._result(request, turn, asyncio.get_running_loop().time() - start)

    async def _decode(self, turn: ScriptedTurn, max_tokens: int) -> ScriptedTurn:
        """Wait the turn's token delay; a pause in mode abort cuts it at the tokens so far."""
        if not self.token_delay_s:
            return turn
        n = min(len(turn.token_ids), max_tokens)
        loop = asyncio.get_running_loop()
        self._abort = self._abort or asyncio.Event()
        abort, started = self._abort, loop.time()
        self._decoding += 1
        try:
            async with asyncio.timeout(self.token_delay_s * n):
                await abort.wait()
        except TimeoutError:
            return turn  # decoded to the end
        finally:
            self._decoding -= 1
            if self._decoding == 0 and abort.is_set():
                self._abort = None
        done = min(n, math.floor((loop.time() - started) / self.token_delay_s))
        logprobs = turn.logprobs[:done] if turn.logprobs else None
        return ScriptedTurn(list(turn.token_ids[:done]), logprobs, finish_reason="abort")

    async def _apply_fault(self) -> None:
        if self._fault == "hang":
            await self._release.wait()
        if self._fault == "fail":
            raise ReplicaError(f"{self.model_name}: {self._fault_message}")

    def _next_turn(self, prompt_ids: list[int]) -> ScriptedTurn:
        if self._turns is None:
            turn = self.script(prompt_ids)  # type: ignore[operator]
        else:
            try:
                turn = next(self._turns)
            except StopIteration:
                raise ReplicaError(
                    f"{self.model_name}: the script has no turn left for call {len(self.calls)}"
                ) from None
        return turn if isinstance(turn, ScriptedTurn) else ScriptedTurn(token_ids=list(turn))

    def _result(
        self, request: GenerationRequest, turn: ScriptedTurn, elapsed: float
    ) -> GenerationResult:
        token_ids = list(turn.token_ids[: request.max_tokens])
        logprobs = (
            list(turn.logprobs[: len(token_ids)])
            if turn.logprobs
            else [DEFAULT_LOGPROB] * len(token_ids)
        )
        stops = set(request.stop_token_ids) | (
            set() if request.ignore_eos else set(self.eos_token_ids)
        )
        for i, token in enumerate(token_ids):  # a stop token ends the turn, as in a real decode
            if token in stops:
                token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                break
        last = token_ids[-1] if token_ids else None
        reason: FinishReason = turn.finish_reason or (
            "stop" if last in stops or len(token_ids) < request.max_tokens else "length"
        )
        self.stats.prompt_tokens += len(request.prompt_ids)
        self.stats.generation_tokens += len(token_ids)
        self.stats.batch_sizes[1] += 1
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=last if last in request.stop_token_ids else None,
            timings=Timings(ttft_s=elapsed, e2e_s=elapsed),
            weight_versions=[VersionSpan(version=self.weight_version, start=0, end=len(token_ids))]
            if token_ids
            else [],
            routed_experts=self._routed_experts(list(request.prompt_ids) + token_ids[:-1]),
        )

    def _routed_experts(self, fed: list[int]) -> list[list[list[int]]] | None:
        if self.routed_experts is None:
            return None
        layers, top_k = self.routed_experts
        return [
            [[scripted_expert(t, layer, k) for k in range(top_k)] for layer in range(layers)]
            for t in fed
        ]


SCRIPTED_NUM_EXPERTS = 64  # experts per layer of the pretend MoE model


def scripted_expert(token_id: int, layer: int, k: int) -> int:
    """The expert the scripted MoE engine routes ``token_id`` to at ``layer``, slot ``k``."""
    return (token_id * 7 + layer * 5 + k * 11) % SCRIPTED_NUM_EXPERTS
