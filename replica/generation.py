"""What an engine is asked and what it answers: one token-in/token-out generation.

Both engines (the torch ``DecodeEngine`` and the ``ScriptedEngine`` test double) take a
``GenerationRequest`` and return a ``GenerationResult``; the HTTP server translates the
vLLM and SGLang request shapes into these and back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.errors import ReplicaError
from rolloutbus.replica.pause_gate import EngineNotPausedError, PauseGate, PauseMode

__all__ = [
    "Engine",
    "EngineNotPausedError",
    "EngineSampling",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "PauseMode",
    "RequestRejectedError",
    "Timings",
    "VersionSpan",
    "WeightsRejectedError",
    "check_request_fits",
]

FinishReason = Literal["stop", "length", "abort"]
# PauseMode and EngineNotPausedError live in pause_gate, with the pause (re-exported here).
MAX_TOP_LOGPROBS = 20  # vLLM's --max-logprobs default


class RequestRejectedError(ReplicaError, ValueError):
    """The request itself is wrong (too long, bad token id): the client's mistake, an HTTP 400."""


class WeightsRejectedError(ReplicaError, ValueError):
    """A weight folder that cannot be loaded into the running model (missing, wrong names or
    shapes): the caller's mistake, an HTTP 400; the served weights are left unchanged."""


class EngineSampling(BaseModel):
    """How the engine samples one request's tokens (the server maps each API's fields here)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 or 0 = off (vLLM: -1; SGLang: -1 / 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class GenerationRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    request_id: str
    prompt_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    sampling: EngineSampling = Field(default_factory=EngineSampling)
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: list[int] = Field(default_factory=list)  # besides the model's eos
    ignore_eos: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per step


class Timings(BaseModel):
    """Seconds, measured inside the engine (monotonic clock)."""

    queue_s: float = 0.0  # submit -> prefill starts
    ttft_s: float = 0.0  # submit -> first token sampled
    e2e_s: float = 0.0  # submit -> finished


class VersionSpan(BaseModel):
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``."""

    model_config = ConfigDict(frozen=True)

    version: int | str
    start: int
    end: int


class GenerationResult(BaseModel):
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    # Log-probability of each sampled token after temperature / top-k / top-p
    # (vLLM's processed_logprobs); the plain log_softmax for greedy requests.
    logprobs: list[float]
    # One {token_id: logprob} per step when top_logprobs > 0, else None.
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason
    stop_reason: int | None = None  # the stop token that ended it, when not the eos
    timings: Timings = Field(default_factory=Timings)
    # Which weight version sampled which tokens, as vLLM's weight_versions: one span per
    # version in order; a version change while the request ran (pause mode "keep") splits it.
    weight_versions: list[VersionSpan] = Field(default_factory=list)
    # MoE routed experts (tokens fed through the model, layers, top_k), as vLLM returns
    # them for routing replay; only the scripted test double fills it (no MoE model here)
    routed_experts: list[list[list[int]]] | None = None


@dataclass
class EngineStats:
    """Counters an engine keeps for /metrics; read without a lock (ints are atomic)."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0  # the embedded engine never preempts; kept for vLLM parity
    batch_sizes: Counter[int] = field(default_factory=Counter)  # decode-step batch size -> steps

    @property
    def max_batch_size_seen(self) -> int:
        return max(self.batch_sizes, default=0)


def check_request_fits(request: GenerationRequest, max_model_len: int, vocab_size: int) -> None:
    """RequestRejectedError, saying what is wrong, unless ``request`` fits a model of this
    context length and vocabulary (checked in the caller's thread, before it is queued)."""
    prompt_len = len(request.prompt_ids)
    if prompt_len + request.max_tokens > max_model_len:
        raise RequestRejectedError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{prompt_len} prompt tokens + max_tokens {request.max_tokens} = "
            f"{prompt_len + request.max_tokens}; shorten the prompt or lower max_tokens"
        )
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejectedError(f"prompt token ids must lie in [0, {vocab_size}); got {bad[:5]}")


def version_spans(starts: list[tuple[int | str, int]], num_tokens: int) -> list[VersionSpan]:
    """Spans from (version, first token index) pairs, as vLLM's ``_weight_version_spans``.
    A request that ends before its first token (aborted or cancelled in the queue) has none."""
    if not starts:
        return []
    ends = [start for _, start in starts[1:]] + [num_tokens]
    return [VersionSpan(version=v, start=s, end=e) for (v, s), e in zip(starts, ends, strict=True)]


@runtime_checkable
class Engine(Protocol):
    """What the HTTP server needs from an engine.

    The control surface mirrors vLLM's RL API (dev mode): ``pause``/``resume``/``is_paused``,
    ``reload_weights`` (``POST /collective_rpc {"method": "reload_weights"}``) and the weight
    version stamped on every sampled token (``POST /update_weight_version``).
    """

    model_name: str
    owned_by: str
    max_model_len: int
    stats: EngineStats
    weight_version: int | str  # stamped on tokens sampled from now on

    @property
    def is_paused(self) -> bool: ...

    @property
    def pause_gate(self) -> PauseGate:
        """The pause state: mode, since when, its lease, reloads not yet labelled."""
        ...

    async def pause(self, mode: PauseMode = "abort", lease_s: float | None = None) -> None:
        """Stop admitting requests; abort, drain or freeze running ones (per ``mode``);
        return once that is done. Requests submitted meanwhile wait for ``resume()``.
        ``lease_s``: the pause ends by itself that long after the last pause or renewal
        (see ``pause_gate``); None: it lasts until ``resume()``."""
        ...

    async def resume(self) -> None: ...

    async def reload_weights(self, weights_path: str) -> None:
        """Load a folder of safetensors into the running model (paused engines only)."""
        ...

    @property
    def tokenizer(self): ...  # may be None: the server then returns empty text

    @property
    def healthy(self) -> bool: ...

    async def submit(self, request: GenerationRequest) -> GenerationResult: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...
