"""Wire formats of the inference engines: one request builder and one response parser each.

Everything here is pure (no I/O), so each backend is tested without a server and checked
against vLLM's own pydantic protocol models (``tests/contract/``). The pydantic models
below describe only the subset of each wire format that Rollout Bus sends or reads;
responses ignore fields they do not name, so a newer engine that adds fields still parses.

- ``vllm_completions``: vLLM's OpenAI-compatible ``POST /v1/completions`` with a
  token-id prompt, ``return_token_ids`` (vLLM >= 0.10.2) and ``logprobs: 0``.
- ``vllm_generate``: vLLM's token-in/token-out ``POST /inference/v1/generate``
  (vLLM >= 0.12; opt-in with ``vllm serve --enable-scale-out`` since 0.30).
- ``sglang``: SGLang's native ``POST /generate`` with ``input_ids``.

A parser raises ``ValueError`` (pydantic's ``ValidationError`` is one) when a response does
not hold what a turn needs; the LLM client turns that into a ``ReplicaError`` naming the
replica, at one boundary.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from rolloutbus.schemas.agent_loop import TokenOutput

__all__ = [
    "BACKENDS",
    "Backend",
    "EngineCall",
    "SamplingParams",
    "SglangGenerateBackend",
    "VllmCompletionsBackend",
    "VllmGenerateBackend",
    "backend_for",
    "error_message",
    "map_finish_reason",
]


# --------------------------------------------------------------------------------------
# What the client asks for, backend-neutral
# --------------------------------------------------------------------------------------


class SamplingParams(BaseModel):
    """The ``sampling_params`` dict an agent loop passes to ``generate()``, validated.

    verl's loops pass temperature, top_p, top_k, repetition_penalty and logprobs; the
    rest are optional. Unknown keys are an error that names the key, never silently
    dropped sampling settings.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k, as in verl and vLLM
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # True: return the sampled token's logprob. vLLM's int form is accepted too (0 means
    # "the sampled token only", which is what we return for any int).
    logprobs: bool = False
    # tokens; an upper bound for this turn, on top of the trajectory budget.
    max_tokens: int | None = Field(
        default=None, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens")
    )
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int_logprobs_mean_requested(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value >= 0
        return value


@dataclass(frozen=True)
class EngineCall:
    """One HTTP generate call: the prompt tokens and the resolved per-turn settings."""

    engine_request_id: str  # fresh per turn; the trajectory id only drives stickiness
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # already resolved by the client from the trajectory budget
    model: str | None = None
    priority: int = 0  # vLLM only; sent only when non-zero, as verl does


class Backend(Protocol):
    name: ClassVar[str]
    path: ClassVar[str]

    def build_request(self, call: EngineCall) -> dict[str, Any]: ...

    def parse_response(self, body: Any) -> TokenOutput: ...


def map_finish_reason(reason: str | None) -> str | None:
    """verl's mapping: abort -> "aborted"; stop and length -> "completed"; others kept."""
    if reason == "abort":
        return "aborted"
    if reason in ("stop", "length"):
        return "completed"
    return reason


def error_message(text: str, limit: int = 500) -> str:
    """The human part of an engine's error body (vLLM, SGLang and FastAPI shapes)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:limit]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:limit]
        for key in ("message", "detail", "error"):
            if body.get(key):
                return str(body[key])[:limit]
    return text[:limit]


def _decode_routed_experts(encoded: str | None) -> Any:
    """vLLM sends routed experts as base64 ``.npy`` bytes; hand the array on."""
    if encoded is None:
        return None
    import numpy as np  # only MoE routing replay needs it

    try:
        return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise ValueError(f"routed_experts is not base64 .npy data: {exc}") from exc


def _extra_fields(finish_reason: str | None, weight_version: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"finish_reason": finish_reason}
    if weight_version is not None:
        extra["weight_version"] = weight_version
    return extra


def _check_logprob_count(token_ids: list[int], log_probs: list[float] | None) -> None:
    if log_probs is not None and len(log_probs) != len(token_ids):
        raise ValueError(f"{len(token_ids)} token ids but {len(log_probs)} logprobs")


class _Wire(BaseModel):
    """A request on the wire: field names are the engine's; None fields are not sent."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class _WireResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _WeightVersionSpan(_WireResponse):
    version: str | int | None = None
    start: int | None = None
    end: int | None = None


def _vllm_sampling(s: SamplingParams) -> dict[str, Any]:
    """The sampling fields every backend sends, under vLLM's names."""
    return {
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "seed": s.seed,
        "stop_token_ids": s.stop_token_ids, "ignore_eos": s.ignore_eos,
        "logprobs": 0 if s.logprobs else None,  # 0: only the sampled token's logprob
    }


def _vllm_token_output(choice: Any, token_ids: list[int], log_probs: list[float] | None) -> TokenOutput:
    """Both vLLM endpoints' choices carry the same fields around the tokens."""
    return TokenOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        routed_experts=_decode_routed_experts(choice.routed_experts),
        stop_reason=map_finish_reason(choice.finish_reason),
        num_preempted=choice.num_preempted,
        extra_fields=_extra_fields(choice.finish_reason, _last_weight_version(choice.weight_versions)),
    )


def _last_weight_version(spans: list[_WeightVersionSpan] | None) -> Any:
    """The version that sampled the last token: what a turn is stamped with."""
    return spans[-1].version if spans else None


# --------------------------------------------------------------------------------------
# vLLM POST /v1/completions
# --------------------------------------------------------------------------------------


class VllmCompletionRequest(_Wire):
    model: str | None = None
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool
    logprobs: int | None = None  # 0: the sampled token's logprob, nothing more
    return_token_ids: bool = True  # choices[0].token_ids, exactly as sampled
    return_tokens_as_token_ids: bool = True  # logprobs.tokens as "token_id:123"
    return_weight_versions: bool = True  # choices[0].weight_versions: which policy sampled
    request_id: str
    priority: int | None = None
    stream: bool = False


class VllmCompletionLogprobs(_WireResponse):
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)


class VllmCompletionChoice(_WireResponse):
    index: int = 0
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: VllmCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: str | None = None
    weight_versions: list[_WeightVersionSpan] | None = None
    num_preempted: int | None = None  # not in vLLM; the embedded replica may report it


class VllmCompletionResponse(_WireResponse):
    id: str | None = None
    model: str | None = None
    choices: list[VllmCompletionChoice] = Field(min_length=1)


def _token_ids_from_logprob_tokens(tokens: list[str]) -> list[int]:
    """``return_tokens_as_token_ids`` writes each sampled token as ``"token_id:123"``."""
    ids = []
    for token in tokens:
        prefix, _, number = token.partition(":")
        if prefix != "token_id" or not number.lstrip("-").isdigit():
            raise ValueError(f"logprobs token {token!r} is not of the form 'token_id:N'")
        ids.append(int(number))
    return ids


class VllmCompletionsBackend:
    name: ClassVar[str] = "vllm_completions"
    path: ClassVar[str] = "/v1/completions"

    def build_request(self, call: EngineCall) -> dict[str, Any]:
        return VllmCompletionRequest(
            model=call.model,
            prompt=list(call.prompt_ids),
            max_tokens=call.max_tokens,
            **_vllm_sampling(call.sampling),
            request_id=call.engine_request_id,
            priority=call.priority or None,
        ).to_json()

    def parse_response(self, body: Any) -> TokenOutput:
        choice = VllmCompletionResponse.model_validate(body).choices[0]
        log_probs = None
        if choice.logprobs is not None:
            if any(lp is None for lp in choice.logprobs.token_logprobs):
                raise ValueError("a sampled token has no logprob (null in token_logprobs)")
            log_probs = [float(lp) for lp in choice.logprobs.token_logprobs]  # type: ignore[arg-type]
        if choice.token_ids is not None:
            token_ids = choice.token_ids
        elif choice.logprobs is not None:
            # vLLM < 0.10.2 has no return_token_ids; the logprob tokens carry the ids.
            token_ids = _token_ids_from_logprob_tokens(choice.logprobs.tokens)
        else:
            raise ValueError("response has no token ids (needs vLLM >= 0.10.2 for return_token_ids)")
        _check_logprob_count(token_ids, log_probs)
        return _vllm_token_output(choice, token_ids, log_probs)


# --------------------------------------------------------------------------------------
# vLLM POST /inference/v1/generate
# --------------------------------------------------------------------------------------


class VllmGenerateSamplingParams(_Wire):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool
    logprobs: int | None = None
    detokenize: bool = False  # tokens only: works on a --tokens-only server too


class VllmGenerateRequest(_Wire):
    request_id: str
    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmGenerateSamplingParams
    model: str | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False
    priority: int | None = None


class VllmGenerateLogprob(_WireResponse):
    token_id: int
    logprob: float


class VllmGenerateLogprobs(_WireResponse):
    content: list[VllmGenerateLogprob] | None = None


class VllmGenerateChoice(_WireResponse):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: VllmGenerateLogprobs | None = None
    routed_experts: str | None = None
    weight_versions: list[_WeightVersionSpan] | None = None
    num_preempted: int | None = None  # not in vLLM; the embedded replica may report it


class VllmGenerateResponse(_WireResponse):
    request_id: str | None = None
    choices: list[VllmGenerateChoice] = Field(min_length=1)


class VllmGenerateBackend:
    name: ClassVar[str] = "vllm_generate"
    path: ClassVar[str] = "/inference/v1/generate"

    def build_request(self, call: EngineCall) -> dict[str, Any]:
        return VllmGenerateRequest(
            request_id=call.engine_request_id,
            token_ids=list(call.prompt_ids),
            sampling_params=VllmGenerateSamplingParams(
                max_tokens=call.max_tokens,
                **_vllm_sampling(call.sampling),
            ),
            model=call.model,
            priority=call.priority or None,
        ).to_json()

    def parse_response(self, body: Any) -> TokenOutput:
        choice = VllmGenerateResponse.model_validate(body).choices[0]
        log_probs = None
        if choice.logprobs is not None and choice.logprobs.content is not None:
            sampled = [entry.token_id for entry in choice.logprobs.content]
            if sampled != choice.token_ids:
                raise ValueError("logprobs.content token ids differ from choices[0].token_ids")
            log_probs = [entry.logprob for entry in choice.logprobs.content]
        return _vllm_token_output(choice, choice.token_ids, log_probs)


# --------------------------------------------------------------------------------------
# SGLang POST /generate
# --------------------------------------------------------------------------------------


class SglangSamplingParams(_Wire):
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    sampling_seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool


class SglangGenerateRequest(_Wire):
    rid: str
    input_ids: list[int] = Field(min_length=1)
    sampling_params: SglangSamplingParams
    return_logprob: bool
    logprob_start_len: int = -1  # -1: logprobs of the output tokens only
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class SglangMetaInfo(_WireResponse):
    id: str | None = None
    # {"type": "stop"|"length"|"abort", ...}; a bare string is accepted too
    finish_reason: dict[str, Any] | str | None = None
    # [[logprob, token_id, text-or-null], ...]
    output_token_logprobs: list[list[Any]] | None = None
    weight_version: str | int | None = None
    num_preempted: int | None = None  # not in SGLang; the embedded replica may report it


class SglangGenerateResponse(_WireResponse):
    output_ids: list[int]
    meta_info: SglangMetaInfo = Field(default_factory=SglangMetaInfo)


class SglangGenerateBackend:
    name: ClassVar[str] = "sglang"
    path: ClassVar[str] = "/generate"

    def build_request(self, call: EngineCall) -> dict[str, Any]:
        sampling = _vllm_sampling(call.sampling)
        del sampling["logprobs"]  # SGLang asks with return_logprob instead
        sampling["sampling_seed"] = sampling.pop("seed")  # SGLang's name for it
        return SglangGenerateRequest(
            rid=call.engine_request_id,
            input_ids=list(call.prompt_ids),
            sampling_params=SglangSamplingParams(max_new_tokens=call.max_tokens, **sampling),
            return_logprob=call.sampling.logprobs,
        ).to_json()

    def parse_response(self, body: Any) -> TokenOutput:
        response = SglangGenerateResponse.model_validate(body)
        meta = response.meta_info
        log_probs = None
        if meta.output_token_logprobs is not None:
            sampled = [int(entry[1]) for entry in meta.output_token_logprobs]
            if sampled != response.output_ids:
                raise ValueError("meta_info.output_token_logprobs token ids differ from output_ids")
            log_probs = [float(entry[0]) for entry in meta.output_token_logprobs]
        reason = meta.finish_reason
        if isinstance(reason, dict):
            reason = reason.get("type")
        return TokenOutput(
            token_ids=response.output_ids,
            log_probs=log_probs,
            stop_reason=map_finish_reason(reason),
            num_preempted=meta.num_preempted,
            extra_fields=_extra_fields(reason, meta.weight_version),
        )


BACKENDS: dict[str, type[Backend]] = {
    VllmCompletionsBackend.name: VllmCompletionsBackend,
    VllmGenerateBackend.name: VllmGenerateBackend,
    SglangGenerateBackend.name: SglangGenerateBackend,
}


def backend_for(name: str) -> Backend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
