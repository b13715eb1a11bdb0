"""A turn's result in OpenAI's shapes: a chat completion, a text completion, or the chunks of
a streamed chat completion.

A streamed one sends its text as it is sampled (``streaming.py``), the rest when the turn
is logged.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rolloutbus.streams.gateway.session import TurnResult
from rolloutbus.streams.gateway.wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    TextCompletion,
    TokenLogprob,
    ToolCall,
    Usage,
    error_body,
)


def chat_completion(
    result: TurnResult, *, model: str, tokenizer: Any, logprobs: bool, token_ids: bool
) -> ChatCompletion:
    reply = result.reply
    message = AssistantMessage(
        content=reply.content if reply.content or not reply.tool_calls else None,
        tool_calls=[ToolCall.model_validate(c) for c in reply.tool_calls] or None,
    )
    choice = ChatChoice(
        message=message,
        finish_reason=reply.finish_reason,  # type: ignore[arg-type]  # stop/length/tool_calls
        logprobs=_chat_logprobs(result, tokenizer) if logprobs else None,
        token_ids=list(result.token_ids) if token_ids else None,
    )
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=[choice],
        usage=_usage(result),
        prompt_token_ids=list(result.prompt_ids) if token_ids else None,
    )


def text_completion(
    result: TurnResult, *, model: str, tokenizer: Any, logprobs: bool, token_ids: bool
) -> TextCompletion:
    choice = CompletionChoice(
        text=tokenizer.decode(result.token_ids, skip_special_tokens=True),
        finish_reason=result.reply.finish_reason,  # type: ignore[arg-type]  # never tool_calls
        logprobs=_text_logprobs(result, tokenizer) if logprobs else None,
        token_ids=list(result.token_ids) if token_ids else None,
        prompt_token_ids=list(result.prompt_ids) if token_ids else None,
    )
    return TextCompletion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=model,
        choices=[choice],
        usage=_usage(result),
    )


class ChatChunks:
    """A streamed chat completion's ``chat.completion.chunk`` events (``SseWire``): the role,
    the text as it comes, then what is left of it, one chunk per tool call, the finish
    reason (with the turn's logprobs), optionally the usage, then ``[DONE]``."""

    def __init__(self, model: str, tokenizer: Any, request: ChatCompletionRequest):
        self._model = model
        self._head: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._tokenizer, self._request = tokenizer, request
        options = (request.model_extra or {}).get("stream_options") or {}
        self._include_usage = bool(options.get("include_usage"))

    def opening(self) -> Iterator[bytes]:
        yield self._chunk(_delta({"role": "assistant", "content": ""}))

    def text(self, delta: str) -> Iterator[bytes]:
        yield self._chunk(_delta({"content": delta}))

    def closing(self, result: TurnResult, rest: str) -> Iterator[bytes]:
        completion = chat_completion(
            result,
            model=self._model,
            tokenizer=self._tokenizer,
            logprobs=bool(self._request.logprobs),
            token_ids=self._request.return_token_ids,
        )
        choice = completion.choices[0]
        if rest:
            yield from self.text(rest)
        for index, call in enumerate(choice.message.tool_calls or []):
            yield self._chunk(_delta({"tool_calls": [{"index": index, **call.model_dump()}]}))
        logprobs = choice.logprobs.model_dump() if choice.logprobs else None
        yield self._chunk(_delta({}, finish_reason=choice.finish_reason, logprobs=logprobs))
        if self._include_usage:
            yield _event({**self._head, "choices": [], "usage": completion.usage.model_dump()})
        yield b"data: [DONE]\n\n"

    def error(self, message: str, status: int) -> Iterator[bytes]:
        yield _event(error_body(message, "api_error" if status >= 500 else "invalid_request_error"))

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return _event({**self._head, "choices": [choice]})


def _delta(delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None, **fields}


def _event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _usage(result: TurnResult) -> Usage:
    prompt, completion = len(result.prompt_ids), len(result.token_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _token_texts(result: TurnResult, tokenizer: Any) -> list[str]:
    return [tokenizer.decode([token]) for token in result.token_ids]


def _logprob_values(result: TurnResult) -> list[float]:
    return list(result.logprobs) if result.logprobs is not None else [0.0] * len(result.token_ids)


def _chat_logprobs(result: TurnResult, tokenizer: Any) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))
            for text, value in zip(
                _token_texts(result, tokenizer), _logprob_values(result), strict=True
            )
        ]
    )


def _text_logprobs(result: TurnResult, tokenizer: Any) -> CompletionLogprobs:
    texts = _token_texts(result, tokenizer)
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return CompletionLogprobs(
        tokens=texts, token_logprobs=_logprob_values(result), text_offset=offsets
    )
