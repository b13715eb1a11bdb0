"""The gateway's HTTP bodies: OpenAI's chat and text completions (the subset an agent's SDK
sends), and the session endpoints of the bus.

A request field the gateway cannot honour is an error that names it (HTTP 400), never
silently dropped: ``n`` over 1, stop strings on text completions, ``response_format``, a
forced ``tool_choice``, ``top_logprobs``, audio (a chat completion's ``stop`` strings are
found by the gateway as the replica streams: ``stops.py``). Fields that only describe the
caller (``user``, ``metadata``, ``store``...) are accepted and unused. Sampling fields
(``temperature``, ``top_p``, ...) are accepted and not applied: the session samples with
its group's logged sampling parameters, because the trainer's importance ratios assume
them; the response names what it did not apply in the ``X-Rolloutbus-Ignored`` header
(docs/gateway.md).
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rolloutbus.schemas.prompts import GroupSamplingParams
from rolloutbus.schemas.tokens import INT32_MAX

IGNORED_HEADER = "X-Rolloutbus-Ignored"  # request fields the turn did not apply
SESSION_HEADER = "X-Session-Id"  # names the session on /v1/... paths without one

# caller-describing fields OpenAI SDKs and agent frameworks send; they change nothing here
_INERT_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "parallel_tool_calls",
        "stream_options",
        "reasoning_effort",
        "verbosity",
        "echo",
        "suffix",
        "best_of",
    }
)
# sampling fields the session's group decides (see the module docstring)
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


class _Request(BaseModel):
    """Unknown fields are kept (``extra``) so the error can name them."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    logprobs: bool | int | None = None
    return_token_ids: bool = False  # vLLM's extra: the prompt's and the reply's token ids
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> str | None:
        """Why the gateway cannot answer this request as asked; None when it can."""
        unknown = sorted(set(self.model_extra or {}) - _INERT_FIELDS)
        if unknown:
            return f"unsupported request fields: {', '.join(unknown)}"
        if self.n not in (None, 1):
            return "n must be 1: a session is one trajectory (open a group of n sessions)"
        return None

    def stop_strings(self) -> list[str] | None:
        """``stop`` as a list (OpenAI takes one string or several)."""
        if not self.stop:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def turn_max_tokens(self) -> int | None:
        """The caller's cap on this turn's tokens (on top of the session's budget)."""
        caps = [c for c in (self.max_tokens, self.max_completion_tokens) if c is not None]
        return min(caps) if caps else None

    def ignored_sampling(self, session: GroupSamplingParams) -> list[str]:
        """The sampling fields set to something other than the session samples with."""
        logged = session.model_dump()
        return [
            name
            for name in SAMPLING_FIELDS
            if getattr(self, name) is not None and getattr(self, name) != logged.get(name)
        ]


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        problem = super().unsupported()
        if problem:
            return problem
        if self.tool_choice not in (None, "auto"):
            return (
                "tool_choice must be 'auto': the model's calls are parsed from what it "
                "samples, so neither a forced call nor 'none' can be enforced"
            )
        if self.top_logprobs:
            return "top_logprobs is not supported (the engines return the sampled token's only)"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format is not supported (no constrained decoding)"
        if self.audio or (self.modalities and self.modalities != ["text"]):
            return "only text output is supported"
        if self.prediction:
            return "predicted outputs are not supported"
        return None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    def unsupported(self) -> str | None:
        problem = super().unsupported()
        if problem is None and self.stop:
            return "stop strings are supported on chat completions and messages only"
        return problem

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            if len(self.prompt) != 1:
                raise ValueError("prompt: one prompt per request (a session is one trajectory)")
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text, or token ids (a batch of one unwrapped, checked above)."""
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        return cast(str | list[int], prompt)


# -- responses ---------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolCallFunction(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob]


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int] = Field(default_factory=list)
    top_logprobs: list[Any] | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class TextCompletion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- sessions ----------------------------------------------------------------------------


class OpenSessionsRequest(BaseModel):
    """``POST /v1/sessions``: one prompt group of ``n`` sessions (GRPO's group)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    n: int | None = Field(default=None, ge=1, le=INT32_MAX)  # None: rollout.n
    uid: str | None = None  # None: a fresh one
    # the dataset row the trajectories carry (data_source, reward_model, extra_info, an
    # optional prompt); its reward_model lets the scorer reward a session that finishes
    # without a reward of its own
    row: dict[str, Any] = Field(default_factory=dict)
    validate_: bool = Field(default=False, alias="validate")
    sampling_params: GroupSamplingParams | None = None  # None: rollout.* (or val_kwargs)
    global_steps: int | None = Field(default=None, ge=0)  # None: the current policy's step
    policy_version: int | None = Field(default=None, ge=0)  # None: the current version


class OpenedSession(_Response):
    session_id: int
    id: str  # the session's key {uid}_{session_id}: the path segment of its URLs
    base_url: str  # an OpenAI SDK's base_url for this session


class OpenedSessions(_Response):
    uid: str
    n: int
    sessions: list[OpenedSession]


class FinishRequest(BaseModel):
    """``POST /v1/sessions/{id}/finish``: the agent's reward, or none to let the row's
    scorer compute it from the final text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reward: float | None = None
    extra_fields: dict[str, Any] = Field(default_factory=dict)  # into every output's


class AbortRequest(BaseModel):
    """``POST /v1/sessions/{id}/abort``: the agent gave up; the session is a failed record."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error: str = "aborted by the agent"


class SessionStatus(_Response):
    id: str
    uid: str
    session_id: int
    attempt: str
    state: Literal["open", "finished", "failed"]
    segments: int
    turns: int
    tokens: int


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its SDKs turn into exceptions carrying the message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
