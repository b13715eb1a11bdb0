"""Chat messages between an agent's OpenAI SDK and the chat template, and the assistant
reply the gateway builds from the sampled tokens.

Three views of a message:

- as the agent sent it (OpenAI's shape: content may be a list of text parts, tool-call
  arguments are JSON text, ``developer`` is a role);
- as the chat template takes it (``template_message``: text content, arguments parsed,
  ``developer`` as ``system``), the form vLLM's chat endpoint renders too;
- as two histories are compared (``comparable``): what makes it the same turn of a
  conversation, so an SDK that echoes a reply back with ``content: null`` instead of ``""``,
  other tool-call ids or re-serialized arguments still extends the logged stream.

The reply's text is decoded for the agent only; the token stream keeps the sampled ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.agent_loop.tool_parser import ToolParser

TEMPLATE_ROLES = frozenset({"system", "user", "assistant", "tool"})


class BadMessagesError(AgentLoopError, ValueError):
    """The request's messages cannot be rendered (a role or content the gateway does not
    take): HTTP 400 naming the message."""


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Every message is text with a known role, and the last is not the assistant's."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in TEMPLATE_ROLES | {"developer"}:
            raise BadMessagesError(f"messages[{index}]: unknown role {role!r}")
        _text(message.get("content"), f"messages[{index}].content")
    if messages[-1].get("role") == "assistant":
        raise BadMessagesError(
            "the last message is the assistant's: continuing an assistant message is not "
            "supported (send the messages that follow it)"
        )


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as the chat template takes it."""
    role = "system" if message.get("role") == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), "content")}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_template_call(call) for call in calls]
    return out


def comparable(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn: role, text, and each call's name and arguments
    (ids and formatting aside); a tool message's ``tool_call_id`` and ``name``."""
    role = "system" if message.get("role") == "developer" else message.get("role")
    text = _text(message.get("content"), "content").strip()
    calls = tuple(
        (fn.get("name"), _canonical_arguments(fn.get("arguments")))
        for fn in (call.get("function") or {} for call in message.get("tool_calls") or [])
    )
    if role == "assistant":
        return (role, text, calls)
    return (role, text, message.get("tool_call_id"), message.get("name"))


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadMessagesError(
                    f"{where}: a {kind!r} part; the gateway takes text only (images, audio "
                    "and files are not supported)"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadMessagesError(f"{where}: must be a string or a list of text parts")


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # the template renders the raw text, as the model wrote it
    out = {"type": call.get("type", "function"), "function": function}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments.strip()
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class Reply:
    """One assistant turn for the agent: the text, the calls (OpenAI format), why it ended."""

    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # stop, length or tool_calls

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message, as an SDK echoes it back in the next request."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        elif out["content"] is None:
            out["content"] = ""
        return out


async def parse_reply(
    parser: ToolParser,
    tokenizer: Any,
    token_ids: list[int],
    *,
    tools: list[dict[str, Any]] | None,
    engine_finish_reason: str | None,
    call_id_prefix: str,
) -> Reply:
    """The agent's view of sampled ``token_ids``: the configured tool parser's calls and text
    (the tokenizer's special tokens removed), finish reason ``tool_calls`` when it found
    any, else the engine's ``length``, else ``stop``."""
    content, calls = await parser.extract_tool_calls(list(token_ids), tools)
    for special in getattr(tokenizer, "all_special_tokens", ()):
        content = content.replace(special, "")
    tool_calls = [
        {
            "id": call.tool_call_id or f"{call_id_prefix}_{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for index, call in enumerate(calls)
    ]
    if tool_calls:
        reason = "tool_calls"
    else:
        reason = "length" if engine_finish_reason == "length" else "stop"
    return Reply(content=content.strip(), tool_calls=tool_calls, finish_reason=reason)
