"""Tool-call parsers: assistant token ids → (content, function calls), by ``multi_turn.format``.

Parsing decodes text for reading only; the token stream keeps the sampled ids.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from rolloutbus.errors import AgentLoopError


class FunctionCall(BaseModel):
    """One parsed call; ``arguments`` is the JSON text (raw text when it is not valid JSON)."""

    name: str
    arguments: str


class ToolParser(ABC):
    """Base parser. ``stop_token_ids`` are added to the sampling params of every turn."""

    _registry: dict[str, type[ToolParser]] = {}

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        return []

    @abstractmethod
    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[str, list[FunctionCall]]:
        """Return the assistant text without the calls, and the calls in order."""

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer: Any) -> ToolParser:
        if name not in cls._registry:
            raise AgentLoopError(
                f"unknown tool parser {name!r}; registered: {', '.join(sorted(cls._registry))}"
            )
        return cls._registry[name](tokenizer)

    @classmethod
    def register(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = subclass
            return subclass

        return decorator


def assistant_tool_calls(calls: list[FunctionCall]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` for the assistant message; raw arguments kept if not JSON."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        out.append({"type": "function", "function": {"name": call.name, "arguments": arguments}})
    return out


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes)."""

    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(response_ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return text, []
        calls = [self._parse(match) for match in self.tool_call_regex.findall(text)]
        content = self.tool_call_regex.sub("", text)
        return content, calls

    @staticmethod
    def _parse(body: str) -> FunctionCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            # keep what the model wrote: the loop answers with a JSON error for this call
            match = re.search(r'"name"\s*:\s*"([^"]*)"', body)
            raw = re.search(r'"arguments"\s*:\s*(.*)\}\s*$', body, re.DOTALL)
            return FunctionCall(
                name=match.group(1) if match else "",
                arguments=raw.group(1) if raw else body.strip(),
            )
        if not isinstance(call, dict):
            return FunctionCall(name="", arguments=body.strip())
        arguments = call.get("arguments", {})
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        return FunctionCall(name=str(call.get("name", "")), arguments=text)


@ToolParser.register("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder XML:
    ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``.

    Parameter values are JSON when they parse (numbers, objects), else strings.
    """

    function_regex = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
    parameter_regex = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
    tool_call_regex = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)

    async def extract_tool_calls(self, response_ids: list[int]) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(response_ids)
        calls = []
        for block in self.tool_call_regex.findall(text):
            for name, body in self.function_regex.findall(block):
                params = {key: self._value(raw) for key, raw in self.parameter_regex.findall(body)}
                calls.append(
                    FunctionCall(name=name, arguments=json.dumps(params, ensure_ascii=False))
                )
        return self.tool_call_regex.sub("", text), calls

    @staticmethod
    def _value(raw: str) -> Any:
        value = raw.strip("\n")
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
