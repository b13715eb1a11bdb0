"""A turn's result in OpenAI's shapes: a chat completion, a text completion, or the chunks of
a streamed chat completion.

Streaming is buffered: the turn is sampled whole (the turn log records whole turns), then
sent as server-sent events an SDK's stream reader takes, one chunk with the text, one per
tool call, one with the finish reason, optionally one with the usage, then ``[DONE]``.
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
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    TextCompletion,
    TokenLogprob,
    ToolCall,
    Usage,
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


def chat_chunks(completion: ChatCompletion, include_usage: bool) -> Iterator[bytes]:
    """The completion as server-sent ``chat.completion.chunk`` events, then ``[DONE]``."""
    choice = completion.choices[0]
    head = {
        "id": completion.id,
        "object": "chat.completion.chunk",
        "created": completion.created,
        "model": completion.model,
    }
    message = choice.message
    yield _event({**head, "choices": [_delta({"role": "assistant", "content": message.content})]})
    for index, call in enumerate(message.tool_calls or []):
        delta = {"tool_calls": [{"index": index, **call.model_dump()}]}
        yield _event({**head, "choices": [_delta(delta)]})
    logprobs = choice.logprobs.model_dump() if choice.logprobs else None
    final = _delta({}, finish_reason=choice.finish_reason, logprobs=logprobs)
    yield _event({**head, "choices": [final]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": completion.usage.model_dump()})
    yield b"data: [DONE]\n\n"


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
