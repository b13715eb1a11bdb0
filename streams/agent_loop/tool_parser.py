"""Tool-call parsers: assistant token ids → (content, function calls), by ``multi_turn.format``.

The parsers follow verl 0.9.1's ``verl/experimental/agent_loop/tool_parser.py`` rule for
rule: ``hermes``, ``gpt-oss``, ``qwen3_coder``, ``glm``, ``seed``, ``minimax``, ``kimi``,
``deepseek_v4`` and ``gemma4``. A call that does not parse is dropped (verl logs it), so a
turn whose only call is malformed ends the trajectory. ``extract_tool_calls`` gets the tool
schemas too: ``qwen3_coder`` types parameter values from them and ``kimi`` infers a name.

Parsing decodes text for reading only; the token stream keeps the sampled ids.

A parser from outside the tree: ``rollout.multi_turn.format`` also takes a dotted path to a
parser class (``package.module.Parser``, ``module:Parser`` or ``file.py:Parser``), loaded
by the one importer (``streams/plugins.py``) with its error messages; ``@ToolParser.register``
still adds a name.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.plugins import import_object

logger = logging.getLogger(__name__)


class UnknownToolParserError(AgentLoopError, ValueError):
    """``multi_turn.format`` names no registered parser (verl raises ValueError)."""


class FunctionCall(BaseModel):
    """One parsed call; ``arguments`` is the JSON text (raw text when it is not valid JSON)."""

    arguments: str
    name: str
    tool_call_id: str | None = None  # the id the model wrote, where the format has one


def schema_dict(schema: Any) -> dict[str, Any]:
    """A tool schema as a plain dict, whether it is a dict or verl's pydantic model."""
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_unset=True, exclude_none=True)
    return dict(schema)


_PROPERTY_KEYS = ("type", "description", "enum")  # verl's OpenAIFunctionPropertySchema


def rendered_tool_schema(schema: Any) -> dict[str, Any]:
    """The schema as verl puts it in the prompt: verl validates every tool schema into its
    ``OpenAIFunctionToolSchema`` and renders ``model_dump(exclude_unset, exclude_none)``,
    which keeps only ``type``, ``function.{name, description, parameters, strict}``,
    ``parameters.{type, properties, required}`` and a property's ``type``,
    ``description`` and ``enum`` (so, e.g., an array's ``items`` and a function's
    ``return`` are not shown to the model). Same prompt tokens as verl for the same tools."""
    spec = schema_dict(schema)
    function = dict(spec.get("function") or {})
    shown: dict[str, Any] = {
        k: function[k] for k in ("name", "description") if function.get(k) is not None
    }
    params = function.get("parameters")
    if isinstance(params, dict):
        view: dict[str, Any] = {k: params[k] for k in ("type",) if params.get(k) is not None}
        view["properties"] = {
            name: {k: prop[k] for k in _PROPERTY_KEYS if prop.get(k) is not None}
            for name, prop in (params.get("properties") or {}).items()
            if isinstance(prop, dict)
        }
        if params.get("required") is not None:
            view["required"] = list(params["required"])
        shown["parameters"] = view
    if function.get("strict") is not None:
        shown["strict"] = function["strict"]
    out: dict[str, Any] = {"type": spec["type"]} if spec.get("type") is not None else {}
    out["function"] = shown
    return out


def _function_properties(tools: list[Any] | None, name: str) -> dict[str, Any] | None:
    """The ``parameters.properties`` of tool ``name``; None when no tool has that name."""
    for tool in tools or []:
        spec = schema_dict(tool)
        function = spec.get("function") or {}
        if spec.get("type") == "function" and function.get("name") == name:
            return dict((function.get("parameters") or {}).get("properties") or {})
    return None


class ToolParser(ABC):
    """Base parser. ``stop_token_ids`` are added to the sampling params of every turn."""

    _registry: dict[str, type[ToolParser]] = {}

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        return []

    @abstractmethod
    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        """Return the assistant text without the calls, and the calls in order."""

    async def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        # verl decodes in the default executor (a long turn must not block the event loop),
        # with the tokenizer's default: special tokens kept
        return await asyncio.to_thread(
            self.tokenizer.decode, ids, skip_special_tokens=skip_special_tokens
        )

    def _special_token_id(self, token: str) -> list[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if isinstance(token_id, int) and token_id >= 0 and token_id != unk:
            return [token_id]
        return []

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer: Any) -> ToolParser:
        """The parser registered as ``name``, or the class a dotted path names
        (``package.module.Parser``, ``module:Parser``, ``file.py:Parser``), built with the
        tokenizer: a parser from outside the tree, as loops, tools and rewards can be."""
        if name in cls._registry:
            return cls._registry[name](tokenizer)
        if "." not in name and ":" not in name:
            raise UnknownToolParserError(
                f"unknown tool parser {name!r} (rollout.multi_turn.format); registered: "
                f"{', '.join(sorted(cls._registry))}; or give a dotted path to a parser class"
            )
        return _plugin_parser(name)(tokenizer)

    @classmethod
    def register(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = subclass
            return subclass

        return decorator


def _plugin_parser(path: str) -> Callable[[Any], ToolParser]:
    """A parser class by dotted path, through the one importer (its error messages)."""
    what = "tool parser (rollout.multi_turn.format)"
    cls = import_object(path, what=what, kind="class", error=UnknownToolParserError)
    if not callable(getattr(cls, "extract_tool_calls", None)):
        raise UnknownToolParserError(
            f"cannot load {what} from {path!r}: {cls.__qualname__} has no extract_tool_calls "
            "method (subclass rolloutbus.streams.agent_loop.ToolParser)"
        )
    return cls


def _json_or_text(raw: str) -> Any:
    value = raw.strip()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _call(name: str, arguments: Any, tool_call_id: str | None = None) -> FunctionCall:
    return FunctionCall(
        name=name, arguments=json.dumps(arguments, ensure_ascii=False), tool_call_id=tool_call_id
    )


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes)."""

    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return text, []
        calls = []
        for body in self.tool_call_regex.findall(text):
            try:
                call = json.loads(body)
                calls.append(_call(call["name"], call["arguments"]))
            except Exception as exc:  # noqa: BLE001 - verl drops a call it cannot read
                logger.error("Failed to decode tool call: %s", exc)
        return self.tool_call_regex.sub("", text), calls


@ToolParser.register("gpt-oss")
class GptOssToolParser(ToolParser):
    """gpt-oss (harmony): ``<|start|>assistant<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>ARGS<|call|>``; the analysis channel is removed first
    because it may mention calls that are not made."""

    cot_pattern = re.compile(
        r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL
    )
    partial_cot_pattern = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", re.DOTALL)
    tool_call_pattern = re.compile(
        r"<\|start\|>assistant<\|channel\|>[^<]* to=functions\.([^<]+) "
        r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>",
        re.DOTALL,
    )

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        pad = getattr(self.tokenizer, "pad_token", None)
        if pad:
            text = text.replace(pad, "")
        text = self.cot_pattern.sub("", text)
        text = self.partial_cot_pattern.sub("", text)
        matches = self.tool_call_pattern.findall(text)
        if not matches:
            return text, []
        # the arguments are not checked here: an invalid JSON is answered by the loop
        calls = [FunctionCall(name=name, arguments=arguments) for name, arguments in matches]
        return self.tool_call_pattern.sub("", text), calls


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def convert_typed_value(value: str, name: str, properties: dict[str, Any], function: str) -> Any:
    """A qwen3_coder parameter value typed by the tool schema (verl's convert_param_value)."""
    if value.lower() == "null":
        return None
    if name not in properties:
        if properties:
            logger.warning("parameter %r is not in the schema of tool %r", name, function)
        return value
    prop = properties[name]
    prop = prop if isinstance(prop, dict) else schema_dict(prop)
    kind = str(prop.get("type", "string")).strip().lower() if "type" in prop else "string"
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if number - int(number) != 0 else int(number)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"  # verl: anything but true/false degenerates to false
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    try:
        # literal_eval, never eval: the value is model output
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


@ToolParser.register("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5 XML:
    ``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``.

    Values are typed by the tool's JSON schema (integer, number, boolean, object, ...),
    strings stay strings; an unterminated last call or parameter is still read.
    """

    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
    function_regex = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    parameter_regex = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)

    def _function_bodies(self, text: str) -> list[str]:
        blocks = [a or b for a, b in self.tool_call_regex.findall(text)] or [text]
        return [a or b for block in blocks for a, b in self.function_regex.findall(block)]

    def _parse_function(self, body: str, tools: list[Any] | None) -> FunctionCall | None:
        end = body.find(">")
        if end == -1:
            logger.warning("skipping a function call without '>': %r", body)
            return None
        name = body[:end]
        properties = _function_properties(tools, name)
        if properties is None:
            logger.warning("tool %r is not defined in the tools list", name)
            properties = {}
        arguments: dict[str, Any] = {}
        for a, b in self.parameter_regex.findall(body[end + 1 :]):
            text = a or b
            split = text.find(">")
            if split == -1:
                continue
            key, value = text[:split], text[split + 1 :]
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = convert_typed_value(value, key, properties, name)
        return _call(name, arguments)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids)
        if "<tool_call>" not in text:
            return text, []
        bodies = self._function_bodies(text)
        if not bodies:
            return text, []
        calls = [c for c in (self._parse_function(b, tools) for b in bodies) if c is not None]
        return text[: text.find("<tool_call>")], calls


@ToolParser.register("glm")
class GLMToolParser(ToolParser):
    """GLM: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``."""

    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    arg_pair_regex = re.compile(
        r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL
    )

    @property
    def stop_token_ids(self) -> list[int]:
        return self._special_token_id("<|observation|>")

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return text, []
        calls = []
        for body in self.tool_call_regex.findall(text):
            first = body.find("<arg_key>")
            name = (body if first < 0 else body[:first]).strip()
            pairs = self.arg_pair_regex.findall(body[first:]) if first >= 0 else []
            calls.append(_call(name, {k.strip(): _json_or_text(v) for k, v in pairs}))
        content = text[: text.find("<tool_call>")]
        content = re.sub(r"^\s*<think>.*?</think>", "", content, flags=re.DOTALL)
        return re.sub(r"^\s*</think>", "", content), calls


@ToolParser.register("seed")
class SeedToolParser(ToolParser):
    """ByteDance Seed: ``<seed:tool_call><function=f><parameter=p>v</parameter>...``."""

    tool_call_regex = re.compile(r"<seed:tool_call>(.*?)</seed:tool_call>", re.DOTALL)
    function_regex = re.compile(r"<function=([^>\n]+)>\s*(.*?)</function>", re.DOTALL)
    parameter_regex = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        if "<seed:tool_call>" not in text or "</seed:tool_call>" not in text:
            return text, []
        calls = []
        for block in self.tool_call_regex.findall(text):
            match = self.function_regex.search(block)
            if match:
                params = self.parameter_regex.findall(match.group(2))
                calls.append(
                    _call(match.group(1).strip(), {k.strip(): _json_or_text(v) for k, v in params})
                )
        return text[: text.find("<seed:tool_call>")], calls


@ToolParser.register("minimax")
class MiniMaxToolParser(ToolParser):
    """MiniMax: ``<minimax:tool_call><invoke name="f"><parameter name="p">v</parameter>``."""

    tool_call_regex = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
    invoke_regex = re.compile(r'<invoke name="([^"]+)">\s*(.*?)</invoke>', re.DOTALL)
    parameter_regex = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        if "<minimax:tool_call>" not in text or "</minimax:tool_call>" not in text:
            return text, []
        calls = [
            _call(
                name.strip(),
                {k.strip(): _json_or_text(v) for k, v in self.parameter_regex.findall(body)},
            )
            for block in self.tool_call_regex.findall(text)
            for name, body in self.invoke_regex.findall(block)
        ]
        return text[: text.find("<minimax:tool_call>")], calls


@ToolParser.register("kimi")
class KimiToolParser(ToolParser):
    """Kimi K2: ``<|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>``;
    the name is inferred from the tool schemas when the id is not a tool name."""

    tool_call_regex = re.compile(
        r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
        re.DOTALL,
    )

    @property
    def stop_token_ids(self) -> list[int]:
        return self._special_token_id("<|im_end|>")

    @staticmethod
    def _arguments(raw: str) -> dict[str, Any]:
        try:
            value = json.loads(raw.strip())
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    @staticmethod
    def _infer_name(raw: str, arguments: dict[str, Any], tools: list[Any] | None) -> str:
        specs = [schema_dict(t) for t in tools or []]
        functions = [s["function"] for s in specs if s.get("type") == "function"]
        names = [f["name"] for f in functions]
        if not functions or raw in names:
            return raw
        compact = raw.lower().replace("-", "_")
        by_substring = [n for n in names if n.lower() in compact]
        if len(by_substring) == 1:
            return by_substring[0]
        by_schema = [
            f["name"]
            for f in functions
            if (req := set((f.get("parameters") or {}).get("required") or []))
            and req.issubset(arguments)
        ]
        return by_schema[0] if len(by_schema) == 1 else raw

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        start = "<|tool_calls_section_begin|>"
        if start not in text:
            return text, []
        calls = []
        for raw_name, raw_arguments in self.tool_call_regex.findall(text):
            arguments = self._arguments(raw_arguments)
            name = self._infer_name(raw_name.strip(), arguments, tools)
            calls.append(_call(name, arguments, tool_call_id=raw_name.strip()))
        return text[: text.find(start)], calls


@ToolParser.register("deepseek_v4")
class DeepSeekV4ToolParser(ToolParser):
    """DeepSeek-V4 DSML: ``<｜DSML｜invoke name="f"><｜DSML｜parameter name="k"
    string="true|false">v</｜DSML｜parameter>``; ``string="false"`` values are JSON."""

    dsml = "｜DSML｜"
    eos = "<｜end▁of▁sentence｜>"
    start = f"<{dsml}tool_calls>"
    tool_calls_regex = re.compile(rf"<{dsml}tool_calls>(.*?)</{dsml}tool_calls>", re.DOTALL)
    invoke_regex = re.compile(rf'<{dsml}invoke name="(.*?)">(.*?)</{dsml}invoke>', re.DOTALL)
    parameter_regex = re.compile(
        rf'<{dsml}parameter name="(.*?)" string="(true|false)">(.*?)</{dsml}parameter>', re.DOTALL
    )

    def _arguments(self, body: str) -> dict[str, Any]:
        arguments: dict[str, Any] = {}
        for key, is_string, value in self.parameter_regex.findall(body):
            if is_string == "true":
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value
        return arguments

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        for token in (getattr(self.tokenizer, "pad_token", None), self.eos):
            if token:
                text = text.replace(token, "")
        if self.start not in text:
            return text.rpartition("</think>")[2], []
        calls = [
            _call(name, self._arguments(body))
            for block in self.tool_calls_regex.findall(text)
            for name, body in self.invoke_regex.findall(block)
        ]
        content = text[: text.index(self.start)].rpartition("</think>")[2]
        return content.removesuffix("\n\n"), calls


@ToolParser.register("gemma4")
class Gemma4ToolParser(ToolParser):
    """Gemma 4: ``<|tool_call>call:f{k:<|"|>str<|"|>,n:3}<tool_call|>``; it does not stop
    after a call, so ``<tool_call|>`` is a stop token."""

    tool_call_regex = re.compile(r"<\|tool_call>call:(\w+)\{(.*?)\}<tool_call\|>", re.DOTALL)
    arg_regex = re.compile(r'(\w+):(?:<\|"\|>(.*?)<\|"\|>|([^,}]*))')

    @property
    def stop_token_ids(self) -> list[int]:
        # none when the tokenizer lacks the token (not a Gemma 4 one): [None] would reach
        # the engine's stop_token_ids and fail every turn
        return self._special_token_id("<tool_call|>")

    @staticmethod
    def _bare(value: str) -> Any:
        value = value.strip()
        lowered = value.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        if lowered == "null":
            return None
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[Any] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = await self._decode(responses_ids, skip_special_tokens=False)
        pad = getattr(self.tokenizer, "pad_token", None)
        if pad:
            text = text.replace(pad, "")
        if "<|tool_call>" not in text:
            return text, []
        matches = self.tool_call_regex.findall(text)
        if not matches:
            return text, []
        calls = []
        for name, args in matches:
            arguments = {
                m.group(1): m.group(2) if m.group(2) is not None else self._bare(m.group(3))
                for m in self.arg_regex.finditer(args)
                if m.group(2) is not None or m.group(3) is not None
            }
            calls.append(_call(name, arguments))
        return text[: text.find("<|tool_call>")], calls


def assistant_tool_calls(calls: list[FunctionCall]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` for the assistant message (verl's _build_assistant_message):
    arguments as a dict, or the raw text when they are not a JSON object; ``id`` when the
    model wrote one."""
    out = []
    for call in calls:
        try:
            arguments: Any = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            logger.warning(
                "invalid tool call arguments for %r: %r; keeping them raw",
                call.name,
                call.arguments,
            )
            arguments = call.arguments
        message: dict[str, Any] = {
            "type": "function",
            "function": {"name": call.name, "arguments": arguments},
        }
        if call.tool_call_id is not None:
            message["id"] = call.tool_call_id
        out.append(message)
    return out
