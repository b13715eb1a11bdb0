"""Anthropic's Messages shapes ↔ the gateway's chat messages (pure; the SDK end to end is
test_gateway_anthropic.py)."""

from __future__ import annotations

import json

import pytest

from rolloutbus.schemas.prompts import GroupSamplingParams
from rolloutbus.streams.gateway.anthropic import (
    MessageEvents,
    MessagesRequest,
    message_response,
    split_thinking,
)
from rolloutbus.streams.gateway.messages import Reply
from rolloutbus.streams.gateway.session import TurnResult


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
        ({"stop_sequences": ["END"]}, "stop_sequences"),
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


@pytest.mark.parametrize(
    "content",
    [
        REASONED,
        "<think>Add   2 and 3.</think>Adding.",  # not the template's layout: kept as sampled
        "<think>\n\n</think>\n\nAdding.",  # an empty reasoning (enable_thinking off)
        "<think>\nAdd 2 and",  # cut short by max_tokens inside the reasoning
        "Adding.",  # no reasoning at all
    ],
)
def test_a_reply_with_thinking_is_a_thinking_block_that_renders_back_as_sampled(content):
    call = {"id": "call_1_0", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    result = _result(content, [call], "tool_calls")
    message = message_response(result, "policy", thinking=True)
    thought, text = split_thinking(content)
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
    names, blocks = _streamed_blocks(MessageEvents("policy", thinking=True), list(content), result)
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
