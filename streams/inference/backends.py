"""The inference engines' HTTP APIs: one request builder and one response parser each.

Everything here is pure (no I/O), so each backend is tested without a server and checked
against vLLM's own pydantic protocol models (``tests/contract/``). The wire models come
from ``rolloutbus.schemas.inference``, the same ones the embedded replica serves; requests
are built strictly (an unknown field is a bug here), responses are read with
``read_response``, which ignores fields we do not name, so a newer engine still parses.

- ``vllm_completions``: vLLM's OpenAI-compatible ``POST /v1/completions`` with a
  token-id prompt, ``return_token_ids`` (vLLM >= 0.10.2) and ``logprobs: 0``.
- ``vllm_generate``: vLLM's token-in/token-out ``POST /inference/v1/generate``
  (vLLM >= 0.12; opt-in with ``vllm serve --enable-scale-out`` since 0.30); the one backend
  that sends a turn's images (vLLM's ``content_parts``, with each image's placeholder run
  collapsed to one pad in ``token_ids``, since vLLM expands it itself). The others raise
  ``ImagesNotSupportedError`` for a call with images instead of dropping them.
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
from typing import Any, ClassVar, Protocol

from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.schemas.control import as_policy_version
from rolloutbus.schemas.inference import (
    SglangGenerateRequest,
    SglangGenerateResponse,
    SglangSamplingParams,
    TurnSamplingParams,
    VllmCompletionChoice,
    VllmCompletionRequest,
    VllmCompletionResponse,
    VllmGenerateChoice,
    VllmGenerateRequest,
    VllmGenerateResponse,
    VllmGenerateSamplingParams,
    WeightVersionSpan,
    read_response,
)
from rolloutbus.streams.inference.multimodal import (
    ImagesNotSupportedError,
    vllm_content_parts,
    vllm_token_prompt,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "EngineCall",
    "SglangGenerateBackend",
    "VllmCompletionsBackend",
    "VllmGenerateBackend",
    "backend_for",
    "error_message",
    "map_finish_reason",
]


@dataclass(frozen=True)
class EngineCall:
    """One HTTP generate call: the prompt tokens and the resolved per-turn settings."""

    engine_request_id: str  # fresh per turn; the trajectory id only drives stickiness
    prompt_ids: list[int]
    sampling: TurnSamplingParams
    max_tokens: int  # already resolved by the client from the trajectory budget
    model: str | None = None
    priority: int = 0  # vLLM only; sent only when non-zero, as verl does
    # the turn's images as URLs, in prompt order (``multimodal.image_urls``); only
    # vllm_generate sends them, the other backends refuse a call that has any
    image_urls: tuple[str, ...] = ()


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


def _extra_fields(
    finish_reason: str | None, weight_version: Any, span_versions: list[Any] | None = None
) -> dict[str, Any]:
    """``weight_version``: the version that sampled the last token; verl's
    ``min_global_steps``/``max_global_steps``: the oldest and newest version that sampled
    any token of the turn (they differ when the weights changed mid-turn, under a
    ``pause?mode=keep`` weight sync)."""
    extra: dict[str, Any] = {"finish_reason": finish_reason}
    if weight_version is not None:
        extra["weight_version"] = weight_version
    versions = [
        v for v in map(as_policy_version, span_versions or [weight_version]) if v is not None
    ]
    if versions:
        extra["min_global_steps"], extra["max_global_steps"] = min(versions), max(versions)
    return extra


def _check_logprob_count(token_ids: list[int], log_probs: list[float] | None) -> None:
    if log_probs is not None and len(log_probs) != len(token_ids):
        raise ValueError(f"{len(token_ids)} token ids but {len(log_probs)} logprobs")


def _present(**fields: Any) -> dict[str, Any]:
    """The fields to send: a None here means "not sent", so the engine's default applies."""
    return {key: value for key, value in fields.items() if value is not None}


def _shared_sampling(s: TurnSamplingParams) -> dict[str, Any]:
    """The sampling fields every engine takes under the same name (``SamplingFields``)."""
    return _present(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
    )


def _vllm_sampling(call: EngineCall) -> dict[str, Any]:
    """``_shared_sampling`` plus vLLM's budget, seed and logprobs fields."""
    s = call.sampling
    return {
        "max_tokens": call.max_tokens,
        **_shared_sampling(s),
        **_present(seed=s.seed, logprobs=0 if s.logprobs else None),  # 0: the sampled token's only
    }


def _vllm_request_fields(call: EngineCall) -> dict[str, Any]:
    """Optional request fields: the model when named, the priority when non-zero (as verl)."""
    return _present(model=call.model, priority=call.priority or None)


def _refuse_images(backend: str, call: EngineCall) -> None:
    """A token-only backend never drops a turn's images silently (the client checks first;
    this guards a backend used on its own)."""
    if call.image_urls:
        raise ImagesNotSupportedError(
            f"backend {backend!r} takes token ids only and cannot send the turn's "
            f"{len(call.image_urls)} image(s); use replicas.backend 'vllm_generate'"
        )


def _vllm_token_output(
    choice: VllmCompletionChoice | VllmGenerateChoice,
    token_ids: list[int],
    log_probs: list[float] | None,
) -> TokenOutput:
    """Both vLLM endpoints' choices carry the same fields around the tokens."""
    return TokenOutput(
        token_ids=token_ids,
        log_probs=log_probs,
        routed_experts=_decode_routed_experts(choice.routed_experts),
        stop_reason=map_finish_reason(choice.finish_reason),
        num_preempted=choice.num_preempted,
        extra_fields=_extra_fields(
            choice.finish_reason,
            _last_weight_version(choice.weight_versions),
            [span.version for span in choice.weight_versions or []],
        ),
    )


def _last_weight_version(spans: list[WeightVersionSpan] | None) -> Any:
    """The version that sampled the last token: what a turn is stamped with."""
    return spans[-1].version if spans else None


# --------------------------------------------------------------------------------------
# vLLM POST /v1/completions
# --------------------------------------------------------------------------------------


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
        _refuse_images(self.name, call)
        return VllmCompletionRequest(
            prompt=list(call.prompt_ids),
            **_vllm_sampling(call),
            return_token_ids=True,  # choices[0].token_ids, exactly as sampled
            return_tokens_as_token_ids=True,  # logprobs.tokens as "token_id:123" (older vLLM)
            return_weight_versions=True,  # choices[0].weight_versions: which policy sampled
            request_id=call.engine_request_id,
            stream=False,
            **_vllm_request_fields(call),
        ).to_json()

    def build_stream_request(self, call: EngineCall) -> dict[str, Any]:
        """The same request, streamed: server-sent events of the tokens as sampled."""
        return {**self.build_request(call), "stream": True}

    def parse_stream_event(self, body: Any) -> TokenOutput:
        """One streamed completion chunk: its new tokens, and the finish reason on the last
        (``stop_reason`` None until then)."""
        return self.parse_response({"choices": [{}], **body})

    def parse_response(self, body: Any) -> TokenOutput:
        choice = read_response(VllmCompletionResponse, body).choices[0]
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
            raise ValueError(
                "response has no token ids (needs vLLM >= 0.10.2 for return_token_ids)"
            )
        _check_logprob_count(token_ids, log_probs)
        return _vllm_token_output(choice, token_ids, log_probs)


# --------------------------------------------------------------------------------------
# vLLM POST /inference/v1/generate
# --------------------------------------------------------------------------------------


class VllmGenerateBackend:
    name: ClassVar[str] = "vllm_generate"
    path: ClassVar[str] = "/inference/v1/generate"

    def build_request(self, call: EngineCall) -> dict[str, Any]:
        return VllmGenerateRequest(
            request_id=call.engine_request_id,
            # images: each placeholder run unexpanded, as vLLM expands it itself
            token_ids=vllm_token_prompt(list(call.prompt_ids), len(call.image_urls)),
            sampling_params=VllmGenerateSamplingParams(
                **_vllm_sampling(call),
                detokenize=False,  # tokens only: works on a --tokens-only server too
            ),
            output_mode="tokens",
            stream=False,
            **_vllm_request_fields(call),
            # vLLM pairs the parts with the prompt's image placeholder tokens, in order
            **_present(content_parts=vllm_content_parts(list(call.image_urls)) or None),
        ).to_json()

    def parse_response(self, body: Any) -> TokenOutput:
        choice = read_response(VllmGenerateResponse, body).choices[0]
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


class SglangGenerateBackend:
    name: ClassVar[str] = "sglang"
    path: ClassVar[str] = "/generate"

    def build_request(self, call: EngineCall) -> dict[str, Any]:
        _refuse_images(self.name, call)
        s = call.sampling
        return SglangGenerateRequest(
            rid=call.engine_request_id,
            input_ids=list(call.prompt_ids),
            sampling_params=SglangSamplingParams(
                max_new_tokens=call.max_tokens,
                **_shared_sampling(s),
                **_present(sampling_seed=s.seed),
            ),
            return_logprob=s.logprobs,  # SGLang's way of asking for logprobs
            logprob_start_len=-1,  # -1: logprobs of the output tokens only
            top_logprobs_num=0,
            return_text_in_logprobs=False,
            stream=False,
        ).to_json()

    def parse_response(self, body: Any) -> TokenOutput:
        response = read_response(SglangGenerateResponse, body)
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
