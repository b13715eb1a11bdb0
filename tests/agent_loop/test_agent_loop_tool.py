"""tool_agent: the state machine, termination checks, budgets, tools and parsers."""

import asyncio
import json
import warnings

import pytest

from rolloutbus.schemas.agent_loop import TokenOutput
from rolloutbus.streams.agent_loop import (
    DictConfigWrap,
    ToolAgentLoop,
    create_agent_loop,
    tool_agent,
)
from rolloutbus.streams.agent_loop.tool_agent import (
    TRUNCATED_HEAD,
    TRUNCATED_MIDDLE,
    TRUNCATED_TAIL,
)
from rolloutbus.streams.agent_loop.tool_parser import (
    FunctionCall,
    HermesToolParser,
    ToolParser,
)
from rolloutbus.streams.agent_loop.tools import BaseTool, CalculatorTool, FunctionTool, ToolResponse
from tests.scripted_server import (
    ScriptedServerManager,
    make_config,
    scripted_turn,
)
from tests.source_tree import PLUGINS

PROMPT = [{"role": "user", "content": "计算 18 * 7"}]


def call_text(name="calculator", arguments=None):
    args = {"expression": "18 * 7"} if arguments is None else arguments
    body = args if isinstance(args, str) else json.dumps(args)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'


def turn(tok, text, **fields):
    """Scripted assistant turn: the text's tokens + <|im_end|>, each with logprob -0.5."""
    return scripted_turn(
        tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")],
        **fields,
    )


def make_loop(tok, outputs, tools=None, multi_turn=None, **rollout):
    server = ScriptedServerManager(outputs)
    config = make_config(multi_turn=multi_turn or {}, **rollout)
    loop = ToolAgentLoop(
        DictConfigWrap(config),
        server,
        tok,
        None,
        tools=[CalculatorTool()] if tools is None else tools,
    )
    return loop, server


async def run(loop, **row):
    return await loop.run({"temperature": 1.0, "logprobs": True}, raw_prompt=PROMPT, **row)


def observation_text(tok, out):
    return tok.decode(
        [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m == 0]
    )


async def test_seed_section_11_layout(tok, tmp_path):
    """P; A1 ‖ O ‖ A2 with masks 1…0…1 and logprob 0.0 on O — tools from verl's YAML format."""
    config_path = tmp_path / "tools.yaml"
    config_path.write_text(
        "tools:\n  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool\n    "
        "config: {}\n"
    )
    server = ScriptedServerManager([turn(tok, call_text()), turn(tok, "The answer is 126.")])
    config = make_config(multi_turn={"tool_config_path": str(config_path)})
    loop = create_agent_loop(
        "tool_agent",
        trainer_config=DictConfigWrap(config),
        server_manager=server,
        tokenizer=tok,
        processor=None,
    )
    out = await run(loop, uid="u", session_id=0, extra_info={"index": 42})

    first, second = server.calls
    a1 = first_turn_len = len(tok.encode(call_text(), add_special_tokens=False)) + 1
    a2 = len(tok.encode("The answer is 126.", add_special_tokens=False)) + 1
    assert out.prompt_ids == first.prompt_ids
    assert '"name": "calculator"' in tok.decode(out.prompt_ids)  # the tool schema is in the prompt
    assert (
        second.prompt_ids
        == out.prompt_ids + out.response_ids[: len(second.prompt_ids) - len(out.prompt_ids)]
    )
    assert (
        second.prompt_ids + out.response_ids[-a2:] == out.prompt_ids + out.response_ids
    )  # append-only
    n_obs = len(out.response_ids) - a1 - a2
    assert out.response_mask == [1] * a1 + [0] * n_obs + [1] * a2
    assert out.response_logprobs == [-0.5] * a1 + [0.0] * n_obs + [-0.5] * a2
    assert observation_text(tok, out) == (
        "\n<|im_start|>user\n<tool_response>\n126\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert first_turn_len == a1
    assert out.num_turns == 4  # user 1 + assistant 2 + 1
    assert first.request_id == second.request_id  # one id per trajectory: sticky
    assert out.metrics.tool_calls > 0 and out.metrics.generate_sequences > 0
    assert out.extra_fields["tool_rewards"] == [] and out.extra_fields["turn_scores"] == []


async def test_terminates_when_the_mask_reaches_response_length(tok):
    loop, server = make_loop(tok, [turn(tok, call_text()), turn(tok, "x")], response_length=10)
    out = await run(loop)
    assert len(server.calls) == 1  # the tool call is never run
    assert (
        len(out.response_ids) == 10
        and out.response_mask == [1] * 10
        and len(out.response_logprobs) == 10
    )
    assert out.num_turns == 2


async def test_max_assistant_turns(tok):
    loop, server = make_loop(
        tok, [turn(tok, call_text())] * 3, multi_turn={"max_assistant_turns": 1}
    )
    out = await run(loop)
    assert len(server.calls) == 1 and out.num_turns == 2 and 0 not in out.response_mask


async def test_max_user_turns(tok):
    loop, server = make_loop(tok, [turn(tok, call_text())] * 3, multi_turn={"max_user_turns": 1})
    out = await run(loop)
    assert len(server.calls) == 2 and out.num_turns == 4  # the second call's tool is not run


async def test_no_tool_call_terminates(tok):
    loop, server = make_loop(tok, [turn(tok, "126")])
    out = await run(loop)
    assert len(server.calls) == 1 and out.num_turns == 2


async def test_observation_that_would_reach_the_budget_is_dropped(tok):
    a1 = len(tok.encode(call_text(), add_special_tokens=False)) + 1
    loop, server = make_loop(
        tok, [turn(tok, call_text()), turn(tok, "126")], response_length=a1 + 5
    )
    out = await run(loop)
    assert len(server.calls) == 1
    assert len(out.response_ids) == a1 and out.response_mask == [1] * a1
    assert out.num_turns == 2  # user_turns was not counted


async def test_parallel_calls_are_capped(tok):
    three = "\n".join([call_text(arguments={"expression": e}) for e in ["1+1", "2+2", "3+3"]])
    loop, server = make_loop(
        tok, [turn(tok, three), turn(tok, "done")], multi_turn={"max_parallel_calls": 2}
    )
    out = await run(loop)
    obs = observation_text(tok, out)
    assert (
        obs.count("<tool_response>") == 2
        and "\n2\n" in obs
        and "\n4\n" in obs
        and "\n6\n" not in obs
    )
    assert obs.count("<|im_start|>user") == 1


@pytest.mark.parametrize(
    "side, expected",
    [
        ("left", TRUNCATED_HEAD + "vwxyz"),  # verl PR #6313: "left" keeps the tail
        ("right", "abcde" + TRUNCATED_TAIL),
        ("middle", "ab" + TRUNCATED_MIDDLE + "yz"),
    ],
)
async def test_tool_text_truncation_by_characters(tok, side, expected):
    assert (TRUNCATED_TAIL, TRUNCATED_HEAD, TRUNCATED_MIDDLE) == (
        "...(truncated)",
        "(truncated)...",
        "...(truncated)...",
    )

    def alphabet() -> str:
        """All the letters."""
        return "abcdefghijklmnopqrstuvwxyz"

    multi_turn = {"max_tool_response_length": 5, "tool_response_truncate_side": side}
    loop, _ = make_loop(
        tok,
        [turn(tok, call_text("alphabet", {})), turn(tok, "ok")],
        tools=[FunctionTool(alphabet)],
        multi_turn=multi_turn,
    )
    assert loop.truncate_tool_text("abcdefghijklmnopqrstuvwxyz") == expected
    assert loop.truncate_tool_text("abcde") == "abcde"
    out = await run(loop)
    assert f"<tool_response>\n{expected}\n</tool_response>" in observation_text(tok, out)


async def test_tool_timeout_becomes_error_text(tok):
    async def slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "late"

    loop, _ = make_loop(
        tok,
        [turn(tok, call_text("slow", {"seconds": 5})), turn(tok, "ok")],
        tools=[FunctionTool(slow)],
        multi_turn={"tool_timeout_s": 0.05},
    )
    out = await run(loop)
    assert "Error executing tool 'slow': timed out after 0.05 s" in observation_text(tok, out)
    assert out.extra_fields["tool_rewards"] == [0.0]


@pytest.mark.parametrize(
    "text, message",
    [
        (call_text("nope"), "Unknown function 'nope'. Available tools: ['calculator']"),
        (
            call_text(arguments={"expression": "1/0"}),
            "Error executing tool 'calculator': division by zero",
        ),
        (
            call_text(arguments={"expression": "__import__('os')"}),
            "Error executing tool 'calculator': unsupported element",
        ),
    ],
)
async def test_tool_failures_become_verl_error_text_with_zero_reward(tok, text, message):
    loop, _ = make_loop(tok, [turn(tok, text), turn(tok, "ok")])
    out = await run(loop)
    assert message in observation_text(tok, out)
    assert out.extra_fields["tool_rewards"] == [0.0]


async def test_invalid_json_arguments_are_verl_error_text(tok):
    """gpt-oss passes the arguments through unparsed, so the loop answers bad JSON itself."""
    loop, _ = make_loop(tok, [])
    data = tool_agent.AgentData(
        [], None, None, None, None, {}, request_id="r", tools_kwargs={}, tools=dict(loop.tools)
    )
    call = FunctionCall(name="calculator", arguments='{"expression": "1+"')
    response, reward, _ = await loop._call_tool(call, data.tools_kwargs, data)  # verl's
    assert response.text.startswith("Invalid JSON in arguments for 'calculator': ")
    assert reward == 0.0
    with pytest.warns(DeprecationWarning, match="_call_tool"):  # the earlier two arguments
        old_style = await loop._call_tool(call, data)
    assert old_style == (response, reward, {})


async def test_a_malformed_hermes_call_ends_the_trajectory(tok):
    """verl's Hermes parser drops a call whose JSON does not parse: no tool turn follows."""
    loop, server = make_loop(
        tok, [turn(tok, call_text(arguments='{"expression": 18 *}')), turn(tok, "never")]
    )
    out = await run(loop)
    assert len(server.calls) == 1 and out.num_turns == 2
    assert out.response_mask == [1] * len(out.response_ids)


class CountingTool(BaseTool):
    """A stateful tool: records create/execute/release and returns a reward."""

    def __init__(self):
        super().__init__(
            tool_schema={"type": "function", "function": {"name": "count", "parameters": {}}}
        )
        self.events = []

    async def create(self, instance_id=None, **kwargs):
        self.events.append(("create", kwargs))
        return "inst-1", ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        self.events.append(("execute", instance_id, "agent_data" in kwargs))
        return "counted", 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.events.append(("release", instance_id))


async def test_base_tool_life_cycle_and_rewards(tok):
    tool = CountingTool()
    loop, _ = make_loop(tok, [turn(tok, call_text("count", {})), turn(tok, "ok")], tools=[tool])
    out = await run(loop, tools_kwargs={"count": {"create_kwargs": {"ground_truth": "126"}}})
    assert tool.events == [
        ("create", {"create_kwargs": {"ground_truth": "126"}}),
        ("execute", "inst-1", True),
        ("release", "inst-1"),
    ]
    assert out.extra_fields["tool_rewards"] == [0.5]


async def test_tool_selection_filters_tools(tok):
    def other() -> str:
        """Another tool."""
        return "other"

    loop, _ = make_loop(
        tok,
        [turn(tok, call_text("other", {})), turn(tok, "ok")],
        tools=[CalculatorTool(), FunctionTool(other)],
    )
    out = await run(loop, extra_info={"tool_selection": ["calculator", "no_such_tool"]})
    prompt = tok.decode(out.prompt_ids)
    assert '"calculator"' in prompt and '"other"' not in prompt  # unknown names: ignored
    assert "Unknown function 'other'. Available tools: ['calculator']" in observation_text(tok, out)


@pytest.mark.parametrize("selection", [[], None])
async def test_an_empty_tool_selection_keeps_every_tool(tok, selection):
    def other() -> str:
        """Another tool."""
        return "other"

    loop, _ = make_loop(tok, [turn(tok, "ok")], tools=[CalculatorTool(), FunctionTool(other)])
    out = await run(loop, extra_info={"tool_selection": selection})
    prompt = tok.decode(out.prompt_ids)
    assert '"calculator"' in prompt and '"other"' in prompt


class SessionTool(BaseTool):
    """Keeps per-trajectory data where verl's tools keep it: agent_data.extra_fields."""

    def __init__(self):
        super().__init__(
            tool_schema={"type": "function", "function": {"name": "note", "parameters": {}}}
        )

    async def execute(self, instance_id, parameters, agent_data=None, **kwargs):
        agent_data.extra_fields.setdefault("notes", []).append(agent_data.assistant_turns)
        return "noted", None, {}


async def test_tools_extra_fields_reach_the_output(tok):
    loop, _ = make_loop(
        tok,
        [
            turn(tok, call_text("note", {}), extra_fields={"global_steps": 4}),
            turn(tok, call_text("note", {})),
            turn(tok, "done"),
        ],
        tools=[SessionTool()],
    )
    out = await run(loop)
    assert out.extra_fields["notes"] == [1, 2] and out.extra_fields["global_steps"] == 4
    assert out.extra_fields["tool_rewards"] == []  # a None reward is not recorded


async def test_function_tool_tuples_and_default_reward(tok):
    def triple(x: int):
        """Triple."""
        return f"x={x}", None, {"m": 1}

    def plain() -> str:
        """Plain."""
        return "plain"

    loop, _ = make_loop(
        tok,
        [
            turn(tok, call_text("triple", {"x": 2})),
            turn(tok, call_text("plain", {})),
            turn(tok, "ok"),
        ],
        tools=[FunctionTool(triple), FunctionTool(plain)],
    )
    out = await run(loop)
    obs = observation_text(tok, out)
    assert "x=2" in obs and "plain" in obs
    assert out.extra_fields["tool_rewards"] == [0.0, 0.0]  # verl: a missing reward is 0.0


async def test_preemptions_summed_and_extra_fields_from_the_first_turn(tok):
    outputs = [
        turn(
            tok,
            call_text(),
            num_preempted=1,
            extra_fields={"global_steps": 1, "max_global_steps": 1, "spec_num_draft_tokens": 3},
        ),
        turn(
            tok,
            call_text(),
            extra_fields={
                "global_steps": 9,
                "max_global_steps": 2,
                "spec_num_draft_tokens": 4,
                "spec_other": 4,
            },
        ),
        turn(tok, "126", num_preempted=2, extra_fields={"global_steps": 9, "max_global_steps": 3}),
    ]
    loop, _ = make_loop(tok, outputs)
    out = await run(loop)
    assert out.metrics.num_preempted == 3
    assert out.extra_fields["global_steps"] == 1 and out.extra_fields["max_global_steps"] == 3
    assert out.extra_fields["spec_num_draft_tokens"] == 7  # summed, as verl sums them
    assert "spec_other" not in out.extra_fields  # later turns add no other key


async def test_unknown_preemption_is_minus_one(tok):
    loop, _ = make_loop(tok, [TokenOutput(token_ids=[1, 2])])
    out = await run(loop)
    assert out.metrics.num_preempted == -1 and out.response_logprobs is None


class StopParser(HermesToolParser):
    @property
    def stop_token_ids(self):
        return [151658]  # </tool_call>


async def test_parser_stop_tokens_are_injected(tok):
    ToolParser.register("test_stop")(StopParser)
    loop, server = make_loop(tok, [turn(tok, "ok")], multi_turn={"format": "test_stop"})
    await loop.run({"stop_token_ids": [1]}, raw_prompt=PROMPT)
    assert server.calls[0].sampling_params["stop_token_ids"] == [1, 151658]


async def test_routed_experts_capped_at_prompt_plus_response(tok):
    loop, _ = make_loop(
        tok,
        [TokenOutput(token_ids=list(range(20)), routed_experts=list(range(5000)))],
        response_length=8,
    )
    out = await run(loop)
    assert len(out.response_ids) == 8 and out.routed_experts == list(range(len(out.prompt_ids) + 8))


# ---- parsers ---------------------------------------------------------------------------


async def test_hermes_parser(tok):
    parser = ToolParser.get_tool_parser("hermes", tok)
    ids = tok.encode(
        "Let me call " + call_text() + call_text("f", {"a": [1]}), add_special_tokens=False
    )
    content, calls = await parser.extract_tool_calls(ids)
    assert content == "Let me call "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calculator", {"expression": "18 * 7"}),
        ("f", {"a": [1]}),
    ]
    assert parser.stop_token_ids == []


async def test_hermes_drops_a_call_whose_json_is_invalid(tok):
    parser = ToolParser.get_tool_parser("hermes", tok)
    text = call_text(arguments='{"expression": 18 *}') + call_text("f", {"a": 1})
    _, calls = await parser.extract_tool_calls(tok.encode(text, add_special_tokens=False))
    assert [c.name for c in calls] == ["f"]


async def test_gpt_oss_parser(tok):
    parser = ToolParser.get_tool_parser("gpt-oss", tok)
    text = (
        "<|start|>assistant<|channel|>analysis<|message|>maybe to=functions.fake "
        "<|constrain|>json<|message|>{}<|call|><|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        '<|message|>{"expression": "18 * 7"}<|call|>'
    )
    content, calls = await parser.extract_tool_calls(tok.encode(text, add_special_tokens=False))
    assert [(c.name, c.arguments) for c in calls] == [("calculator", '{"expression": "18 * 7"}')]
    assert "analysis" not in content and "calculator" not in content


async def test_qwen3_coder_parser(tok):
    parser = ToolParser.get_tool_parser("qwen3_coder", tok)
    text = (
        "I will compute.<tool_call>\n<function=calculator>\n<parameter=expression>\n18 * "
        "7\n</parameter>\n"
        "<parameter=precision>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}, "precision": {"type": "integer"}},
            },
        },
    }
    content, calls = await parser.extract_tool_calls(ids, [schema])
    assert content == "I will compute."
    assert calls[0].name == "calculator"
    assert json.loads(calls[0].arguments) == {"expression": "18 * 7", "precision": 2}
    _, untyped = await parser.extract_tool_calls(ids)  # no schema: strings, as in verl
    assert json.loads(untyped[0].arguments) == {"expression": "18 * 7", "precision": "2"}


@pytest.mark.parametrize(
    "kind, raw, value",
    [
        ("integer", "7", 7),
        ("integer", "x", "x"),
        ("number", "2.0", 2),
        ("number", "2.5", 2.5),
        ("boolean", "True", True),
        ("boolean", "yes", False),
        ("object", '{"a": 1}', {"a": 1}),
        ("array", "[1, 2]", [1, 2]),
        ("string", "null", None),
    ],
)
def test_qwen3_coder_types_values_from_the_schema(kind, raw, value):
    from rolloutbus.streams.agent_loop.tool_parser import convert_typed_value

    assert convert_typed_value(raw, "p", {"p": {"type": kind}}, "f") == value


def test_unknown_parser_is_an_error(tok):
    from rolloutbus.errors import AgentLoopError

    with pytest.raises(AgentLoopError, match="hermes"):
        ToolParser.get_tool_parser("nope", tok)


async def test_seed_trajectory_scores_one_with_the_default_reward(tok):
    from rolloutbus.streams.reward import ARITHMETIC_SOURCE, score_outputs_async

    loop, _ = make_loop(tok, [turn(tok, call_text()), turn(tok, "The answer is 126.")])
    out = await run(loop)
    row = {"data_source": ARITHMETIC_SOURCE, "reward_model": {"ground_truth": "126"}}
    await score_outputs_async([out], row, tok)
    assert out.reward_score == 1.0 and out.as_dict()["rm_scores"][-1] == 1.0


async def test_logprobs_on_some_turns_only_raise_as_in_verl(tok):
    """verl raises a ValueError when a later turn comes back without logprobs."""
    without = TokenOutput(token_ids=tok.encode("ok", add_special_tokens=False))
    loop, _ = make_loop(tok, [turn(tok, call_text()), without])
    with pytest.raises(ValueError, match="some turns only"):
        await run(loop)


async def test_assistant_logprobs_must_match_the_tokens(tok):
    loop, _ = make_loop(tok, [])
    with pytest.raises(ValueError, match="must match"):
        await loop.ct_merge_assistant_token([1], [2, 3], [], [], assistant_logprobs=[-0.1])


# ---- verl's override points ----------------------------------------------------------


def _ported_loop_class(tmp_path):
    """tests/plugins/verl_style_tool_loop.py, written against verl 0.9.1, with its imports
    pointed at Rollout Bus and nothing else changed."""
    from rolloutbus.streams.plugins import import_object
    from tests.verl_port import port_file

    ported = port_file(PLUGINS / "verl_style_tool_loop.py", tmp_path)
    return import_object(f"{ported}:AuditedToolLoop", what="test loop", kind="class")


async def test_a_verl_style_subclass_overriding_both_points_runs(tok, tmp_path):
    cls = _ported_loop_class(tmp_path)
    server = ScriptedServerManager([turn(tok, call_text()), turn(tok, "The answer is 126.")])
    loop = cls(DictConfigWrap(make_config()), server, tok, None, tools=[CalculatorTool()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # verl's signature: no warning
        out = await run(loop, tools_kwargs={"calculator": {"create_kwargs": {}}})
    assert out.extra_fields["assistant_messages"] == 2  # _build_assistant_message, per turn
    assert out.extra_fields["tools_called"] == ["calculator"]  # _call_tool(call, kwargs, data)
    assert "<tool_response>\n[checked] 126\n</tool_response>" in observation_text(tok, out)
    assert out.response_mask.count(0) > 0 and out.num_turns == 4


class LegacyCallToolLoop(ToolAgentLoop):
    """Overrides _call_tool with this project's earlier (call, agent_data) signature."""

    async def _call_tool(self, call, agent_data):
        response, reward, metrics = await super()._call_tool(
            call, agent_data.tools_kwargs, agent_data
        )
        return response.model_copy(update={"text": "legacy " + response.text}), reward, metrics


async def test_the_earlier_call_tool_signature_still_runs_with_a_deprecation_warning(tok):
    server = ScriptedServerManager([turn(tok, call_text()), turn(tok, "ok")])
    config = DictConfigWrap(make_config())
    loop = LegacyCallToolLoop(config, server, tok, None, tools=[CalculatorTool()])
    with pytest.warns(DeprecationWarning, match=r"_call_tool\(call, agent_data\) is deprecated"):
        out = await run(loop)
    assert "<tool_response>\nlegacy 126\n</tool_response>" in observation_text(tok, out)


async def test_build_assistant_message_is_what_the_history_holds(tok):
    """verl's message: the parsed text and the calls, arguments as a dict (the raw text
    when they are not a JSON object), the id when the model wrote one."""
    loop, _ = make_loop(tok, [])
    data = tool_agent.AgentData([], None, None)
    data.tool_calls = [
        FunctionCall(name="calculator", arguments='{"expression": "1"}', tool_call_id="c1"),
        FunctionCall(name="calculator", arguments="[1]"),
    ]
    loop.max_parallel_calls = 2
    assert loop._build_assistant_message("hi", data) == {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "1"}},
                "id": "c1",
            },
            {"type": "function", "function": {"name": "calculator", "arguments": "[1]"}},
        ],
    }
    data.tool_calls = []
    assert loop._build_assistant_message(None, data) == {"role": "assistant", "content": ""}


async def test_the_tool_timeout_also_bounds_an_overridden_call_tool(tok):
    class SlowLoop(ToolAgentLoop):
        async def _call_tool(self, tool_call, tools_kwargs, agent_data):
            await asyncio.sleep(5)

    server = ScriptedServerManager([turn(tok, call_text()), turn(tok, "ok")])
    config = make_config(multi_turn={"tool_timeout_s": 0.05})
    loop = SlowLoop(DictConfigWrap(config), server, tok, None, tools=[CalculatorTool()])
    out = await run(loop)
    assert "timed out after 0.05 s" in observation_text(tok, out)


# ---- parsers from outside the tree (rollout.multi_turn.format: a dotted path) -----------


class UpperParser(ToolParser):
    """A parser defined outside the registry: every turn is one call to `calculator`."""

    async def extract_tool_calls(self, responses_ids, tools=None):
        text = await self._decode(responses_ids)
        return "", [FunctionCall(name="calculator", arguments=json.dumps({"expression": text}))]


async def test_a_parser_class_by_dotted_path(tok):
    parser = ToolParser.get_tool_parser(f"{__name__}.UpperParser", tok)
    assert isinstance(parser, UpperParser)
    content, calls = await parser.extract_tool_calls(tok.encode("1+1", add_special_tokens=False))
    assert calls[0].name == "calculator" and json.loads(calls[0].arguments) == {"expression": "1+1"}


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.parsers.P", "cannot load tool parser .* no module named 'no_such_pkg'"),
        ("json:nope", "cannot load tool parser .* 'json' has no attribute 'nope'"),
        ("json:dumps", "cannot load tool parser .* it is a function, not a class"),
        ("json:JSONDecoder", "JSONDecoder has no extract_tool_calls method"),
    ],
)
def test_a_bad_parser_path_is_the_importers_error(tok, path, message):
    from rolloutbus.streams.agent_loop.tool_parser import UnknownToolParserError

    with pytest.raises(UnknownToolParserError, match=message) as err:
        ToolParser.get_tool_parser(path, tok)
    assert isinstance(err.value, ValueError)  # verl raises ValueError for an unknown format
