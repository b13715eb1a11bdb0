"""Continuous Token with the real Qwen3 tokenizer: the incremental stream vs a full render."""

import pytest

from rolloutbus.errors import AgentLoopError
from rolloutbus.streams.agent_loop.continuous_token import ContinuousTokenBuilder, render_ids

CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'
)
TOOL_CALLS = [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "18 * 7"}}}
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def ct(tok):
    return ContinuousTokenBuilder(tok)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def im_end(tok):
    return tok.convert_tokens_to_ids("<|im_end|>")


def newline(tok):
    return encode(tok, "\n")


def incremental_stream(tok, ct, head, turns, tools=TOOLS):
    """Build the stream the way a loop does: prompt, then sampled turns and observations.

    ``turns`` alternates assistant texts (encoded as the model would sample them, ending in
    <|im_end|>) and lists of observation messages. Returns (stream, mask, boundary positions).
    """
    stream = render_ids(tok, head, tools=tools, add_generation_prompt=True)
    mask, boundaries = [], []
    for turn in turns:
        if isinstance(turn, str):
            sampled = encode(tok, turn) + [im_end(tok)]
            stream += sampled
            mask += [1] * len(sampled)
        else:
            obs = ct.observation(stream, turn)
            boundaries += range(len(mask), len(mask) + len(obs.boundary_ids))
            stream += obs.token_ids
            mask += [0] * len(obs.token_ids)
    return stream, mask, boundaries


def test_end_of_turn_is_im_end_newline(tok, ct):
    assert ct.end_of_turn_ids == [im_end(tok)] + newline(tok)


def test_boundary_is_the_newline_after_a_sampled_im_end(tok, ct):
    assert ct.boundary_ids([1, 2, im_end(tok)]) == newline(tok)
    assert ct.boundary_ids([1, 2, im_end(tok)] + newline(tok)) == []
    # cut off mid-text (no <|im_end|>): the whole end-of-turn closes the turn, as a full render has
    assert ct.boundary_ids([1, 2, 3]) == [im_end(tok)] + newline(tok)


def test_tool_round_equals_full_render_except_trailing_separator(tok, ct):
    """P; A1 ‖ O ‖ A2: the stream equals a full render of the conversation.

    A full render ends every turn with <|im_end|>\\n; the stream ends where the model
    stopped (<|im_end|>). Every other token is equal — including the "\\n" after A1's
    <|im_end|>, which CT adds as a mask-0 boundary (verl #6501 dropped it).
    """
    head = [
        {"role": "system", "content": "You can use tools."},
        {"role": "user", "content": "计算 18 * 7"},
    ]
    final = "<think>\n\n</think>\n\nThe answer is 126."
    tool_msg = [{"role": "tool", "content": "126"}]
    stream, mask, boundaries = incremental_stream(tok, ct, head, [CALL_TEXT, tool_msg, final])

    full = render_ids(
        tok,
        head
        + [
            {"role": "assistant", "content": "", "tool_calls": TOOL_CALLS},
            *tool_msg,
            {"role": "assistant", "content": final},
        ],
        tools=TOOLS,
    )
    assert full == stream + newline(tok)
    # the only token CT adds that no message renders is the separator after A1's <|im_end|>
    a1_len = len(encode(tok, CALL_TEXT)) + 1
    assert boundaries == [a1_len]
    assert mask[a1_len] == 0


def test_naive_concatenation_drops_the_separator(tok, ct):
    """What #6501 did: rendering the tool message alone loses the "\\n" that CT restores."""
    obs = ct.observation([im_end(tok)], [{"role": "tool", "content": "126"}])
    assert obs.boundary_ids == newline(tok)
    text = tok.decode(obs.token_ids)
    assert (
        text == "\n<|im_start|>user\n<tool_response>\n126\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_parallel_tool_messages_share_one_user_block(tok, ct):
    obs = ct.observation(
        [im_end(tok)], [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    )
    assert tok.decode(obs.message_ids).count("<|im_start|>user") == 1


def test_user_and_system_observations(tok, ct):
    obs = ct.observation([im_end(tok)], [{"role": "user", "content": "and 3 * 4?"}])
    assert (
        tok.decode(obs.message_ids)
        == "<|im_start|>user\nand 3 * 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    obs = ct.observation([im_end(tok)], [{"role": "system", "content": "be brief"}])
    assert tok.decode(obs.message_ids).startswith("<|im_start|>system\nbe brief<|im_end|>")


@pytest.mark.parametrize(
    "role, message",
    [
        ("assistant", "cannot end with assistant"),
        ("function", "only supports appending roles .*got 'function'"),
        (None, "only supports appending roles .*got None"),
    ],
)
def test_only_tool_user_system_can_be_appended(ct, role, message):
    """verl's two checks and messages (an assistant message may come before others)."""
    with pytest.raises(AgentLoopError, match=message):
        ct.observation([1], [{"role": role, "content": "x"}])


def test_multi_round_with_reasoning_equals_full_render(tok, ct):
    """Think blocks of turns after the last user query survive a full render: still equal."""
    head = [{"role": "user", "content": "计算 18 * 7 再加 1"}]
    a1 = "<think>\nUse the calculator.\n</think>\n\n" + CALL_TEXT
    a2 = "<think>\nNow add one.\n</think>\n\n" + CALL_TEXT.replace("18 * 7", "126 + 1")
    a3 = "<think>\nDone.\n</think>\n\n127"
    turns = [a1, [{"role": "tool", "content": "126"}], a2, [{"role": "tool", "content": "127"}], a3]
    stream, mask, boundaries = incremental_stream(tok, ct, head, turns)
    calls2 = [
        {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "126 + 1"}},
        }
    ]
    full = render_ids(
        tok,
        head
        + [
            {"role": "assistant", "content": a1.replace(CALL_TEXT, ""), "tool_calls": TOOL_CALLS},
            {"role": "tool", "content": "126"},
            {"role": "assistant", "content": a2.split("<tool_call>")[0], "tool_calls": calls2},
            {"role": "tool", "content": "127"},
            {"role": "assistant", "content": a3},
        ],
        tools=TOOLS,
    )
    assert full == stream + newline(tok)
    assert len(boundaries) == 2


# ---- where Qwen3's template is NOT append-only (documented; the stream is kept as sampled) ----


def test_qwen3_full_render_strips_think_of_turns_before_the_last_user_query(tok, ct):
    head = [{"role": "user", "content": "2 + 2?"}]
    a1 = "<think>\nsimple\n</think>\n\n4"
    stream, _, _ = incremental_stream(
        tok, ct, head, [a1, [{"role": "user", "content": "3 + 3?"}]], tools=None
    )
    full = render_ids(
        tok,
        head + [{"role": "assistant", "content": a1}, {"role": "user", "content": "3 + 3?"}],
        add_generation_prompt=True,
    )
    assert full != stream
    # the difference is exactly A1's think block, which the full render leaves out
    removed = encode(tok, "<think>\nsimple\n</think>\n\n")
    start = len(render_ids(tok, head, add_generation_prompt=True))
    assert stream[start : start + len(removed)] == removed
    assert stream[:start] + stream[start + len(removed) :] == full


def test_qwen3_full_render_inserts_empty_think_into_the_last_turn(tok, ct):
    head = [{"role": "user", "content": "2 + 2?"}]
    stream, _, _ = incremental_stream(tok, ct, head, ["4"], tools=None)
    full = render_ids(tok, head + [{"role": "assistant", "content": "4"}])
    inserted = encode(tok, "<think>\n\n</think>\n\n")
    start = len(render_ids(tok, head, add_generation_prompt=True))
    assert full[:start] + full[start + len(inserted) :] == stream + newline(tok)


# ---- verl's edge cases -----------------------------------------------------------------


def test_an_empty_append_adds_nothing_but_the_rest_of_an_end_of_turn(tok, ct):
    """verl: no new message appends nothing; its Qwen builder still adds the newline after
    a sampled <|im_end|> (so does this builder, from the template)."""
    messages = [{"role": "user", "content": "hi"}]
    plain = ct.merge_context_tokens(messages, list(messages), [5, 6])
    assert (plain.token_ids, plain.appended_token_count, plain.inserted_token_ids) == (
        [5, 6],
        0,
        [],
    )
    after_end = ct.merge_context_tokens(messages, list(messages), [5, im_end(tok)])
    assert after_end.token_ids == [5, im_end(tok), *newline(tok)]
    assert after_end.inserted_token_ids == newline(tok) and after_end.appended_token_count == 0
    mask, logprobs = ct.align_response_metadata(after_end, [1, 1], [-0.1, -0.2])
    assert mask == [1, 1, 0] and logprobs == [-0.1, -0.2, 0.0]


def test_an_unknown_merge_kind_is_rejected_with_verls_message(ct):
    from rolloutbus.streams.agent_loop.continuous_token import MergeResult

    merge = MergeResult(token_ids=[1], appended_token_count=1, kind="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^Unknown Continuous Token merge kind: 'bogus'$"):
        ct.align_response_metadata(merge, [], [])


def test_assistant_logprobs_errors_are_verls(ct):
    merge = ct.merge_assistant_tokens([1], [2, 3])
    with pytest.raises(
        ValueError,
        match="^assistant_logprobs is required for assistant Continuous Token alignment$",
    ):
        ct.align_response_metadata(merge, [], [])
    with pytest.raises(
        ValueError, match="^response_logprobs is required when assistant_logprobs is provided$"
    ):
        ct.align_response_metadata(merge, [], None, assistant_logprobs=[-0.1, -0.2])
    empty = ct.merge_assistant_tokens([1], [])
    assert ct.align_response_metadata(empty, [], []) == ([], [])  # nothing appended: fine


def test_verl_mains_non_assistant_names(tok, ct):
    """verl main (2026-08-22) says merge_non_assistant_tokens and kind "non_assistant"."""
    history = [{"role": "user", "content": "hi"}]
    tool = [*history, {"role": "tool", "content": "42"}]
    main = ct.merge_non_assistant_tokens(history, tool, [5, im_end(tok)])
    released = ct.merge_context_tokens(history, tool, [5, im_end(tok)])
    assert main.kind == "non_assistant" and main.token_ids == released.token_ids
    assert ct.align_response_metadata(main, [1, 1]) == ct.align_response_metadata(released, [1, 1])


class RecordingProcessor:
    """Test double for a VL processor: renders with the tokenizer's template and records
    the keyword arguments of each processor call."""

    def __init__(self, tok):
        self.tok = tok
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        return self.tok.apply_chat_template(messages, **kwargs)

    def __call__(self, text, images=None, videos=None, **kwargs):
        self.calls.append(kwargs)
        return {"input_ids": [self.tok.encode(text[0], add_special_tokens=False)]}


def test_template_and_processor_kwargs_reach_every_render(tok):
    """data.apply_chat_template_kwargs in every template render, data.mm_processor_kwargs in
    every processor call, as verl's builders apply them."""
    processor = RecordingProcessor(tok)
    builder = ContinuousTokenBuilder(
        tok, processor, mm_processor_kwargs={"max_pixels": 1024}, enable_thinking=False
    )
    ids = builder.build_initial_tokens([{"role": "user", "content": "hi"}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert processor.calls == [{"return_tensors": "pt", "max_pixels": 1024}]
    thinking = ContinuousTokenBuilder(tok).build_initial_tokens([{"role": "user", "content": "hi"}])
    assert tok.decode(thinking).endswith("<|im_start|>assistant\n")  # the template's default


class CountingTokenizer:
    """The real tokenizer, counting its template renders."""

    def __init__(self, tok):
        self._tok, self.renders = tok, 0

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self._tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_the_constant_prefix_is_rendered_once_per_builder(tok):
    """Each observation renders the prefix and its messages once; the prefix alone, the
    same text every time, is rendered for the first only. The tokens are a fresh builder's."""
    counting = CountingTokenizer(tok)
    builder = ContinuousTokenBuilder(counting)
    rounds = [
        [{"role": "tool", "content": "126"}],
        [{"role": "user", "content": "And times two?"}],
        [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}],
    ]
    stream = encode(tok, "Calling.") + [im_end(tok)]
    before = counting.renders
    for messages in rounds:
        assert builder.observation(stream, messages) == ContinuousTokenBuilder(tok).observation(
            stream, messages
        )
    assert counting.renders - before == len(rounds) + 1
