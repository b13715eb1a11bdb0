"""The HTTP request bodies the replica accepts: the vLLM and SGLang subsets, validated.

Unknown fields are ignored, as vLLM does; fields whose non-default values we cannot
honour (``n > 1``, ``stream``, ``echo``, stop strings...) are rejected with a message
that names them, so a client never silently gets something other than it asked for.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rolloutbus.replica.generation import MAX_TOP_LOGPROBS

__all__ = [
    "CompletionBody",
    "GenerateBody",
    "GenerateSamplingParams",
    "SGLangGenerateBody",
    "SGLangSamplingParams",
    "describe_validation_error",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _unsupported(name: str, value: Any, default: Any, hint: str = "") -> None:
    if value not in (None, default):
        raise ValueError(f"{name}={value!r} is not supported by the embedded replica{hint}")


class CompletionBody(_Body):
    """vLLM ``CompletionRequest`` subset (``POST /v1/completions``)."""

    model: str | None = None
    prompt: Any  # token ids, [token ids] or text; checked by _one_prompt for clear messages
    max_tokens: int | None = Field(default=16, ge=1)  # None: up to max_model_len
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    return_weight_versions: bool | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    request_id: str | None = None
    priority: int = 0  # accepted for vLLM parity; the embedded engine serves FIFO
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None
    use_beam_search: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> list[int] | str:
        if isinstance(prompt, str):
            return prompt
        if not isinstance(prompt, list):
            raise ValueError(f"must be a list of token ids or a string, got {type(prompt).__name__}")
        if prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported (send one request per prompt)")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must hold at least one token id")
        bad = [p for p in prompt if not isinstance(p, int) or isinstance(p, bool)]
        if bad:
            raise ValueError(f"token ids must be integers, got {bad[:3]!r}")
        return prompt

    @model_validator(mode="after")
    def _supported(self) -> CompletionBody:
        _unsupported("n", self.n, 1, "; send n requests")
        _unsupported("best_of", self.best_of, 1)
        _unsupported("stream", self.stream, False)
        _unsupported("echo", self.echo, False)
        _unsupported("prompt_logprobs", self.prompt_logprobs, None)
        _unsupported("use_beam_search", self.use_beam_search, False)
        if self.stop:
            raise ValueError("stop strings are not supported by the embedded replica; use stop_token_ids")
        return self


class GenerateSamplingParams(_Body):
    """vLLM ``SamplingParams`` subset."""

    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int = 1
    prompt_logprobs: int | None = None
    stop: str | list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> GenerateSamplingParams:
        _unsupported("sampling_params.n", self.n, 1, "; send n requests")
        _unsupported("sampling_params.prompt_logprobs", self.prompt_logprobs, None)
        if self.stop:
            raise ValueError("stop strings are not supported by the embedded replica; use stop_token_ids")
        return self


class GenerateBody(_Body):
    """vLLM ``GenerateRequest`` subset (``POST /inference/v1/generate``)."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    request_id: str | None = None
    model: str | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _supported(self) -> GenerateBody:
        _unsupported("stream", self.stream, False)
        return self


class SGLangSamplingParams(_Body):
    max_new_tokens: int | None = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    sampling_seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stop: str | list[str] | None = None

    @model_validator(mode="after")
    def _supported(self) -> SGLangSamplingParams:
        _unsupported("sampling_params.n", self.n, 1, "; send n requests")
        if self.stop:
            raise ValueError("stop strings are not supported by the embedded replica; use stop_token_ids")
        return self


class SGLangGenerateBody(_Body):
    """SGLang ``GenerateReqInput`` subset (``POST /generate``)."""

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    rid: str | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _supported(self) -> SGLangGenerateBody:
        _unsupported("stream", self.stream, False)
        return self


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """('field 'x': problem; ...', first field name) for an HTTP 400 body."""
    parts, first = [], None
    for err in exc.errors():
        loc = _drop_union_tags(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"field '{loc}': {message}" if loc else message)
        first = first or loc or None
    return "; ".join(dict.fromkeys(parts)), first


def _drop_union_tags(loc: tuple[Any, ...]) -> str:
    # pydantic adds the union member ("list[int]") to the location; the client never wrote it.
    keep = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "int"}))]
    return ".".join(keep)


class UpdateWeightVersionBody(_Body):
    """vLLM's ``POST /update_weight_version`` body."""

    new_version: int | str
