"""Tools for ``tool_agent``: verl's ``BaseTool`` life cycle, plain-function tools, a calculator.

- ``BaseTool``: ``create`` → ``execute`` → ``release``; ``execute`` returns
  ``(ToolResponse | str, reward | None, metrics)``.
- ``FunctionTool``: a plain Python function (sync or async); its OpenAI schema comes from
  the signature and docstring.
- ``load_tools_from_config``: verl's tool YAML (``tools: [{class_name, config, tool_schema}]``).
- ``load_function_tools``: every public function of a module or ``.py`` file
  (``rollout.multi_turn.function_tool_path``).
- ``CalculatorTool`` (``calculator``): arithmetic parsed with ``ast``; never ``eval``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import typing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.plugins import import_module, import_object


class ToolResponse(BaseModel):
    """What a tool gives back to the model (verl's ``verl.tools.schemas.ToolResponse``)."""

    text: str | None = None
    image: Any | None = None
    video: Any | None = None


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function-tool schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


class BaseTool:
    """verl's tool interface. One tool object serves many trajectories; per-call state lives
    under the ``instance_id`` that ``create`` returns, until ``release``."""

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.default_schema()
        if not self.tool_schema.get("function", {}).get("name"):
            raise AgentLoopError(f"{type(self).__name__}: the tool schema needs function.name")

    def default_schema(self) -> dict[str, Any]:
        raise AgentLoopError(f"{type(self).__name__} needs a tool_schema")

    @property
    def name(self) -> str:
        return self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict[str, Any]:
        return self.tool_schema

    async def create(
        self, instance_id: str | None = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse | str, float | None, dict[str, Any]]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


# ---- plain-function tools ------------------------------------------------------------

_JSON_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


class FunctionTool(BaseTool):
    """A plain function as a tool; it is called directly (no create/release state).

    The function returns text, ``(text, reward)``, a ``ToolResponse``, or any JSON value.
    """

    def __init__(
        self, fn: Callable[..., Any], name: str | None = None, description: str | None = None
    ):
        self.fn = fn
        super().__init__(tool_schema=schema_from_function(fn, name=name, description=description))

    async def call(
        self, parameters: dict[str, Any]
    ) -> tuple[ToolResponse, float | None, dict[str, Any]]:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await asyncio.to_thread(self.fn, **parameters)
        reward = None
        if isinstance(result, tuple) and len(result) == 2:
            result, reward = result
        return as_tool_response(result), reward, {}

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return await self.call(parameters)


def as_tool_response(result: Any) -> ToolResponse:
    if isinstance(result, ToolResponse):
        return result
    if isinstance(result, str):
        return ToolResponse(text=result)
    return ToolResponse(text=json.dumps(result, ensure_ascii=False, default=str))


def schema_from_function(
    fn: Callable[..., Any], name: str | None = None, description: str | None = None
) -> dict:
    """OpenAI schema from type hints and a Google-style docstring (``Args:`` section)."""
    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _parse_docstring(doc)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(pname, str))
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    parameters = {"type": "object", "properties": properties, "required": required}
    return function_schema(name or fn.__name__, description or summary or fn.__name__, parameters)


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _json_type(args[0])
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (list, tuple):
        return {"type": "array", "items": _json_type(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES.get(hint, "string")}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    arg_docs: dict[str, str] = {}
    match = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if match:
        for line in match.group(1).splitlines():
            item = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line)
            if item:
                arg_docs[item.group(1)] = item.group(2).strip()
    return summary, arg_docs


def load_function_tools(path_or_module: str) -> list[FunctionTool]:
    """Every public function defined in a module (dotted name) or a ``.py`` file.

    A module may list its tools in ``__all__`` to choose them.
    """
    what = "function tools (rollout.multi_turn.function_tool_path)"
    module = import_module(path_or_module, what=what)
    names = getattr(module, "__all__", None) or [
        n
        for n, obj in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
    ]
    # through the importer so that an ``__all__`` entry that is missing or not callable is
    # the same clear error as any other plug-in path
    return [
        FunctionTool(import_object(f"{module.__name__}:{n}", what=what, kind="callable"))
        for n in names
    ]


# ---- YAML tool config (verl's format) --------------------------------------------------


def load_tools_from_config(path: str | Path) -> list[BaseTool]:
    """``tools: [{class_name: pkg.mod.Cls, config: {...},
    tool_schema: {type: function, function: ...}}]``."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise AgentLoopError(f"tool config not found: {path}") from exc
    tools = []
    for i, entry in enumerate(data.get("tools") or []):
        if "class_name" not in entry:
            raise AgentLoopError(f"tool config {path}, entry {i}: needs class_name")
        cls = import_object(
            entry["class_name"], what=f"tool class (tool config {path}, entry {i})", kind="class"
        )
        tools.append(cls(config=entry.get("config") or {}, tool_schema=entry.get("tool_schema")))
    return tools


_catalogs: dict[tuple[str | None, str | None], list[BaseTool]] = {}


def load_tool_catalog(
    tool_config_path: str | None, function_tool_path: str | None
) -> list[BaseTool]:
    """Tools from both sources, loaded once per process (verl: once per worker)."""
    key = (tool_config_path, function_tool_path)
    if key not in _catalogs:
        tools: list[BaseTool] = []
        if tool_config_path:
            tools += load_tools_from_config(tool_config_path)
        if function_tool_path:
            tools += load_function_tools(function_tool_path)
        _catalogs[key] = tools
    return _catalogs[key]


# ---- calculator ------------------------------------------------------------------------

MAX_EXPONENT = 100  # a bigger power is rejected: 10**10**10 would hang the worker
MAX_EXPRESSION_CHARS = 500  # longer input is rejected before parsing
MAX_RESULT_DIGITS = 1000  # an integer result longer than this is rejected

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate numbers, + - * / // % **, parentheses and unary minus; anything else raises."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    cleaned = expression.replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(cleaned.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    return _eval_node(tree.body)


def _eval_node(node: ast.AST) -> int | float:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, int | float) and not isinstance(value, bool):  # True is an int too
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        result = _BINARY_OPS[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return result
    raise ValueError(f"unsupported element in expression: {ast.dump(node)[:60]}")


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value)
    return str(value)


class CalculatorTool(BaseTool):
    """``calculator(expression)``: evaluates arithmetic safely; the answer is the text."""

    def default_schema(self) -> dict[str, Any]:
        return function_schema(
            "calculator",
            "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
            {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "for example 18 * 7"}
                },
                "required": ["expression"],
            },
        )

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            raise ValueError("calculator needs a string argument 'expression'")
        return ToolResponse(text=format_number(evaluate_arithmetic(expression))), None, {}
