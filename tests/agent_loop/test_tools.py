"""Tools: the calculator (ast, never eval), FunctionTool schemas, YAML and function-file loading."""

from typing import Literal

import pytest
from pydantic import BaseModel

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.agent_loop.tools import (
    FUNCTION_TOOL_REGISTRY,
    BaseTool,
    CalculatorTool,
    FunctionTool,
    ToolResponse,
    evaluate_arithmetic,
    load_function_tools,
    load_tool_catalog,
    load_tools_from_config,
    normalize_function_tool_return,
)


@pytest.mark.parametrize(
    "expr, value",
    [
        ("18 * 7", 126),
        ("(1 + 2) * -3", -9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("7 % 4", 3),
        ("2 ** 10", 1024),
        ("-(-4)", 4),
        ("1.5 + 2", 3.5),
        ("+3", 3),
        ("18 × 7", 126),
    ],
)
def test_calculator_arithmetic(expr, value):
    assert evaluate_arithmetic(expr) == value


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os').system('true')", "unsupported"),
        ("abs(-1)", "unsupported"),
        ("x + 1", "unsupported"),
        ("'a' * 3", "unsupported"),
        ("2 ** 1000", "exponent"),
        ("10 ** 10 ** 10", "exponent"),
        ("(2 ** 100) ** 100", "digits"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic"),
        ("1" * 600, "longer than"),
        ("(-8) ** 0.5", "not a real"),
    ],
)
def test_calculator_rejects_everything_else(expr, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expr)


async def test_calculator_tool():
    tool = CalculatorTool()
    assert tool.name == "calculator"
    assert tool.get_openai_tool_schema()["function"]["parameters"]["required"] == ["expression"]
    instance, _ = await tool.create()
    response, reward, metrics = await tool.execute(instance, {"expression": "6 / 3"})
    assert response == ToolResponse(text="2") and reward is None and metrics == {}
    await tool.release(instance)


def add(
    a: int, b: float = 1.0, mode: Literal["fast", "slow"] = "fast", tags: list[str] | None = None
) -> str:
    """Add two numbers.

    Args:
        a: the first number
        b (float): the second number
    """
    return str(a + b)


def test_function_tool_schema_from_signature_and_docstring():
    schema = FunctionTool(add).get_openai_tool_schema()
    fn = schema["function"]
    assert (
        schema["type"] == "function"
        and fn["name"] == "add"
        and fn["description"] == "Add two numbers."
    )
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first number"}
    assert props["b"] == {"type": "number", "description": "the second number"}
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert fn["parameters"]["required"] == ["a"]


async def test_function_tool_call_sync_async_and_reward():
    async def scored(x: int):
        """Scored."""
        return f"x={x}", 1.0

    # call() returns what the function returned (verl); execute() reads it as verl does
    assert await FunctionTool(add).call({"a": 1, "b": 2}) == "3"
    assert await FunctionTool(add).execute("i", {"a": 1, "b": 2}) == (
        ToolResponse(text="3"),
        0.0,
        {},
    )
    assert await FunctionTool(scored).execute("i", {"x": 2}) == (ToolResponse(text="x=2"), 1.0, {})
    assert (await FunctionTool(lambda: {"k": 1}, name="j", description="d").execute("i", {}))[
        0
    ].text == '{"k": 1}'


@pytest.mark.parametrize(
    "ret, expected",
    [
        ("t", (ToolResponse(text="t"), 0.0, {})),
        ({"a": 1}, (ToolResponse(text='{"a": 1}'), 0.0, {})),
        (("t",), (ToolResponse(text="t"), 0.0, {})),
        (("t", None), (ToolResponse(text="t"), 0.0, {})),
        (("t", 1), (ToolResponse(text="t"), 1.0, {})),
        (("t", 0.5, {"n": 2}), (ToolResponse(text="t"), 0.5, {"n": 2})),
        ((ToolResponse(text="r"), 0.0, None), (ToolResponse(text="r"), 0.0, {})),
        (42, (ToolResponse(text="42"), 0.0, {})),
    ],
)
def test_function_tool_returns_read_as_verl_reads_them(ret, expected):
    assert normalize_function_tool_return(ret) == expected


@pytest.mark.parametrize("ret", [(), ("a", 1, {}, "extra")])
def test_function_tool_tuple_of_a_wrong_length_raises(ret):
    with pytest.raises(TypeError, match="length 1, 2, or 3"):
        normalize_function_tool_return(ret)


def test_function_tool_decorator_registers_with_verl_schema(tmp_path):
    path = tmp_path / "decorated_tools.py"
    path.write_text(
        "from rolloutbus.streams.agent_loop.tools import function_tool\n\n"
        "@function_tool\n"
        "def web_search(query: str, k: int = 3) -> str:\n"
        '    """Search the web.\n\n    Args:\n        query: what to look for\n'
        '        k: how many results\n    """\n'
        "    return query\n\n"
        "@function_tool('lookup')\n"
        "def find(key: str) -> str:\n"
        '    """Look a key up.\n\n    Args:\n        key: the key\n    """\n'
        "    return key\n\n"
        "def helper(x: int) -> int:\n"
        "    return x\n"
    )
    tools = load_function_tools(str(path))
    assert [t.name for t in tools] == ["lookup", "web_search"]  # only decorated ones, as verl
    search = FUNCTION_TOOL_REGISTRY["web_search"]
    params = search.tool_schema["function"]["parameters"]
    assert params["properties"]["query"] == {"type": "string", "description": "what to look for"}
    assert params["required"] == ["query"]


def test_tool_response_media_must_be_lists():
    with pytest.raises(ValueError, match="must be a list"):
        ToolResponse(image="one.png")
    assert ToolResponse(image=["one.png"]).image == ["one.png"]


def test_tools_from_verl_yaml(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: arithmetic\n"
        "        parameters: {type: object, properties: {expression: {type: string}},\n"
        "                     required: [expression]}\n"
    )
    [tool] = load_tools_from_config(path)
    assert (
        isinstance(tool, CalculatorTool)
        and tool.name == "calc"
        and tool.config == {"type": "native"}
    )


def test_bad_tool_config(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: no.such.Tool\n")
    with pytest.raises(AgentLoopError, match="no.such.Tool"):
        load_tools_from_config(path)
    with pytest.raises(AgentLoopError, match="not found"):
        load_tools_from_config(tmp_path / "missing.yaml")


def test_function_tools_from_an_undecorated_file_warn_as_verl(tmp_path, caplog):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "import json\n\n"
        'def lookup(key: str) -> str:\n    """Look a key up."""\n    return key\n\n'
        "def _private():\n    pass\n"
    )
    with caplog.at_level("WARNING"):
        tools = load_function_tools(str(path))
    assert [t.name for t in tools] == ["lookup"]  # a rolloutbus addition: public functions
    assert "no @function_tool decorators found; did you forget to apply the decorator?" in (
        caplog.text
    )  # verl's warning


def test_tool_schemas_render_as_verl_renders_them():
    """verl validates a schema into OpenAIFunctionToolSchema and dumps it: unknown keys
    (an array's ``items``, get_json_schema's ``return``) never reach the prompt."""
    from rolloutbus.streams.agent_loop.tool_parser import rendered_tool_schema

    schema = FunctionTool(add).get_openai_tool_schema() | {"extra": 1}
    schema["function"] = schema["function"] | {"return": {"type": "string"}}
    shown = rendered_tool_schema(schema)
    assert "extra" not in shown and "return" not in shown["function"]
    props = shown["function"]["parameters"]["properties"]
    assert props["tags"] == {"type": "array"}  # items dropped, as verl drops it
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert shown["function"]["parameters"]["required"] == ["a"]
    bare = {"type": "function", "function": {"name": "f", "description": "d"}}
    assert rendered_tool_schema(bare) == bare  # nothing unset is added


# ---- the catalog as verl's load_all_tools ------------------------------------------------

CATALOG_YAML = """tools:
  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function: {name: cat_lookup, description: d, parameters: {type: object, properties: {}}}
  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function: {name: cat_search, description: d, parameters: {type: object, properties: {}}}
  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool
    config: {type: native}
"""


def _decorated_file(tmp_path, names):
    lines = ["from rolloutbus.streams.agent_loop.tools import function_tool\n"]
    for name in names:
        lines.append(
            f"@function_tool\ndef {name}(key: str) -> str:\n"
            f'    """Find.\n\n    Args:\n        key: the key\n    """\n    return key\n'
        )
    path = tmp_path / f"catalog_{'_'.join(names)}.py"
    path.write_text("\n".join(lines))
    return path


def test_a_function_tool_named_like_a_yaml_tool_raises_naming_every_one(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(CATALOG_YAML)
    functions = _decorated_file(tmp_path, ["cat_search", "cat_lookup", "cat_fetch"])
    with pytest.raises(ValueError) as err:
        load_tool_catalog(str(config), str(functions))
    assert str(err.value) == (  # verl's message, both names, sorted
        "Function tool name(s) ['cat_lookup', 'cat_search'] collide with tools already "
        f"declared in '{config}'. Each tool name must be unique across `tool_config_path` and "
        "`function_tool_path`; rename one of them."
    )
    assert isinstance(err.value, AgentLoopError)  # still this project's error for a loop


def test_the_catalog_is_loaded_afresh_on_every_load(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text(CATALOG_YAML)
    functions = _decorated_file(tmp_path, ["fetch_fresh"])
    first = load_tool_catalog(str(config), str(functions))
    second = load_tool_catalog(str(config), str(functions))
    assert [t.name for t in first] == ["cat_lookup", "cat_search", "calculator", "fetch_fresh"]
    assert all(a is not b for a, b in zip(first[:3], second[:3], strict=True))  # new instances
    assert first[3] is second[3]  # a function-tool file runs once per process, as in verl


class PydanticSchema(BaseModel):
    """Stands in for verl's OpenAIFunctionToolSchema: a pydantic tool schema."""

    type: str
    function: dict


def test_pydantic_tool_schemas_are_kept_as_given():
    schema = PydanticSchema(type="function", function={"name": "calc", "description": "d"})
    tool = CalculatorTool(tool_schema=schema)
    assert tool.tool_schema is schema and tool.name == "calc"
    function = FunctionTool(add, tool_schema=schema)
    assert function.tool_schema is schema and function.name == "calc"
    verl_style = FunctionTool("calc", add, schema, is_async=False)  # verl's constructor
    assert verl_style.tool_schema is schema and verl_style.fn is add and not verl_style.is_async


def test_tool_catalog_errors_are_verls_exception_types(tmp_path):
    with pytest.raises(FileNotFoundError, match="tool config not found"):
        load_tools_from_config(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match="function_tool_path does not exist: "):
        load_function_tools(str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: no.such.Tool\n")
    with pytest.raises(ValueError, match="no.such.Tool"):
        load_tools_from_config(bad)
    with pytest.raises(ValueError, match="needs function.name"):
        BaseTool(tool_schema={"type": "function", "function": {}})


def test_function_tool_registered_twice_is_verls_value_error(tmp_path):
    path = tmp_path / "twice.py"
    path.write_text(
        "from rolloutbus.streams.agent_loop.tools import function_tool\n\n"
        "@function_tool('twice_tool', schema={'type': 'function', "
        "'function': {'name': 'twice_tool'}})\ndef a() -> str:\n    return 'a'\n\n"
        "@function_tool('twice_tool', schema={'type': 'function', "
        "'function': {'name': 'twice_tool'}})\ndef b() -> str:\n    return 'b'\n"
    )
    with pytest.raises(ValueError, match="Function tool 'twice_tool' is already registered to"):
        load_function_tools(str(path))
