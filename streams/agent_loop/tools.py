"""Tools for ``tool_agent``: verl's ``BaseTool`` life cycle, function tools, a calculator.

- ``BaseTool``: ``create`` → ``execute`` → ``release``; ``execute`` returns
  ``(ToolResponse | str, reward | None, metrics)``. A tool's schema is kept as it was given
  (a dict, or verl's pydantic ``OpenAIFunctionToolSchema``: never turned into a dict).
- ``FunctionTool``: a plain Python function (sync or async), called directly (verl's
  ``verl.tools.function_tool.FunctionTool``, with verl's constructor too); ``@function_tool``
  registers one with verl's schema inference (``transformers.utils.get_json_schema``), and
  its return value is read as verl's ``normalize_function_tool_return`` reads it (text,
  dict, ``ToolResponse`` or a 1-, 2- or 3-tuple; a missing reward is 0.0).
- ``load_tools_from_config``: verl's tool YAML (``tools: [{class_name, config, tool_schema}]``).
- ``load_function_tools``: ``rollout.multi_turn.function_tool_path`` — the ``@function_tool``
  functions of a ``.py`` file or module, as in verl (with verl's warning when it has none);
  such a file's public functions are then used instead (a rolloutbus addition).
- ``load_tool_catalog``: both, as verl's ``load_all_tools``: a function tool named like a
  YAML tool is a ValueError naming every such name. Each call loads afresh (YAML tools are
  new instances; a function-tool file runs once per process, as in verl); the session
  worker loads its catalog once, as verl's ``AgentLoopWorker`` does.
- Errors as verl raises them: a missing file is a ``FileNotFoundError``, a bad catalog a
  ``ValueError`` (both also ``AgentLoopError``, this project's root for a loop's errors).
- ``CalculatorTool`` (``calculator``): arithmetic parsed with ``ast``; never ``eval``.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import math
import operator
import re
import typing
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, model_validator

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.agent_loop.tool_parser import schema_dict
from rolloutbus.streams.plugins import import_module, import_object

logger = logging.getLogger(__name__)


class ToolConfigError(AgentLoopError, ValueError):
    """A tool catalog that cannot be built (verl raises ValueError)."""


class ToolConfigNotFoundError(AgentLoopError, FileNotFoundError):
    """A tool config or function-tool file that does not exist (verl: FileNotFoundError)."""


class ToolResponse(BaseModel):
    """What a tool gives back to the model (verl's ``verl.tools.schemas.ToolResponse``)."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values: Any) -> Any:
        # verl's check, with its advice: a single image must be wrapped in a list
        for key in ("image", "video"):
            if isinstance(values, dict) and values.get(key) is not None:
                if not isinstance(values[key], list):
                    raise ValueError(
                        f"ToolResponse.{key} must be a list, got {type(values[key]).__name__}; "
                        f"wrap a single one: {{'{key}': [item]}}"
                    )
        return values


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function-tool schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


class BaseTool:
    """verl's tool interface. One tool object serves many trajectories; per-call state lives
    under the ``instance_id`` that ``create`` returns, until ``release``."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None):
        self.config = dict(config or {})
        # kept as given: a dict, or verl's OpenAIFunctionToolSchema (a pydantic model)
        self.tool_schema = tool_schema or self.default_schema()
        if not tool_name(self.tool_schema):
            raise ToolConfigError(f"{type(self).__name__}: the tool schema needs function.name")

    def default_schema(self) -> Any:
        raise ToolConfigError(f"{type(self).__name__} needs a tool_schema")

    @property
    def name(self) -> str:
        return tool_name(self.tool_schema)

    def get_openai_tool_schema(self) -> Any:
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


def tool_name(schema: Any) -> str:
    """``function.name`` of a tool schema, a dict or verl's pydantic model ("" if none)."""
    try:
        return str(schema_dict(schema).get("function", {}).get("name") or "")
    except (TypeError, ValueError, AttributeError):
        return ""


# ---- plain-function tools ------------------------------------------------------------

_JSON_TYPES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


class FunctionTool:
    """A plain function as a tool (verl's ``FunctionTool`` carrier): ``name``, ``fn``,
    ``tool_schema`` (kept as given: a dict or verl's pydantic schema) and ``is_async``;
    it is called directly, with no create/release life cycle.

    Built as ours, ``FunctionTool(fn, name=None, description=None, tool_schema=None)`` (the
    schema inferred from the signature and docstring when not given), or as verl's,
    ``FunctionTool(name, fn, tool_schema, is_async=False)``. ``call`` returns what the
    function returned, as verl's does; ``execute`` reads it with
    ``normalize_function_tool_return``.
    """

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        name: str | Callable[..., Any] | None = None,
        description: str | None = None,
        tool_schema: Any = None,
        is_async: bool | None = None,
    ):
        if isinstance(fn, str) and callable(name):  # verl's positional (name, fn, schema)
            fn, name, tool_schema = name, fn, description if tool_schema is None else tool_schema
            description = None
        if not callable(fn):
            raise ToolConfigError(f"FunctionTool needs a callable, got {type(fn).__name__}")
        self.fn: Callable[..., Any] = fn
        self.is_async = inspect.iscoroutinefunction(fn) if is_async is None else bool(is_async)
        given = name if isinstance(name, str) else None
        self.tool_schema: Any = tool_schema or schema_from_function(
            fn, name=given, description=description
        )
        self.name = given or tool_name(self.tool_schema)
        if not self.name:
            raise ToolConfigError("FunctionTool: the tool schema needs function.name")

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def call(self, parameters: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        return normalize_function_tool_return(await self.call(parameters))

    def __repr__(self) -> str:
        return f"FunctionTool(name={self.name!r}, fn={getattr(self.fn, '__qualname__', self.fn)!r})"


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """verl's reading of a function tool's return value: ``(response, reward, metrics)``.

    ``ToolResponse``/text/dict → reward 0.0; a tuple ``(response[, reward[, metrics]])``
    with a None reward as 0.0; a tuple of another length raises ``TypeError`` (a tool bug);
    anything else becomes its ``str``.
    """
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(
                f"@function_tool return tuple must have length 1, 2, or 3 "
                f"(got length {len(ret)}: {ret!r}). Use (response,), "
                f"(response, reward), or (response, reward, metrics)."
            )
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return as_tool_response(ret[0]), reward, metrics
    return as_tool_response(ret), 0.0, {}


def as_tool_response(result: Any) -> ToolResponse:
    if isinstance(result, ToolResponse):
        return result
    if isinstance(result, str):
        return ToolResponse(text=result)
    if isinstance(result, dict):
        return ToolResponse(text=json.dumps(result, ensure_ascii=False))
    return ToolResponse(text=str(result))


# verl's FUNCTION_TOOL_REGISTRY: every @function_tool of the process, by tool name
FUNCTION_TOOL_REGISTRY: dict[str, FunctionTool] = {}


def function_tool(name: str | Callable[..., Any] | None = None, *, schema: Any = None) -> Any:
    """Register a function as a tool, as verl's ``@function_tool`` does.

    ``@function_tool`` or ``@function_tool("name")``; the schema comes from
    ``transformers.utils.get_json_schema`` (a Google docstring with ``Args:`` and a type
    hint on every parameter, else it raises at import, as in verl) unless ``schema=`` is
    given. The function itself is returned unchanged.
    """

    def decorator_for(tool_name: str | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            final_name = tool_name or fn.__name__
            built = schema if schema is not None else _verl_schema(fn, final_name)
            existing = FUNCTION_TOOL_REGISTRY.get(final_name)
            if existing is not None and existing.fn is not fn:
                raise ToolConfigError(  # verl's ValueError and message
                    f"Function tool '{final_name}' is already registered to "
                    f"{existing.fn.__module__}.{existing.fn.__qualname__}; "
                    f"refusing to overwrite with {fn.__module__}.{fn.__qualname__}."
                )
            FUNCTION_TOOL_REGISTRY[final_name] = FunctionTool(
                fn, name=final_name, tool_schema=built
            )
            return fn

        return decorator

    if callable(name) and schema is None:
        return decorator_for(None)(name)
    return decorator_for(name if isinstance(name, str) else None)


def _verl_schema(fn: Callable[..., Any], tool_name: str) -> dict[str, Any]:
    from transformers.utils import get_json_schema  # the schema verl infers

    variadic = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if variadic:
        raise ToolConfigError(  # verl's ValueError and message
            f"@function_tool '{tool_name}' ({fn.__module__}.{fn.__qualname__}) "
            f"declares variadic parameter(s) {variadic}, which can't be "
            f"expressed in an OpenAI tool schema. Replace them with explicit "
            f"named parameters."
        )
    raw = get_json_schema(fn)
    raw["function"]["name"] = tool_name
    return raw


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
    """The ``@function_tool`` functions a ``.py`` file or module registers (verl), or, if
    it registers none, verl's warning and then every public function it defines
    (``__all__`` chooses; a rolloutbus addition)."""
    what = "function tools (rollout.multi_turn.function_tool_path)"
    if path_or_module.endswith(".py") and not Path(path_or_module).is_file():
        raise ToolConfigNotFoundError(f"function_tool_path does not exist: {path_or_module}")
    before = dict(FUNCTION_TOOL_REGISTRY)
    module = import_module(path_or_module, what=what, error=ToolConfigError)
    decorated = [
        tool
        for name, tool in FUNCTION_TOOL_REGISTRY.items()
        if name not in before or getattr(tool.fn, "__module__", None) == module.__name__
    ]
    if decorated:
        return sorted(decorated, key=lambda tool: tool.name)  # verl: sorted new names
    logger.warning(
        "function_tool_path '%s' loaded but no @function_tool decorators found; "
        "did you forget to apply the decorator? (using its public functions instead)",
        path_or_module,
    )
    names = getattr(module, "__all__", None) or [
        n
        for n, obj in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
    ]
    # through the importer so that an ``__all__`` entry that is missing or not callable is
    # the same clear error as any other plug-in path
    return [
        FunctionTool(
            import_object(
                f"{module.__name__}:{n}", what=what, kind="callable", error=ToolConfigError
            )
        )
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
        raise ToolConfigNotFoundError(f"tool config not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ToolConfigError(f"tool config {path} is not valid YAML: {exc}") from exc
    tools = []
    for i, entry in enumerate(data.get("tools") or []):
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ToolConfigError(f"tool config {path}, entry {i}: needs class_name")
        cls = import_object(
            entry["class_name"],
            what=f"tool class (tool config {path}, entry {i})",
            kind="class",
            error=ToolConfigError,
        )
        tools.append(cls(config=entry.get("config") or {}, tool_schema=entry.get("tool_schema")))
    return tools


def load_tool_catalog(tool_config_path: str | None, function_tool_path: str | None) -> list[Any]:
    """verl's ``load_all_tools``: the YAML tools, then the function tools; a function tool
    named like a YAML tool raises ValueError naming every such name. Loaded afresh on each
    call (the caller keeps the catalog: the session worker once per process)."""
    native = load_tools_from_config(tool_config_path) if tool_config_path else []
    functions = load_function_tools(function_tool_path) if function_tool_path else []
    if native and functions:
        declared = {tool.name for tool in native}
        collisions = sorted(tool.name for tool in functions if tool.name in declared)
        if collisions:
            raise ToolConfigError(  # verl's message
                f"Function tool name(s) {collisions} collide with tools already declared in "
                f"'{tool_config_path}'. Each tool name must be unique across `tool_config_path` "
                f"and `function_tool_path`; rename one of them."
            )
    return [*native, *functions]


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
