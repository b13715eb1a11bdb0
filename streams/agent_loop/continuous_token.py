"""Continuous Token (CT): observation tokens from the incremental chat template.

An agent loop's token stream is append-only: the prompt, then each assistant turn exactly
as the replica sampled it (never decoded and re-encoded), then each observation. An
observation is rendered without touching the history:

1. render a synthetic prefix ``[system, user, assistant-with-tool_calls]``;
2. render the same prefix plus the new tool/user/system messages, with the generation
   prompt;
3. the observation is the token suffix of (2) after (1) — the prefix must be a token
   prefix, else the template is not append-only here and we raise;
4. in front of it go the *boundary tokens*: the part of the template's end-of-turn
   (Qwen: ``<|im_end|>\\n``) that the model did not sample. Qwen's models stop at
   ``<|im_end|>``, so the boundary is the ``\\n`` that a full render has after it
   (verl #6501 / PR #6921). Boundary tokens are not actions: mask 0, logprob 0.0.

Where Qwen3's template itself is not append-only (so no incremental stream can equal a
full re-render), see ``tests/agent_loop/test_continuous_token.py``:

- an assistant turn *before the last real user query* loses its ``<think>…</think>``
  block in a full render;
- the *last* assistant turn gets ``<think>\\n\\n</think>\\n\\n`` inserted in a full render
  when the model emitted no think block;
- a full render ends with ``<|im_end|>\\n``; the stream ends where the model stopped.

The stream is right and the re-render is wrong in each case: the stream is what the
policy saw and sampled.

verl's runtime API is here too, with its names: ``build_initial_tokens``,
``merge_assistant_tokens``, ``merge_context_tokens`` (verl 0.9.1; verl main of 2026-08-22
calls it ``merge_non_assistant_tokens``, and its merge kind ``"non_assistant"``: both
names are here) returning a ``MergeResult``, and ``align_response_metadata``, with verl's
edge cases and messages: an empty append adds nothing but the rest of an end-of-turn the
model stopped inside (verl's Qwen builder: the ``\\n`` after a sampled ``<|im_end|>``),
an unknown merge kind is a ValueError, and so is a missing ``assistant_logprobs``.

One builder serves every chat template: verl picks a builder per HF ``model_type`` (its
Qwen builder inserts ``\\n`` after a sampled ``<|im_end|>``; its default builder inserts
nothing), this one derives the boundary from the template itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rolloutbus.errors import AgentLoopError

OBSERVATION_ROLES = frozenset({"tool", "user", "system"})
# verl lets a context append carry an assistant message too, if it is not the last one
CONTEXT_ROLES = OBSERVATION_ROLES | {"assistant"}

MergeKind = Literal["assistant", "context", "non_assistant"]
# the kinds that append observation tokens: verl 0.9.1's "context", verl main's name
_CONTEXT_KINDS = frozenset({"context", "non_assistant"})


@dataclass(frozen=True)
class MergeResult:
    """verl's merge result: the new stream and the edits made at the junction.

    ``inserted_token_ids`` are boundary tokens the builder added (mask 0, logprob 0.0);
    ``appended_token_count`` counts the appended assistant or context tokens after them;
    ``removed_prefix_token_count`` is always 0 here (no builder trims the stream).
    """

    token_ids: list[int]
    appended_token_count: int
    kind: MergeKind = "context"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


_NOOP_TOOL = "rolloutbus_noop"
_SYNTHETIC_PREFIX: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi."},
    {
        "role": "assistant",
        "content": "",
        # Qwen3 renders the LAST assistant turn with a think block, earlier ones without
        # unless they carry reasoning: with reasoning the prefix renders the same either way.
        "reasoning_content": "Calling a tool.",
        "tool_calls": [{"type": "function", "function": {"name": _NOOP_TOOL, "arguments": {}}}],
    },
]
_END_PROBE = "Rolloutbus end-of-turn probe."


def render_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and encode the text."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ObservationTokens:
    """The tokens one observation appends to the stream; all get mask 0 and logprob 0.0."""

    boundary_ids: list[int] = field(default_factory=list)  # closes the assistant turn
    message_ids: list[int] = field(default_factory=list)  # the messages + generation prompt

    @property
    def token_ids(self) -> list[int]:
        return self.boundary_ids + self.message_ids


class ContinuousTokenBuilder:
    """Template-diff CT builder; works for any chat template that renders messages in order.

    One instance per tokenizer (the end-of-turn tokens are computed once).
    """

    def __init__(
        self,
        tokenizer: Any,
        processor: Any = None,
        *,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ):
        self.tokenizer = tokenizer
        self.processor = processor  # renders multimodal prompts (a VL model's processor)
        # verl's data.apply_chat_template_kwargs: every render of the template gets them
        self.template_kwargs = template_kwargs
        self.chat_template_kwargs = template_kwargs  # verl's attribute name
        # verl's data.mm_processor_kwargs: every processor call gets them (a constant of
        # the builder's life, so the first prompt and later renders expand media alike)
        self.mm_processor_kwargs = dict(mm_processor_kwargs or {})
        self.end_of_turn_ids = self._end_of_turn_ids()

    # ---- verl's runtime API ------------------------------------------------------------

    def supports_multimodal(self) -> bool:
        """Images/videos render through the processor, so only with one."""
        return self.processor is not None

    def build_initial_tokens(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        images: list[Any] | None = None,
        videos: list[Any] | None = None,
        audios: list[Any] | None = None,
        mm_inputs_out: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt with the generation prompt (no length cap: the loop applies it)."""
        if audios:
            raise AgentLoopError("audio inputs are not supported")
        if self.processor is None:
            return render_ids(
                self.tokenizer,
                messages,
                tools=tools,
                add_generation_prompt=True,
                **self.template_kwargs,
            )
        text = self.processor.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **self.template_kwargs,
        )
        processor_kwargs = {"return_tensors": "pt", **self.mm_processor_kwargs}
        inputs = self.processor(
            text=[text], images=images or None, videos=videos or None, **processor_kwargs
        )
        if mm_inputs_out is not None:
            mm_inputs_out.update({k: v for k, v in inputs.items() if k != "input_ids"})
        first = inputs["input_ids"][0]
        return first.tolist() if hasattr(first, "tolist") else list(first)

    def merge_assistant_tokens(
        self, runtime_token_ids: list[int], assistant_token_ids: list[int]
    ) -> MergeResult:
        """Sampled tokens are appended verbatim: never decoded and re-encoded."""
        return MergeResult(
            token_ids=list(runtime_token_ids) + list(assistant_token_ids),
            appended_token_count=len(assistant_token_ids),
            kind="assistant",
        )

    def merge_context_tokens(
        self,
        previous_messages: list[dict[str, Any]],
        updated_messages: list[dict[str, Any]],
        runtime_token_ids: list[int],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> MergeResult:
        """Append the messages ``updated_messages`` adds to ``previous_messages``.

        The history must be append-only (verl raises ValueError otherwise; so does this,
        as ``ContextNotAppendOnlyError``). ``tools`` does not change the suffix of a chat
        template that renders tools in the system prompt, so it is not re-rendered. No new
        message appends nothing, except the rest of an end-of-turn the stream stopped
        inside (as verl's Qwen builder adds the ``\n`` after a sampled ``<|im_end|>``).
        """
        appended = _appended_messages(previous_messages, updated_messages)
        if not appended:
            boundary = self._rest_of_end_of_turn(runtime_token_ids)
            return MergeResult(
                token_ids=list(runtime_token_ids) + boundary,
                appended_token_count=0,
                kind="context",
                inserted_token_ids=boundary,
            )
        observation = self.observation(runtime_token_ids, appended)
        return MergeResult(
            token_ids=list(runtime_token_ids) + observation.token_ids,
            appended_token_count=len(observation.message_ids),
            kind="context",
            inserted_token_ids=list(observation.boundary_ids),
        )

    def merge_non_assistant_tokens(
        self,
        previous_messages: list[dict[str, Any]],
        updated_messages: list[dict[str, Any]],
        runtime_token_ids: list[int],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> MergeResult:
        """verl main's name of ``merge_context_tokens`` (merge kind ``"non_assistant"``)."""
        merge = self.merge_context_tokens(
            previous_messages, updated_messages, runtime_token_ids, tools=tools
        )
        return replace(merge, kind="non_assistant")

    @staticmethod
    def align_response_metadata(
        merge_result: MergeResult,
        response_mask: list[int],
        response_logprobs: list[float] | None = None,
        *,
        assistant_logprobs: list[float] | None = None,
    ) -> tuple[list[int], list[float] | None]:
        """verl's alignment: boundary and context tokens get mask 0 and logprob 0.0,
        assistant tokens mask 1 and their logprobs (whose count must match)."""
        mask = list(response_mask)
        logprobs = list(response_logprobs) if response_logprobs is not None else None
        if logprobs is None and assistant_logprobs is not None:
            raise ContinuousTokenError(
                "response_logprobs is required when assistant_logprobs is provided"
            )
        if merge_result.removed_prefix_token_count:
            mask = mask[: -merge_result.removed_prefix_token_count]
            if logprobs is not None:
                logprobs = logprobs[: -merge_result.removed_prefix_token_count]
        mask += [0] * len(merge_result.inserted_token_ids)
        if logprobs is not None:
            logprobs += [0.0] * len(merge_result.inserted_token_ids)
        count = merge_result.appended_token_count
        if merge_result.kind == "assistant":
            mask += [1] * count
            if logprobs is not None:
                logprobs += _assistant_logprobs(assistant_logprobs, count)
        elif merge_result.kind in _CONTEXT_KINDS:
            mask += [0] * count
            if logprobs is not None:
                logprobs += [0.0] * count
        else:
            raise ContinuousTokenError(
                f"Unknown Continuous Token merge kind: {merge_result.kind!r}"
            )
        return mask, logprobs

    def _end_of_turn_ids(self) -> list[int]:
        """What the template writes after an assistant message's content (Qwen: <|im_end|>\\n)."""
        messages = [*_SYNTHETIC_PREFIX[:2], {"role": "assistant", "content": _END_PROBE}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **self.template_kwargs)
        tail = text[text.rindex(_END_PROBE) + len(_END_PROBE) :]
        return list(self.tokenizer.encode(tail, add_special_tokens=False))

    def _rest_of_end_of_turn(self, stream_ids: list[int]) -> list[int]:
        """What completes an end-of-turn the stream stopped inside; [] when it stopped
        elsewhere (an empty append then adds nothing, as verl's builders)."""
        end = self.end_of_turn_ids
        for k in range(len(end) - 1, 0, -1):
            if stream_ids[-k:] == end[:k]:
                return end[k:]
        return []

    def boundary_ids(self, stream_ids: list[int]) -> list[int]:
        """The end-of-turn tokens the model did not sample.

        The longest start of the end-of-turn sequence that the stream already ends with
        stays as sampled; the rest is added. A model stopped at <|im_end|> gets "\\n"; a
        turn cut off mid-text gets the whole "<|im_end|>\\n", as a full render would have.
        """
        end = self.end_of_turn_ids
        for k in range(len(end), 0, -1):
            if stream_ids[-k:] == end[:k]:
                return end[k:]
        return list(end)

    @functools.cached_property
    def _prefix_text(self) -> str:
        """The synthetic prefix rendered: the same text for every observation of this
        builder (its tokenizer and template kwargs are fixed), so rendered once (issue 28:
        about a quarter of an observation's CPU)."""
        return str(
            self.tokenizer.apply_chat_template(
                _SYNTHETIC_PREFIX, tokenize=False, **self.template_kwargs
            )
        )

    def _suffix_ids(self, new_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens that ``new_messages`` + the generation prompt add after the synthetic prefix.

        Usually the prefix text is a plain prefix of the longer render. Qwen3 re-renders the
        synthetic assistant turn when a *user* message follows (it drops the think block
        of turns before the last user query), so then the suffix is found after the
        prefix's end-of-turn anchor instead. Either way the suffix must also be a token
        suffix of the full render, or we raise.
        """
        prefix_text = self._prefix_text
        full_text = self.tokenizer.apply_chat_template(
            [*_SYNTHETIC_PREFIX, *new_messages],
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )
        if full_text.startswith(prefix_text):
            suffix_text = full_text[len(prefix_text) :]
        else:
            anchor = prefix_text[prefix_text.rindex(_NOOP_TOOL) :]
            start = full_text.find(anchor, full_text.find(_NOOP_TOOL))
            if start < 0:
                raise AgentLoopError(
                    "the chat template is not append-only: new messages changed how the turn "
                    "before them renders"
                )
            suffix_text = full_text[start + len(anchor) :]
        full = list(self.tokenizer.encode(full_text, add_special_tokens=False))
        suffix = list(self.tokenizer.encode(suffix_text, add_special_tokens=False))
        if not suffix or full[-len(suffix) :] != suffix:
            raise AgentLoopError(
                "the chat template is not append-only: the new messages merge with the tokens "
                "before them"
            )
        return suffix

    def observation(
        self, stream_ids: list[int], new_messages: list[dict[str, Any]]
    ) -> ObservationTokens:
        """Boundary + rendered ``new_messages`` + generation prompt, to append to ``stream_ids``."""
        if not new_messages:
            raise AgentLoopError("an observation needs at least one message")
        roles = [m.get("role") for m in new_messages]
        for role in roles:  # verl's checks and messages
            if role not in CONTEXT_ROLES:
                raise ContextNotAppendOnlyError(
                    f"Continuous Token only supports appending roles {sorted(CONTEXT_ROLES)}, "
                    f"got {role!r}"
                )
        if roles[-1] == "assistant":
            raise ContextNotAppendOnlyError(
                "Continuous Token context incremental messages cannot end with assistant"
            )
        message_ids = self._suffix_ids(new_messages)
        return ObservationTokens(
            boundary_ids=self.boundary_ids(stream_ids), message_ids=message_ids
        )


def _assistant_logprobs(given: list[float] | None, count: int) -> list[float]:
    """The logprobs of ``count`` appended assistant tokens, checked as verl checks them."""
    if given is None:
        if count:
            raise ContinuousTokenError(
                "assistant_logprobs is required for assistant Continuous Token alignment"
            )
        return []
    if len(given) != count:
        raise ContinuousTokenError(
            "assistant_logprobs length must match appended assistant token count, "
            f"got {len(given)} and {count}"
        )
    return list(given)


class ContinuousTokenError(AgentLoopError, ValueError):
    """A Continuous Token merge that cannot be done (verl raises ValueError)."""


class ContextNotAppendOnlyError(ContinuousTokenError):
    """The messages are not an append to the history."""


def _appended_messages(
    previous: list[dict[str, Any]], updated: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if len(updated) < len(previous):
        raise ContextNotAppendOnlyError(
            "Continuous Token messages must be append-only; updated_messages is shorter"
        )
    if updated[: len(previous)] != previous:
        raise ContextNotAppendOnlyError(
            "Continuous Token messages must be append-only; prefix messages changed"
        )
    return updated[len(previous) :]


_BuilderKey = tuple[int, int, str, str]
_builders: dict[_BuilderKey, ContinuousTokenBuilder] = {}


def get_builder(
    tokenizer: Any,
    processor: Any = None,
    *,
    mm_processor_kwargs: dict[str, Any] | None = None,
    **template_kwargs: Any,
) -> ContinuousTokenBuilder:
    """A cached builder per (tokenizer, processor, template kwargs, processor kwargs)."""
    key = (
        id(tokenizer),
        id(processor),
        _kwargs_key(template_kwargs),
        _kwargs_key(mm_processor_kwargs),
    )
    builder = _builders.get(key)
    if builder is None or builder.tokenizer is not tokenizer or builder.processor is not processor:
        builder = _builders[key] = ContinuousTokenBuilder(
            tokenizer, processor, mm_processor_kwargs=mm_processor_kwargs, **template_kwargs
        )
    return builder


def _kwargs_key(kwargs: dict[str, Any] | None) -> str:
    return repr(sorted((kwargs or {}).items(), key=lambda item: item[0]))
