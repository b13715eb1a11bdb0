"""The inference engines' wire formats: one vocabulary for both ends of the HTTP call.

The LLM client (``streams/inference/backends.py``) builds requests and reads responses
with these models; the embedded replica (``replica/server.py``) reads the same
requests and writes the same responses. They describe the subset of each API that Rollout
Bus speaks, token ids in and token ids out:

- vLLM ``POST /v1/completions``: ``VllmCompletionRequest`` → ``VllmCompletionResponse``
- vLLM ``POST /inference/v1/generate``: ``VllmGenerateRequest`` → ``VllmGenerateResponse``
- SGLang ``POST /generate``: ``SglangGenerateRequest`` → ``SglangGenerateResponse``
- vLLM ``POST /update_weight_version``: ``UpdateWeightVersionRequest``

The sampling fields every engine takes under the same name are declared once, in
``SamplingFields``; each API adds its own names for the rest (``max_tokens`` or
``max_new_tokens``, ``seed`` or ``sampling_seed``). ``TurnSamplingParams`` is what an
agent loop asks of one ``generate()`` call, before it is spelled for an engine.

Strict by default: every model forbids fields it does not declare, so a request with a
misspelt or unknown field fails naming it, on whichever side builds or receives it. A
response from a real engine carries fields we do not name (each vLLM release adds some),
so a client reads one with ``read_response``, which ignores them (pydantic's per-call
``extra="ignore"``, applied to the nested models too). Defaults are the engine's own:
what an absent field means. ``to_json()`` sends exactly the fields that were set.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "SamplingFields",
    "SglangGenerateRequest",
    "SglangGenerateResponse",
    "SglangMetaInfo",
    "SglangSamplingParams",
    "TurnSamplingParams",
    "UpdateWeightVersionRequest",
    "Usage",
    "VllmCompletionChoice",
    "VllmCompletionLogprobs",
    "VllmCompletionRequest",
    "VllmCompletionResponse",
    "VllmGenerateChoice",
    "VllmGenerateLogprob",
    "VllmGenerateLogprobs",
    "VllmGenerateRequest",
    "VllmGenerateResponse",
    "VllmGenerateSamplingParams",
    "VllmSamplingFields",
    "VllmTopLogprob",
    "WeightVersionSpan",
    "WireModel",
    "read_response",
]

Wire = TypeVar("Wire", bound="WireModel")


class WireModel(BaseModel):
    """A body on the wire, under the engine's field names; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> dict[str, Any]:
        """The JSON body: the fields that were set, nothing filled in from defaults."""
        return self.model_dump(exclude_unset=True)


def read_response(model: type[Wire], body: Any) -> Wire:
    """An engine's response, tolerating fields we do not name (newer engines add more)."""
    return model.model_validate(body, extra="ignore")


# --------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------


class SamplingFields(WireModel):
    """The sampling fields vLLM and SGLang both take under these names, with their defaults."""

    temperature: float = Field(default=1.0, ge=0.0)  # 0: greedy
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # -1 (or 0): no top-k, as in verl, vLLM and SGLang
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] | None = None  # besides the model's eos
    ignore_eos: bool = False


class TurnSamplingParams(SamplingFields):
    """The ``sampling_params`` dict an agent loop passes to ``generate()``, validated.

    verl's loops pass temperature, top_p, top_k, repetition_penalty and logprobs; the
    rest are optional. Unknown keys are an error that names the key, never silently
    dropped sampling settings. Backend-neutral: each backend spells it for its engine.
    """

    model_config = ConfigDict(populate_by_name=True)

    # True: return the sampled token's logprob. vLLM's int form is accepted too (0 means
    # "the sampled token only", which is what we return for any int).
    logprobs: bool = False
    # tokens; an upper bound for this turn, on top of the trajectory budget.
    max_tokens: int | None = Field(
        default=None, ge=1, validation_alias=AliasChoices("max_tokens", "max_new_tokens")
    )
    seed: int | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int_logprobs_mean_requested(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value >= 0
        return value


class VllmSamplingFields(SamplingFields):
    """vLLM's ``SamplingParams`` subset: top-level in a completion request, nested in generate."""

    max_tokens: int | None = Field(default=16, ge=1)  # tokens; None: up to the context length
    seed: int | None = None  # None: a fresh random seed per request
    logprobs: int | None = Field(default=None, ge=0)  # alternatives per token; 0: the sampled one
    # Fields a turn never sends; declared so a server can refuse what it cannot honour.
    n: int = 1
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None  # stop strings


class SglangSamplingParams(SamplingFields):
    """SGLang's ``sampling_params``: its own names for the budget and the seed."""

    max_new_tokens: int | None = Field(default=128, ge=1)  # tokens; None: up to the context length
    sampling_seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None  # stop strings


# --------------------------------------------------------------------------------------
# Shared response pieces
# --------------------------------------------------------------------------------------


class WeightVersionSpan(WireModel):
    """Which policy version sampled output tokens ``start`` to ``end`` (vLLM's RL field)."""

    version: str | int | None = None
    start: int | None = None
    end: int | None = None


class Usage(WireModel):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0


class UpdateWeightVersionRequest(WireModel):
    """vLLM's ``POST /update_weight_version`` body: the trainer's step after a weight update."""

    new_version: int | str


# --------------------------------------------------------------------------------------
# vLLM POST /v1/completions
# --------------------------------------------------------------------------------------


class VllmCompletionRequest(VllmSamplingFields):
    """vLLM's ``CompletionRequest`` with one prompt (token ids, or text)."""

    model: str | None = None
    prompt: list[int] | str
    request_id: str | None = None
    priority: int = 0  # lower is served first
    return_token_ids: bool | None = None  # choices[0].token_ids, exactly as sampled (>= 0.10.2)
    return_tokens_as_token_ids: bool | None = None  # logprobs.tokens as "token_id:123"
    return_weight_versions: bool | None = None  # choices[0].weight_versions: which policy sampled
    skip_special_tokens: bool = True  # in the returned text
    stream: bool = False
    # Fields a turn never sends; declared so a server can refuse what it cannot honour.
    best_of: int | None = None
    echo: bool = False
    use_beam_search: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> list[int] | str:
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list):
            raise ValueError(
                f"must be a list of token ids or a string, got {type(prompt).__name__}"
            )
        if prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise ValueError(
                    "only one prompt per request is supported (send one request per prompt)"
                )
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must hold at least one token id")
        # the usual prompt, all plain ints, checked at C speed: this runs on every turn over
        # the whole context (a Python test per id was ~36 ns, 150 us at 4k tokens; issue 28)
        if not set(map(type, prompt)) <= {int}:
            bad = [p for p in prompt if not isinstance(p, int) or isinstance(p, bool)]
            if bad:
                raise ValueError(f"token ids must be integers, got {bad[:3]!r}")
        token_ids: list[int] = prompt  # every item checked above
        return token_ids


class VllmCompletionLogprobs(WireModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class VllmCompletionChoice(WireModel):
    index: int = 0
    text: str = ""
    logprobs: VllmCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token (or string) that ended it
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None
    routed_experts: str | None = None  # base64 .npy bytes (MoE routing replay)
    weight_versions: list[WeightVersionSpan] | None = None
    num_preempted: int | None = None  # not in vLLM; the embedded replica may report it


class VllmCompletionResponse(WireModel):
    id: str | None = None
    object: str = "text_completion"
    created: int | None = None
    model: str | None = None
    choices: list[VllmCompletionChoice] = Field(min_length=1)
    usage: Usage | None = None
    system_fingerprint: str | None = None


# --------------------------------------------------------------------------------------
# vLLM POST /inference/v1/generate (vLLM >= 0.12; `vllm serve --enable-scale-out` since 0.30)
# --------------------------------------------------------------------------------------


class VllmGenerateSamplingParams(VllmSamplingFields):
    detokenize: bool = True  # False: tokens only, which works on a --tokens-only server too


class VllmGenerateRequest(WireModel):
    """vLLM's token-in/token-out ``GenerateRequest``."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmGenerateSamplingParams = Field(default_factory=VllmGenerateSamplingParams)
    request_id: str | None = None
    model: str | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False
    priority: int = 0  # lower is served first
    # vLLM's raw media for the prompt's placeholder tokens, in prompt order per modality:
    # [{"type": "image_url", "url": ...}]; vLLM resolves the URLs (its own field and type)
    content_parts: list[dict[str, Any]] | None = None


class VllmTopLogprob(WireModel):
    token_id: int
    logprob: float


class VllmGenerateLogprob(VllmTopLogprob):
    """The sampled token at one position, with its top alternatives when asked for."""

    top_logprobs: list[VllmTopLogprob] | None = None


class VllmGenerateLogprobs(WireModel):
    content: list[VllmGenerateLogprob] | None = None


class VllmGenerateChoice(WireModel):
    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: VllmGenerateLogprobs | None = None
    routed_experts: str | None = None  # base64 .npy bytes (MoE routing replay)
    weight_versions: list[WeightVersionSpan] | None = None
    num_preempted: int | None = None  # not in vLLM; the embedded replica may report it


class VllmGenerateResponse(WireModel):
    request_id: str | None = None
    model: str | None = None
    created: int | None = None
    choices: list[VllmGenerateChoice] = Field(min_length=1)
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None


# --------------------------------------------------------------------------------------
# SGLang POST /generate
# --------------------------------------------------------------------------------------


class SglangGenerateRequest(WireModel):
    """SGLang's ``GenerateReqInput`` with ``input_ids``."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: logprobs of the output tokens only
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False


class SglangMetaInfo(WireModel):
    id: str | None = None
    # {"type": "stop"|"length"|"abort", ...}; a bare string is accepted too
    finish_reason: dict[str, Any] | str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    e2e_latency: float | None = None  # seconds
    # [[logprob, token_id, text-or-null], ...]
    output_token_logprobs: list[list[Any]] | None = None
    input_token_logprobs: list[Any] | None = None
    weight_version: str | int | None = None
    num_preempted: int | None = None  # not in SGLang; the embedded replica may report it


class SglangGenerateResponse(WireModel):
    text: str = ""
    output_ids: list[int]
    meta_info: SglangMetaInfo = Field(default_factory=SglangMetaInfo)
