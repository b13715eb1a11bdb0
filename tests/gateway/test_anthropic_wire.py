"""Anthropic's Messages shapes ↔ the gateway's chat messages, no broker (the SDK end to end
is test_gateway_anthropic.py): the blocks of a reply, plain and streamed, thinking where the
model samples the open marker (Qwen3's template) and where the prompt opened the think (a
template double of Qwen3-thinking-2507's), and the history rendered back into the tokens
sampled, through a gateway session whose replica is the scripted server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rolloutbus.config import Config
from rolloutbus.schemas.prompts import GroupSamplingParams
from rolloutbus.streams.agent_loop.continuous_token import get_builder
from rolloutbus.streams.gateway.anthropic import (
    MessageEvents,
    MessagesRequest,
    message_response,
    opens_thinking,
    split_thinking,
)
from rolloutbus.streams.gateway.messages import Reply
from rolloutbus.streams.gateway.session import GatewaySession, TurnResult
from rolloutbus.streams.gateway.streaming import ReplyText
from tests.builders import make_group_started
from tests.gateway.contexts import gateway_context
from tests.gateway.templates import open_think_template
from tests.scripted_server import ScriptedServerManager, scripted_turn


def _request(messages: list[dict], **fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 64, "messages": messages, **fields})


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    request = _request(
        [
            {"role": "user", "content": "add 2 and 3, then 4 and 5"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Adding."},
                    {"type": "tool_use", "id": "call_0_0", "name": "add", "input": {"a": 2}},
                    {"type": "tool_use", "id": "call_0_1", "name": "add", "input": {"a": 4}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_0_0", "content": "5"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_0_1",
                        "content": [{"type": "text", "text": "9"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
        system=[{"type": "text", "text": "Be brief."}],
        tools=[{"name": "add", "input_schema": {"type": "object"}}],
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 2 and 3, then 4 and 5"},
        {
            "role": "assistant",
            "content": "Adding.",
            "tool_calls": [
                {
                    "id": f"call_0_{i}",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": a})},
                }
                for i, a in ((0, 2), (1, 4))
            ],
        },
        {"role": "tool", "tool_call_id": "call_0_0", "content": "5"},
        {"role": "tool", "tool_call_id": "call_0_1", "content": "9"},
        {"role": "user", "content": "and now?"},
    ]
    assert request.chat_tools() == [
        {
            "type": "function",
            "function": {"name": "add", "description": "", "parameters": {"type": "object"}},
        }
    ]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tool_choice": {"type": "tool", "name": "add"}}, "tool_choice"),
        ({"thinking": {"type": "adaptive"}}, "thinking.type"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_cannot_be_honoured_is_named(fields, named):
    problem = _request([{"role": "user", "content": "hi"}], **fields).unsupported()
    assert problem is not None and named in problem
    assert (
        _request([{"role": "user", "content": "hi"}], metadata={"user_id": "u"}).unsupported()
        is None
    )


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([{"role": "system", "content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "tool_result", "content": "5"}]}], "tool_use_id"),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "'image' blocks"),
        ([{"role": "user", "content": 7}], "content blocks"),
    ],
)
def test_a_bad_message_is_refused_with_where(messages, named):
    with pytest.raises(ValueError, match=named) as refused:
        _request(messages).chat_messages()
    assert "messages[0]" in str(refused.value)


def _result(content: str, calls: list[dict], finish: str) -> TurnResult:
    return TurnResult(
        prompt_ids=[1, 2, 3],
        token_ids=[4, 5],
        logprobs=None,
        reply=Reply(content=content, tool_calls=calls, finish_reason=finish),
        outcome="sampled",
    )


def test_a_reply_becomes_blocks_and_its_stream_rebuilds_it():
    call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 2}'},
    }
    message = message_response(_result("Adding.", [call], "tool_calls"), "policy")
    assert message["content"] == [
        {"type": "text", "text": "Adding."},
        {"type": "tool_use", "id": "call_1_0", "name": "add", "input": {"a": 2}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 3, "output_tokens": 2}
    assert message_response(_result("", [], "length"), "p")["stop_reason"] == "max_tokens"
    assert message_response(_result("hi", [], "stop"), "p")["stop_reason"] == "end_turn"

    wire = MessageEvents("policy")  # nothing streamed before the turn ended: all of it now
    result = _result("Adding.", [call], "tool_calls")
    sent = [*wire.opening(), *wire.closing(result, "Adding.")]
    events = [e.decode().split("\n", 2) for e in sent]
    names = [name.removeprefix("event: ") for name, _, _ in events]
    assert names == (
        ["message_start"]
        + ["content_block_start", "content_block_delta", "content_block_stop"] * 2
        + ["message_delta", "message_stop"]
    )
    bodies = [json.loads(data.removeprefix("data: ")) for _, data, _ in events]
    assert bodies[2]["delta"] == {"type": "text_delta", "text": "Adding."}
    assert json.loads(bodies[5]["delta"]["partial_json"]) == {"a": 2}
    assert bodies[7]["delta"]["stop_reason"] == "tool_use"


# -- thinking (Qwen3's <think>…</think>) ----------------------------------------------------

REASONED = "<think>\nAdd 2 and 3.\n</think>\n\nAdding."


def _streamed_blocks(wire: MessageEvents, deltas: list[str], result: TurnResult) -> tuple:
    """The event names of a stream fed ``deltas``, and the content blocks it rebuilds."""
    sent = [*wire.opening()]
    for delta in deltas:
        sent += wire.text(delta)
    sent += wire.closing(result, "")
    events = [e.decode().split("\n", 2) for e in sent]
    names = [name.removeprefix("event: ") for name, _, _ in events]
    blocks: list[dict] = []
    for _, data, _ in events:
        body = json.loads(data.removeprefix("data: "))
        if body["type"] == "content_block_start":
            blocks.append(dict(body["content_block"]))
        elif body["type"] == "content_block_delta":
            delta, block = body["delta"], blocks[body["index"]]
            key = {"thinking_delta": "thinking", "text_delta": "text"}.get(delta["type"])
            if key:
                block[key] += delta[key]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                block["input"] = json.loads(delta["partial_json"])
    return names, blocks


# the end of a prompt: Qwen3's generation prompt, and one that opens the think (the
# prompt then leaves the reply inside its reasoning: DeepSeek-R1's, QwQ's, Qwen3-2507's)
PROMPT_END = {False: "<|im_start|>assistant\n", True: "<|im_start|>assistant\n<think>\n"}


def _events(tok, opened: bool) -> MessageEvents:
    """A thinking stream whose prompt ends as ``PROMPT_END[opened]``."""
    wire = MessageEvents("policy", thinking=True, tokenizer=tok)
    wire.prompt([1, 2] + tok.encode(PROMPT_END[opened], add_special_tokens=False))
    return wire


@pytest.mark.parametrize(
    ("content", "opened"),
    [
        (REASONED, False),
        ("<think>Add   2 and 3.</think>Adding.", False),  # not the template's layout: as sampled
        ("<think>\n\n</think>\n\nAdding.", False),  # an empty reasoning (enable_thinking off)
        ("<think>\nAdd 2 and", False),  # cut short by max_tokens inside the reasoning
        ("Adding.", False),  # no reasoning at all
        ("Add 2 and 3.\n</think>\n\nAdding.", True),  # the prompt opened the think
        ("Add   2 and 3.</think>Adding.", True),
        ("</think>\n\nAdding.", True),  # an empty reasoning
        ("Add 2 and", True),  # cut short inside the reasoning: all of it reasoning
        (REASONED, True),  # a model that opens the think again: its marker is sampled
    ],
)
def test_a_reply_with_thinking_is_a_thinking_block_that_renders_back_as_sampled(
    tok, content, opened
):
    call = {"id": "call_1_0", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    result = _result(content, [call], "tool_calls")
    message = message_response(result, "policy", thinking=True, opened=opened)
    thought, text = split_thinking(content, opened)
    if opened:
        assert thought is not None and (thought.head == "") != content.startswith("<think>")
    if thought is None:
        assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    else:
        assert message["content"][0]["type"] == "thinking"
        assert message["content"][0]["thinking"] == thought.thinking
        assert thought.head + thought.thinking + thought.tail + text == content
    # the agent echoes the message back: it renders into the text the model sampled
    history = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": message["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1_0"}]},
    ]
    assistant = _request(history).chat_messages()[1]
    assert assistant["content"] == content
    # streamed character by character, the blocks are the message's
    names, blocks = _streamed_blocks(_events(tok, opened), list(content), result)
    assert blocks == message["content"]
    if thought is not None and thought.thinking:
        assert names.count("content_block_delta") > 3  # in pieces, as it came
    assert message_response(result, "p")["content"][0] == {"type": "text", "text": content}


def test_the_reasoning_is_the_same_whole_or_streamed_in_any_pieces(tok):
    result = _result(REASONED, [], "stop")
    whole = message_response(result, "policy", thinking=True)["content"]
    assert [b["type"] for b in whole] == ["thinking", "text"]
    assert whole[0]["thinking"] == "Add 2 and 3." and whole[1]["text"] == "Adding."
    pieces = [tok.decode([t]) for t in tok.encode(REASONED, add_special_tokens=False)]
    names, blocks = _streamed_blocks(MessageEvents("policy", thinking=True), pieces, result)
    assert blocks == whole
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    _, together = _streamed_blocks(MessageEvents("policy", thinking=True), [REASONED], result)
    assert together == whole


def test_a_thinking_block_without_our_signature_renders_in_the_templates_layout():
    edited = {"type": "thinking", "thinking": "Add 2 and 3.", "signature": "EqQBCkYIBxgCKkD"}
    forged = {
        **edited,
        "signature": message_response(_result(REASONED, [], "stop"), "p", thinking=True)["content"][
            0
        ]["signature"],
        "thinking": "Something else.",
    }
    for block in (edited, forged):
        history = [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": [block, {"type": "text", "text": "Adding."}]},
            {"role": "user", "content": "and?"},
        ]
        text = block["thinking"]
        expected = f"<think>\n{text}\n</think>\n\nAdding."
        assert _request(history).chat_messages()[1]["content"] == expected


def test_thinking_needs_think_markers_in_the_template(tok):
    enabled = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    asked = _request([{"role": "user", "content": "hi"}], **enabled)
    assert asked.unsupported() is None and asked.shows_thinking
    assert asked.thinking_refused(tok.chat_template) is None  # Qwen3's has them
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    problem = asked.thinking_refused(plain)
    assert problem is not None and "think markers" in problem and "has none" in problem
    block = {"type": "thinking", "thinking": "hm", "signature": ""}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [block, {"type": "text", "text": "yo"}]},
        {"role": "user", "content": "and?"},
    ]
    problem = _request(history).thinking_refused(plain)
    assert problem is not None and "a thinking block in the history" in problem
    assert _request(history).thinking_refused(tok.chat_template) is None
    assert not _request(history, thinking={"type": "disabled"}).shows_thinking
    sampling = GroupSamplingParams()
    assert asked.ignored_sampling(sampling) == ["thinking.budget_tokens"]
    with pytest.raises(ValueError, match="thinking"):  # thinking belongs to the assistant
        _request([{"role": "user", "content": [block]}]).chat_messages()


# -- a prompt that opens the think (DeepSeek-R1's, QwQ's, Qwen3-thinking-2507's templates) ----
# the template is a test double (tests/gateway/templates.py): Qwen3's, whose generation
# prompt opens the think as those templates' do

CALCULATOR = {
    "name": "calculator",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


class _Log:
    """A session's events in a list (no broker)."""

    def __init__(self) -> None:
        self.events: list = []

    async def emit(self, event) -> None:
        self.events.append(event)


async def _session(tok, replies: list[str], **template_kwargs) -> tuple[GatewaySession, Any]:
    """A gateway session whose replica is the scripted server (a test double) sampling the
    tokens of ``replies``, each ended by ``<|im_end|>``, one per call."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    server = ScriptedServerManager(
        [scripted_turn(tok.encode(r, add_special_tokens=False) + [end]) for r in replies]
    )
    cfg = Config.model_validate({"model": {"name": "tiny-qwen3"}})
    ctx = gateway_context(tok, cfg, server, _Log().emit, **template_kwargs)
    group = make_group_started("g1", attempt="ga", row={}, sampling_params={})
    session = GatewaySession(ctx, group, 0)
    await session.begin()
    return session, server


def test_opens_thinking_reads_the_end_of_the_rendered_prompt(tok):
    question = [{"role": "user", "content": "add 2 and 3"}]
    assert opens_thinking(tok, get_builder(tok).build_initial_tokens(question)) is False
    opened = get_builder(tok, chat_template=open_think_template(tok))
    assert opens_thinking(tok, opened.build_initial_tokens(question)) is True
    no_think = get_builder(tok, enable_thinking=False)  # <think>\n\n</think>\n\n: closed
    assert opens_thinking(tok, no_think.build_initial_tokens(question)) is False
    # an earlier reply cut short inside its reasoning leaves no later turn open
    cut = tok.encode("<|im_start|>assistant\n<think>\nAdd 2 and", add_special_tokens=False)
    later = tok.encode("<|im_end|>\n<|im_start|>user\nso?<|im_end|>\n<|im_start|>assistant\n")
    assert opens_thinking(tok, cut + later) is False


REASONED_TURNS = [  # Qwen3's template: the model samples the open marker
    (
        "<think>\nI should use the calculator.\n</think>\n\n" + CALL,
        "<think>\nIt is 5.\n</think>\n\n5.",
    ),
    # the template's generation prompt opened the think: the reasoning comes first
    ("I should use the calculator.\n</think>\n\n" + CALL, "It is 5.\n</think>\n\n5."),
]


@pytest.mark.parametrize(
    ("opened", "replies"), [(False, REASONED_TURNS[0]), (True, REASONED_TURNS[1])]
)
async def test_thinking_blocks_echoed_back_render_into_the_sampled_tokens(tok, opened, replies):
    template = {"chat_template": open_think_template(tok)} if opened else {}
    session, server = await _session(tok, list(replies), **template)
    history: list[dict] = [{"role": "user", "content": "add 2 and 3"}]
    fields = {"tools": [CALCULATOR], "thinking": {"type": "enabled"}}
    results, messages = [], []
    for _ in replies:
        request = _request(history, **fields)
        result = await session.chat(request.chat_messages(), request.chat_tools(), 256)
        assert opens_thinking(tok, result.prompt_ids) is opened
        message = message_response(result, "policy", True, opened)
        results.append(result)
        messages.append(message)
        history.append({"role": "assistant", "content": message["content"]})
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "x", "content": "5"}],
            }
        )
    call, answer = messages
    assert [b["type"] for b in call["content"]] == ["thinking", "tool_use"]
    assert call["content"][0]["thinking"] == "I should use the calculator."
    assert call["content"][1]["input"] == {"expression": "2 + 3"}
    assert [b["type"] for b in answer["content"]] == ["thinking", "text"]
    assert answer["content"][0]["thinking"] == "It is 5." and answer["content"][1]["text"] == "5."
    # the echoed call turn rendered into the very tokens sampled: the second prompt extends
    # the first prompt and its sampled ids, one segment, nothing re-rendered
    first, second = results
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.token_ids)] == (
        first.prompt_ids + first.token_ids
    )
    assert len(session.transcript.segments) == 1 and len(server.calls) == 2
    # the echoed reasoning is the text the model sampled (its open marker the prompt's)
    echoed = _request(history[:2]).chat_messages()[1]
    assert (
        echoed["content"] == results[0].reply.content == replies[0].split("<tool_call>")[0].strip()
    )


@pytest.mark.parametrize("opened", [False, True])
async def test_streamed_the_reasoning_comes_first_as_it_is_sampled(tok, opened):
    reply = REASONED_TURNS[int(opened)][1]
    template = {"chat_template": open_think_template(tok)} if opened else {}
    session, _ = await _session(tok, [reply], **template)
    request = _request([{"role": "user", "content": "add 2 and 3"}], thinking={"type": "enabled"})
    result = await session.chat(request.chat_messages(), None, 256)
    whole = message_response(result, "policy", True, opened)["content"]
    assert [b["type"] for b in whole] == ["thinking", "text"] and whole[0]["thinking"] == "It is 5."
    # the tokens fed one by one, as a replica streams them, through the gateway's decoding
    text = ReplyText(tok, "hermes")
    wire = MessageEvents("policy", thinking=True, tokenizer=tok)
    wire.prompt(result.prompt_ids)
    sent, close = [*wire.opening()], tok.convert_tokens_to_ids("</think>")
    for token in result.token_ids:
        if token == close:
            before_close = _delta_types(sent)
        sent += wire.text(text.add([token]))
    sent += wire.closing(result, text.rest(result.reply.content))
    assert len(before_close) > 1 and set(before_close) == {"thinking_delta"}  # as sampled
    types = _delta_types(sent)
    signed = types.index("signature_delta")
    assert set(types[:signed]) == {"thinking_delta"} and set(types[signed + 1 :]) == {"text_delta"}
    _, blocks = _streamed_blocks(
        _events(tok, opened), [text.text.removesuffix("<|im_end|>")], result
    )
    assert blocks == whole  # the same blocks from the text in one piece


def _delta_types(sent: list[bytes]) -> list[str]:
    bodies = [json.loads(e.decode().split("\n", 2)[1].removeprefix("data: ")) for e in sent]
    return [b["delta"]["type"] for b in bodies if b["type"] == "content_block_delta"]
