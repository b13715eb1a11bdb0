"""Anthropic's Messages API on the gateway: ``POST .../v1/messages`` (docs/gateway.md).

A Messages request is translated into the chat messages and tools the OpenAI endpoint takes,
so both APIs share one session, one alignment with the turn log and one reply parser:

- ``system`` becomes the system message; a ``text`` block, text;
- an assistant's ``tool_use`` blocks become its ``tool_calls`` (the id kept, ``input`` as
  JSON arguments); a user's ``tool_result`` blocks become ``tool`` messages, in order,
  before the user's text;
- ``tools`` (``name``, ``description``, ``input_schema``) become function tools.

The reply goes back as content blocks: the text, then one ``tool_use`` per parsed call, with
the ids the OpenAI endpoint gives (``call_{turn}_{i}``: stable across a gateway restart,
since they come from the logged turn). ``stop_reason`` is ``end_turn``, ``tool_use``,
``max_tokens`` or ``stop_sequence`` (``stop_sequence`` then names the string matched): the
gateway finds ``stop_sequences`` as the replica streams and ends the turn at the token that
completes one, the text before it returned (``stops.py``). A field the gateway cannot honour
is a 400 that names it: a forced ``tool_choice``, image or document blocks.
Sampling fields are accepted and not applied, as on the OpenAI endpoint (the session samples
with its group's logged parameters; the ``X-Rolloutbus-Ignored`` header names them).

Thinking (``thinking: {"type": "enabled"}``), where the model's chat template has think
markers (Qwen3's ``<think>…</think>``): a reply that opens with ``<think>`` comes back as a
``thinking`` block (the reasoning inside the markers) and then the text and ``tool_use``
blocks; streamed, the reasoning comes as ``thinking_delta`` events. Where the prompt leaves
the think open (DeepSeek-R1's, QwQ's and Qwen3-thinking-2507's templates end the generation
prompt with ``<think>``), the reply starts inside its reasoning: the text up to ``</think>``
is the ``thinking`` block (``opens_thinking``). An assistant message's ``thinking`` block
in the history is rendered back into the text the model sampled (its ``signature`` keeps
the markup around the reasoning), so the history still extends the logged tokens. The
budget is not applied (the model thinks as it samples; the header names
``thinking.budget_tokens``), and whether the model thinks at all is the template's (the
session's ``chat_template_kwargs``). A template without think markers refuses thinking.

Streaming sends Anthropic's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``thinking_delta``, ``signature_delta``, ``text_delta`` or
``input_json_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``), the text
as it is sampled (``streaming.py``); the turn is logged whole, and a client that drops the
stream gets the same turn from the log when it retries.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rolloutbus.schemas.prompts import GroupSamplingParams
from rolloutbus.streams.gateway.session import TurnResult

__all__ = [
    "MessageEvents",
    "MessagesRequest",
    "Thought",
    "anthropic_error",
    "message_response",
    "opens_thinking",
    "split_thinking",
]

log = logging.getLogger(__name__)

# caller-describing fields Anthropic SDKs and harnesses send; they change nothing here
_INERT_FIELDS = frozenset({"metadata", "service_tier", "container", "mcp_servers", "betas"})
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3's (and DeepSeek-R1's) think markers
# tokens; the end of a prompt read for an open think marker: the marker and the whitespace
# after it, even where the tokenizer spells "<think>" in several tokens
PROMPT_END_TOKENS = 16
# how Qwen3's template lays an assistant's reasoning out: what a block without our signature
# is rendered back with
CANONICAL_HEAD, CANONICAL_TAIL = f"{THINK_OPEN}\n", f"\n{THINK_CLOSE}\n\n"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    502: "api_error",
    503: "overloaded_error",
}


class MessagesRequest(BaseModel):
    """The subset of Anthropic's ``POST /v1/messages`` body an agent sends; unknown fields
    are kept so that the error can name them."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = ""
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    thinking: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        """Why the gateway cannot answer this request as asked; None when it can."""
        unknown = sorted(set(self.model_extra or {}) - _INERT_FIELDS)
        if unknown:
            return f"unsupported request fields: {', '.join(unknown)}"
        if self.tool_choice and self.tool_choice.get("type") != "auto":
            return (
                "tool_choice must be {'type': 'auto'}: the model's calls are parsed from what "
                "it samples, so neither a forced call nor 'none' can be enforced"
            )
        if self.thinking and self.thinking.get("type") not in ("enabled", "disabled"):
            return "thinking.type must be 'enabled' or 'disabled'"
        return None

    @property
    def shows_thinking(self) -> bool:
        """The reply's reasoning comes back as a ``thinking`` block."""
        return (self.thinking or {}).get("type") == "enabled"

    def thinking_refused(self, chat_template: str | None) -> str | None:
        """Why thinking cannot be honoured with this chat template; None when it can (or
        when the request has no thinking)."""
        in_history = any(
            isinstance(m.get("content"), list)
            and any(isinstance(b, dict) and b.get("type") == "thinking" for b in m["content"])
            for m in self.messages
        )
        if not (self.shows_thinking or in_history) or THINK_CLOSE in (chat_template or ""):
            return None
        asked = "thinking" if self.shows_thinking else "a thinking block in the history"
        return (
            f"{asked} needs think markers ({THINK_OPEN}…{THINK_CLOSE}) in the model's chat "
            "template, and this model's template has none: its replies have no reasoning "
            "to split out, nor a place to render one back"
        )

    def ignored_sampling(self, session: GroupSamplingParams) -> list[str]:
        """The sampling fields set to something other than the session samples with."""
        logged = session.model_dump()
        ignored = [
            name
            for name in _SAMPLING_FIELDS
            if getattr(self, name) is not None and getattr(self, name) != logged.get(name)
        ]
        if self.shows_thinking and "budget_tokens" in (self.thinking or {}):
            ignored.append("thinking.budget_tokens")  # the model thinks as it samples
        return ignored

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as the OpenAI endpoint's messages (the module docstring)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _joined_text(self.system, "system")})
        for index, message in enumerate(self.messages):
            out += _chat_messages(message, f"messages[{index}]")
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        return [_function_tool(tool, f"tools[{i}]") for i, tool in enumerate(self.tools)]


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ValueError(f"{where}.role must be 'user' or 'assistant', got {role!r}")
    blocks = _blocks(message.get("content"), f"{where}.content")
    if role == "assistant":
        return [_assistant_message(blocks, where)]
    results = [
        _tool_message(b, f"{where}.content[{i}]")
        for i, b in enumerate(blocks)
        if b["type"] == "tool_result"
    ]
    texts = [b for b in blocks if b["type"] != "tool_result"]
    _only_text(texts, where)
    text = "".join(b["text"] for b in texts)
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    calls = [
        {
            "id": b.get("id") or f"toolu_{i}",
            "type": "function",
            "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})},
        }
        for i, b in enumerate(blocks)
        if b["type"] == "tool_use"
    ]
    texts = [b for b in blocks if b["type"] != "tool_use"]
    _only_text([b for b in texts if b["type"] != "thinking"], where)
    content = "".join(_sampled_text(b, f"{where}.content") for b in texts)
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def _sampled_text(block: dict[str, Any], where: str) -> str:
    """A text block's text; a thinking block's reasoning inside the markup it was sampled
    with (its signature's), or Qwen3's layout for a block without our signature."""
    if block["type"] != "thinking":
        return str(block["text"])
    thinking = block.get("thinking")
    if not isinstance(thinking, str):
        raise ValueError(f"{where}: a thinking block needs its thinking text")
    thought = Thought.from_signature(thinking, block.get("signature"))
    return thought.head + thought.thinking + thought.tail


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not block.get("tool_use_id"):
        raise ValueError(f"{where}: a tool_result block needs its tool_use_id")
    content = block.get("content")
    text = content if isinstance(content, str) else _joined_text(content or [], where)
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and "type" in b for b in content
    ):
        raise ValueError(f"{where} must be a string or a list of content blocks with a 'type'")
    return content


def _only_text(blocks: list[dict[str, Any]], where: str) -> None:
    for block in blocks:
        if block["type"] != "text":
            raise ValueError(
                f"{where}: {block['type']!r} blocks are not supported "
                "(text, tool_use and tool_result are)"
            )


def _joined_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    blocks = _blocks(content, where)
    _only_text(blocks, where)
    return "".join(b["text"] for b in blocks)


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if not tool.get("name"):
        raise ValueError(f"{where}: a tool needs a name")
    if tool.get("type") not in (None, "custom"):
        raise ValueError(f"{where}: server tools ({tool['type']!r}) are not supported")
    function = {
        "name": tool["name"],
        "description": tool.get("description", ""),
        "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


@dataclass(frozen=True)
class Thought:
    """A reply's reasoning and the markup around it, as sampled: ``head + thinking + tail``
    is the reply's text up to its answer."""

    head: str  # the open marker (none where the prompt opened the think), whitespace after
    thinking: str
    tail: str  # the whitespace, the close marker (none when cut short) and the gap after

    def signature(self) -> str:
        """Anthropic's ``signature`` is opaque to a client, which sends it back unchanged.
        Here it is no cryptographic proof: the markup around the reasoning (so that the
        block renders back into the very text sampled) and a SHA-256 of the reasoning (so
        that a signature is only trusted with its own text). It is stable across gateway
        restarts: all of it comes from the logged tokens."""
        digest = hashlib.sha256(self.thinking.encode()).hexdigest()[:32]
        layout = json.dumps([self.head, self.tail, digest]).encode()
        return base64.urlsafe_b64encode(layout).decode()

    @classmethod
    def from_signature(cls, thinking: str, signature: Any) -> Thought:
        """The thought a block stands for; Qwen3's layout where the signature is not ours
        or belongs to other text."""
        try:
            head, tail, digest = json.loads(base64.urlsafe_b64decode(str(signature)))
        except (ValueError, TypeError):  # binascii.Error and JSONDecodeError are ValueErrors
            head = tail = digest = None
        ours = isinstance(head, str) and isinstance(tail, str)
        if ours and digest == hashlib.sha256(thinking.encode()).hexdigest()[:32]:
            return cls(head, thinking, tail)
        return cls(CANONICAL_HEAD, thinking, CANONICAL_TAIL)


def opens_thinking(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """The prompt leaves a think open: its generation prompt ends with the open marker
    (DeepSeek-R1's, QwQ's and Qwen3-thinking-2507's templates end it with ``<think>\\n``), so
    the reply starts inside the reasoning without sampling the marker. Only the prompt's
    end counts: its last ``<think>`` is after its last ``</think>`` with nothing but
    whitespace after it, so that a reply cut short inside its reasoning earlier in the
    history does not leave every later turn "open"."""
    tail = tokenizer.decode(prompt_ids[-PROMPT_END_TOKENS:], skip_special_tokens=False)
    return str(tail).rstrip().endswith(THINK_OPEN)


def split_thinking(content: str, opened: bool = False) -> tuple[Thought | None, str]:
    """The reply's reasoning and the text after it; the two rebuild ``content`` exactly. The
    reasoning is inside the think markers when the reply opens with one; with ``opened``
    (the prompt left a think open: ``opens_thinking``), it is the text up to the close
    marker, the thought's head empty (the open marker was the prompt's, not sampled). A
    reply cut short inside its reasoning is all reasoning."""
    if content.startswith(THINK_OPEN):
        opening = THINK_OPEN
    elif opened and content:
        opening = ""
    else:
        return None, content
    inner = content[len(opening) :]
    end = inner.find(THINK_CLOSE)
    after = inner[end:] if end >= 0 else ""
    inner = inner[:end] if end >= 0 else inner
    thinking = inner.strip()
    lead = inner[: len(inner) - len(inner.lstrip())]
    trail = inner[len(lead) + len(thinking) :]
    text = after[len(THINK_CLOSE) :].lstrip() if after else ""
    tail = trail + after[: len(after) - len(text)]
    return Thought(opening + lead, thinking, tail), text


def message_response(
    result: TurnResult, model: str, thinking: bool = False, opened: bool = False
) -> dict[str, Any]:
    """The turn as Anthropic's ``Message``; with ``thinking``, its reasoning as a
    ``thinking`` block first (``opened``: the prompt left a think open, ``opens_thinking``)."""
    reply = result.reply
    content: list[dict[str, Any]] = []
    thought, text = split_thinking(reply.content, opened) if thinking else (None, reply.content)
    if thought is not None:
        block = {"type": "thinking", "thinking": thought.thinking}
        content.append({**block, "signature": thought.signature()})
    if text:
        content.append({"type": "text", "text": text})
    for call in reply.tool_calls:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _arguments(function.get("arguments")),
            }
        )
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(result),
        "stop_sequence": result.stop_sequence,
        "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(result.token_ids)},
    }


def _stop_reason(result: TurnResult) -> str:
    if result.stop_sequence and result.reply.finish_reason == "stop":
        return "stop_sequence"
    return STOP_REASONS.get(result.reply.finish_reason, "end_turn")


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return {"_raw": raw}  # the model's text, kept for the agent to see
    return parsed if isinstance(parsed, dict) else {"value": parsed}


class MessageEvents:
    """A streamed message's events (``SseWire``): ``message_start``; with thinking, a
    ``thinking`` block whose ``thinking_delta`` events come as the reasoning is sampled (its
    ``signature_delta`` once the reasoning is whole); a text block whose ``text_delta``
    events come as the text is sampled; one ``tool_use`` block per call (its input in one
    ``input_json_delta``); ``message_delta`` (stop reason, usage) and ``message_stop``. What
    is streamed is always a beginning of the final message's blocks: the rest follows when
    the turn ends. ``prompt`` comes before the first text: where it leaves a think open, the
    first deltas are the reasoning's."""

    def __init__(self, model: str, thinking: bool = False, tokenizer: Any = None):
        self._model = model
        self._id = f"msg_{uuid.uuid4().hex}"
        self._thinking = thinking
        self._tokenizer = tokenizer
        self._opened = False  # the prompt left a think open (``opens_thinking``)
        self._raw = ""  # the reply's text streamed so far, think markers included
        self._sent = {"thinking": "", "text": ""}  # each block's text sent so far
        self._open: str | None = None  # the type of the block being streamed
        self._blocks = 0  # content blocks started

    def opening(self) -> Iterator[bytes]:
        start: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": start})

    def prompt(self, prompt_ids: list[int]) -> None:
        """The prompt the reply is sampled from (the session's ``on_prompt``)."""
        if self._thinking and self._tokenizer is not None:
            self._opened = opens_thinking(self._tokenizer, prompt_ids)

    def text(self, delta: str) -> Iterator[bytes]:
        self._raw += delta
        if not self._thinking:
            yield from self._stream("text", self._raw)
            return
        if THINK_OPEN.startswith(self._raw):
            return  # not yet known whether the reply opens with reasoning
        thought, text = split_thinking(self._raw, self._opened)
        if thought is None:
            yield from self._stream("text", text)
        elif text:  # past the reasoning: it is whole
            yield from self._stream("thinking", thought.thinking)
            yield from self._stop_thinking(thought.signature())
            yield from self._stream("text", text)
        else:  # inside it: not a part of the close marker, nor the whitespace before it
            held = _without_partial_marker(thought.thinking, THINK_CLOSE).rstrip()
            yield from self._stream("thinking", held)

    def closing(self, result: TurnResult, rest: str) -> Iterator[bytes]:
        """The final message's blocks past what was streamed (``rest`` is the same for the
        text, taken from the message here so that thinking and text part the same way)."""
        message = message_response(result, self._model, self._thinking, self._opened)
        for block in message["content"]:
            if block["type"] == "thinking":
                yield from self._stream("thinking", block["thinking"])
                yield from self._stop_thinking(block["signature"])
            elif block["type"] == "text":
                yield from self._stream("text", block["text"])
        if self._open is not None:
            yield self._block_stop()
        for block in message["content"]:
            if block["type"] != "tool_use":
                continue
            yield self._block_start({**block, "input": {}})
            partial = json.dumps(block["input"])
            yield self._block_delta({"type": "input_json_delta", "partial_json": partial})
            yield self._block_stop()
        final = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        usage = {**message["usage"]}
        yield _event("message_delta", {"type": "message_delta", "delta": final, "usage": usage})
        yield _event("message_stop", {"type": "message_stop"})

    def _stream(self, kind: str, whole: str) -> Iterator[bytes]:
        """The part of block ``kind``'s text ``whole`` not sent yet, opening the block."""
        sent = self._sent[kind]
        if not whole.startswith(sent):
            log.warning("a streamed %s block %r is not how it ends up", kind, sent[:80])
            return
        if len(whole) == len(sent):
            return
        if self._open != kind:
            if self._open is not None:
                yield self._block_stop()
            self._open = kind
            empty = {"type": kind, kind: ""}
            yield self._block_start({**empty, "signature": ""} if kind == "thinking" else empty)
        self._sent[kind] = whole
        yield self._block_delta({"type": f"{kind}_delta", kind: whole[len(sent) :]})

    def _stop_thinking(self, signature: str) -> Iterator[bytes]:
        """The thinking block's signature, then its end: once, the block started here when
        its reasoning is empty (the block still stands for the markup sampled)."""
        if self._open != "thinking" and self._blocks:
            return  # already ended
        if self._open is None:
            self._open = "thinking"
            yield self._block_start({"type": "thinking", "thinking": "", "signature": ""})
        yield self._block_delta({"type": "signature_delta", "signature": signature})
        yield self._block_stop()

    def error(self, message: str, status: int) -> Iterator[bytes]:
        yield _event("error", anthropic_error(message, status))

    def _block_start(self, block: dict[str, Any]) -> bytes:
        self._blocks += 1
        body = {"type": "content_block_start", "index": self._blocks - 1, "content_block": block}
        return _event("content_block_start", body)

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
        return _event("content_block_delta", body)

    def _block_stop(self) -> bytes:
        self._open = None
        return _event(
            "content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1}
        )


def _without_partial_marker(text: str, marker: str) -> str:
    """``text`` without an end that may be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def _event(name: str, body: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def anthropic_error(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error shape, which its SDKs turn into exceptions carrying the message."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
