"""Gateway sessions without a broker: every call a turn, aligned with the logged stream.

The LLM client is the scripted server manager (a test double: no model can be made to emit
tool calls here) and the turn log is a list the session's events are appended to, decoded
from their wire bytes, as the fold would read them. The checks:

- a chat with one tool call gives token for token the stream ``tool_agent`` gives for the
  same conversation (the observation rendered by the Continuous Token builder, masks and
  logprobs), and the fold of the logged events equals the session's output;
- a session resumed from its logged events (a gateway restart) replays its generations
  without sampling, aligns the agent's next request from the request alone, and logs what
  the live session would have logged;
- a repeated request (an SDK retry) is answered from the log; an edited history starts a
  new segment; a spent response budget answers ``length``; bad messages are 400s.
"""

from __future__ import annotations

import json

import pytest

from rolloutbus.config import Config
from rolloutbus.errors import TokenDriftError
from rolloutbus.schemas.turns import (
    SessionFinished,
    SessionStarted,
    decode_turn_event,
    encode_turn_event,
)
from rolloutbus.streams.agent_loop import DictConfigWrap, ToolAgentLoop
from rolloutbus.streams.agent_loop.tool_parser import rendered_tool_schema
from rolloutbus.streams.agent_loop.tools import CalculatorTool
from rolloutbus.streams.assembly.session_fold import SessionFold
from rolloutbus.streams.assembly.trajectories import build_group_trajectories
from rolloutbus.streams.gateway.messages import BadMessagesError
from rolloutbus.streams.gateway.session import (
    GatewaySession,
    SessionClosedError,
)
from rolloutbus.streams.gateway.wire import ChatCompletionRequest, CompletionRequest
from rolloutbus.streams.sessions.recovery import LoggedAttempt
from tests.builders import make_group_started
from tests.gateway.contexts import gateway_context
from tests.scripted_server import (
    ScriptedServerManager,
    scripted_turn,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'
ANSWER = "The answer is 126."
LP_CALL, LP_ANSWER = -0.25, -0.75
QUESTION = [{"role": "user", "content": "计算 18 * 7"}]


@pytest.fixture(scope="module")
def tools():
    return [rendered_tool_schema(CalculatorTool().tool_schema)]


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


class Log:
    """The session's events, each through its wire encoding (a list, not a broker)."""

    def __init__(self):
        self.events = []

    async def emit(self, event):
        self.events.append(decode_turn_event(encode_turn_event(event)))

    def of(self, attempt):
        return [e for e in self.events if getattr(e, "attempt", None) == attempt]


def make_session(tok, outputs, log, *, row=None, partitions=4, **rollout):
    cfg = Config.model_validate(
        {"model": {"name": "tiny-qwen3"}, "rollout": rollout, "kafka": {"partitions": partitions}}
    )
    server = ScriptedServerManager(outputs)
    ctx = gateway_context(tok, cfg, server, log.emit)
    group = make_group_started(
        "g1", attempt="ga", row=row or {}, sampling_params={}, driven_by="gateway"
    )
    return GatewaySession(ctx, group, 0), server


def sdk_echo(reply):
    """The assistant message as an OpenAI SDK sends it back: content null, arguments
    re-serialized without spaces (``model_dump(exclude_none=True)`` of its message)."""
    message = reply.message()
    calls = [
        {
            **c,
            "function": {
                **c["function"],
                "arguments": json.dumps(
                    json.loads(c["function"]["arguments"]), separators=(",", ":")
                ),
            },
        }
        for c in message.get("tool_calls", [])
    ]
    return {
        "role": "assistant",
        **({"tool_calls": calls} if calls else {"content": message["content"]}),
    }


def tool_message(reply, content="126"):
    return {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": content}


def trajectory(log, attempt, response_length=512):
    fold = SessionFold(0, attempt)
    for event in log.of(attempt):
        fold.apply(event)
    started = make_group_started("g1", attempt="ga", row={}, driven_by="gateway")
    [t] = build_group_trajectories(started, [fold], response_length)
    return t


async def test_a_tool_call_chat_logs_the_stream_tool_agent_logs(tok, tools):
    outputs = [scripted_turn(ids(tok, CALL), LP_CALL), scripted_turn(ids(tok, ANSWER), LP_ANSWER)]
    log = Log()
    session, server = make_session(tok, list(outputs), log)
    await session.begin()
    first = await session.chat(list(QUESTION), tools, None)
    assert first.reply.finish_reason == "tool_calls"
    assert first.reply.tool_calls[0]["function"] == {
        "name": "calculator",
        "arguments": '{"expression": "18 * 7"}',
    }
    history = [*QUESTION, sdk_echo(first.reply), tool_message(first.reply)]
    second = await session.chat(history, tools, None)
    assert (second.reply.content, second.reply.finish_reason) == (ANSWER, "stop")
    finished = await session.finish(None, {})

    agent = ToolAgentLoop(
        DictConfigWrap(session.ctx.config),
        ScriptedServerManager(list(outputs)),
        tok,
        None,
        tools=[CalculatorTool()],
    )
    out = await agent.run({"temperature": 1.0, "logprobs": True}, raw_prompt=list(QUESTION))
    # the replica saw the same prompts: P, then P ‖ A1 ‖ O (O from the CT builder)
    assert [c.prompt_ids for c in server.calls] == [
        c.prompt_ids for c in agent.server_manager.calls
    ]
    [output] = session.outputs()
    assert output.prompt_ids == out.prompt_ids
    assert output.response_ids == out.response_ids
    assert output.response_mask == out.response_mask
    assert output.response_logprobs == out.response_logprobs
    a1, a2 = ids(tok, CALL), ids(tok, ANSWER)
    assert out.response_mask == [1] * len(a1) + [0] * (
        len(out.response_mask) - len(a1) - len(a2)
    ) + [1] * len(a2)

    # the fold of what was logged is the same trajectory
    assert [e.type for e in log.events] == [
        "session_started",
        "segment_started",
        "generation",
        "observation",
        "generation",
        "session_finished",
    ]
    assert isinstance(finished, SessionFinished) and finished.outputs[0].mask_override is None
    t = trajectory(log, session.attempt)
    assert t.prompts == out.prompt_ids and t.responses == out.response_ids
    assert t.response_mask == out.response_mask
    assert t.rollout_log_probs == pytest.approx(out.response_logprobs)
    assert t.agent_name == "gateway" and t.num_turns == 4


async def test_a_resumed_session_replays_its_log_and_aligns_the_next_request(tok, tools):
    log = Log()
    live, _ = make_session(tok, [scripted_turn(ids(tok, CALL), LP_CALL)], log)
    await live.begin()
    first = await live.chat(list(QUESTION), tools, None)
    # the gateway restarts: a new process has only the log
    logged = LoggedAttempt(0, live.attempt, "gateway")
    for event in log.of(live.attempt)[1:]:
        logged.add(event)
    resumed, server = make_session(tok, [scripted_turn(ids(tok, ANSWER), LP_ANSWER)], log)
    await resumed.begin(resume=logged)
    assert server.calls == []  # nothing sampled again
    new = log.of(resumed.attempt)
    assert isinstance(new[0], SessionStarted) and new[0].resumed_from == live.attempt
    assert [e.type for e in new[1:]] == ["segment_started", "generation"]
    assert new[2].token_ids == first.token_ids and new[2].logprobs == first.logprobs

    history = [*QUESTION, sdk_echo(first.reply), tool_message(first.reply)]
    second = await resumed.chat(history, tools, None)
    assert second.outcome == "sampled" and second.reply.content == ANSWER
    # the prompt is the logged stream and the observation, as the live session's would be
    expected, _ = make_session(
        tok, [scripted_turn(ids(tok, CALL)), scripted_turn(ids(tok, ANSWER))], Log()
    )
    await expected.begin()
    await expected.chat(list(QUESTION), tools, None)
    await expected.chat(history, tools, None)
    assert server.calls[0].prompt_ids == expected.ctx.llm_client.calls[1].prompt_ids
    await resumed.finish(1.0, {})
    t = trajectory(log, resumed.attempt)
    a1, a2 = ids(tok, CALL), ids(tok, ANSWER)
    assert t.response_mask[: len(a1)] == [1] * len(a1) and t.response_mask[-len(a2) :] == [1] * len(
        a2
    )
    assert t.rollout_log_probs[: len(a1)] == pytest.approx([LP_CALL] * len(a1))
    assert t.rollout_log_probs[-len(a2) :] == pytest.approx([LP_ANSWER] * len(a2))
    assert set(t.response_mask[len(a1) : -len(a2)]) == {0}
    assert t.reward_score == 1.0


async def test_a_repeated_request_is_answered_from_the_log(tok, tools):
    log = Log()
    session, server = make_session(tok, [scripted_turn(ids(tok, CALL), LP_CALL)], log)
    await session.begin()
    first = await session.chat(list(QUESTION), tools, None)
    logged = len(log.events)
    again = await session.chat(list(QUESTION), tools, None)  # the SDK retries a lost answer
    assert again.outcome == "repeated" and again.reply == first.reply
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs
    assert len(server.calls) == 1 and len(log.events) == logged

    # and after a restart: the first request a new process gets is the retry
    resumed_log = LoggedAttempt(0, session.attempt, "gateway")
    for event in log.of(session.attempt)[1:]:
        resumed_log.add(event)
    resumed, server2 = make_session(tok, [], log)
    await resumed.begin(resume=resumed_log)
    retried = await resumed.chat(list(QUESTION), tools, None)
    assert retried.outcome == "repeated" and retried.reply == first.reply and server2.calls == []


async def test_an_edited_history_starts_a_new_segment(tok, tools):
    outputs = [scripted_turn(ids(tok, CALL), LP_CALL), scripted_turn(ids(tok, ANSWER), LP_ANSWER)]
    log = Log()
    session, server = make_session(
        tok,
        outputs,
        log,
        row={"data_source": "rolloutbus/arithmetic", "reward_model": {"ground_truth": "126"}},
    )
    session.group = session.group.model_copy(
        update={
            "row": {"data_source": "rolloutbus/arithmetic", "reward_model": {"ground_truth": "126"}}
        }
    )
    await session.begin()
    first = await session.chat(list(QUESTION), tools, None)
    # the agent compresses its context: the tool call is summarized into the user turn
    edited = [{"role": "user", "content": "18 * 7 = 126 (from the calculator). Answer."}]
    await session.chat(edited, tools, None)
    assert (
        server.calls[1].prompt_ids[: len(server.calls[0].prompt_ids)] != server.calls[0].prompt_ids
    )
    assert len(session.transcript.segments) == 2
    await session.finish(None, {})  # the row's scorer rewards the last output, copied back
    t0_out, t1_out = session.outputs()
    assert t1_out.response_ids == ids(tok, ANSWER) and t0_out.response_ids == first.token_ids
    finished = log.events[-1]
    assert [o.reward_score for o in finished.outputs] == [1.0, 1.0]


async def test_the_same_text_in_other_tokens_is_drift(tok, tools):
    log = Log()
    session, _ = make_session(tok, [scripted_turn(ids(tok, CALL), LP_CALL)], log)
    await session.begin()
    await session.chat(list(QUESTION), tools, None)
    seg = session.transcript.segments[0]
    # the logged reply's text tokenized character by character: the same text, other tokens
    reply = tok.decode(seg.tokens[seg.prompt_len :])
    respelled = [t for ch in reply for t in tok.encode(ch, add_special_tokens=False)]
    assert respelled != seg.tokens[seg.prompt_len :]
    with pytest.raises(TokenDriftError, match="diverges from the logged stream"):
        await session.complete(seg.tokens[: seg.prompt_len] + respelled + [198], None)


async def test_a_spent_response_budget_answers_length_without_sampling(tok, tools):
    log = Log()
    call = ids(tok, CALL)
    session, server = make_session(
        tok, [scripted_turn(call, LP_CALL)], log, response_length=len(call) + 5
    )
    await session.begin()
    first = await session.chat(list(QUESTION), tools, None)
    history = [*QUESTION, sdk_echo(first.reply), tool_message(first.reply, "126 " * 40)]
    second = await session.chat(history, tools, None)
    assert second.outcome == "length" and second.reply.finish_reason == "length"
    assert len(server.calls) == 1 and [e.type for e in log.events][-1] == "generation"


async def test_text_completions_continue_the_logged_stream(tok):
    log = Log()
    prompt = "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    session, server = make_session(
        tok, [scripted_turn(ids(tok, "2")), scripted_turn(ids(tok, "3"))], log
    )
    await session.begin()
    first = await session.complete(prompt, None)
    reply_text = tok.decode(first.token_ids, skip_special_tokens=True)
    follow = prompt + reply_text + "\n<|im_start|>user\n+1?<|im_end|>\n<|im_start|>assistant\n"
    await session.complete(follow, None)
    first_prompt = server.calls[0].prompt_ids
    second_prompt = server.calls[1].prompt_ids
    # the sampled tokens stay as sampled, <|im_end|> included; only the new text is encoded
    assert (
        second_prompt[: len(first_prompt) + len(first.token_ids)] == first_prompt + first.token_ids
    )
    assert [e.type for e in log.events][-2:] == ["observation", "generation"]


async def test_bad_messages_and_settled_sessions_are_refused(tok, tools):
    log = Log()
    session, _ = make_session(tok, [scripted_turn(ids(tok, CALL))], log)
    await session.begin()
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(BadMessagesError, match="image_url"):
        await session.chat(image, tools, None)
    with pytest.raises(BadMessagesError, match="continuing an assistant message"):
        await session.chat([*QUESTION, {"role": "assistant", "content": "Let"}], tools, None)
    await session.chat(list(QUESTION), tools, None)
    await session.abort("the sandbox died")
    assert log.events[-1].type == "session_failed" and log.events[-1].error == "the sandbox died"
    with pytest.raises(SessionClosedError):
        await session.chat(list(QUESTION), tools, None)


def test_request_fields_that_cannot_be_honoured_are_named():
    def problem(**fields):
        return ChatCompletionRequest.model_validate({"messages": QUESTION, **fields}).unsupported()

    assert problem(user="u", metadata={}, parallel_tool_calls=False) is None
    assert "n must be 1" in problem(n=2)
    assert problem(stop=["\n"]) is None  # found as the replica streams (stops.py)
    text = CompletionRequest.model_validate({"prompt": "x", "stop": "\n"}).unsupported()
    assert text is not None and "stop strings" in text
    assert "tool_choice" in problem(tool_choice="required")
    assert "response_format" in problem(response_format={"type": "json_object"})
    assert "frobnicate" in problem(frobnicate=1)
    request = ChatCompletionRequest.model_validate({"messages": QUESTION, "temperature": 0.2})
    from rolloutbus.schemas.prompts import GroupSamplingParams

    assert request.ignored_sampling(GroupSamplingParams()) == ["temperature"]
    assert request.ignored_sampling(GroupSamplingParams(temperature=0.2)) == []


class LoggedPartitions(Log):
    """The log as the table scans it: each partition's events folded by the session
    worker's own scan (``TurnLogScan``), from the start."""

    def __init__(self, partitions):
        super().__init__()
        self.partitions = partitions
        self.scans = 0

    def scan(self, partition):
        from rolloutbus.streams.sessions.recovery import TurnLogScan
        from rolloutbus.topics import partition_for

        self.scans += 1
        scan = TurnLogScan()
        mine = [e for e in self.events if partition_for(e.uid, self.partitions) == partition]
        for offset, event in enumerate(mine):
            scan.apply(offset, event)
        return scan


def make_table(tok, log, outputs):
    from rolloutbus.streams.gateway.sessions import GatewaySessions

    session, _ = make_session(tok, outputs, log, partitions=log.partitions)
    return GatewaySessions(session.ctx, scan=log.scan, current_version=lambda: (3, 30))


async def test_the_table_resumes_sessions_of_a_restart_and_ones_opened_after_its_scan(tok, tools):
    from rolloutbus.streams.gateway.sessions import SessionNotFoundError
    from rolloutbus.streams.gateway.wire import OpenSessionsRequest

    log = LoggedPartitions(partitions=1)  # one partition: every scan sees every group
    before = make_table(tok, log, [scripted_turn(ids(tok, CALL), LP_CALL)] * 2)
    [s1] = await before.open_group(OpenSessionsRequest(n=1, uid="ga"))
    [s2] = await before.open_group(OpenSessionsRequest(n=1, uid="gb"))
    assert log.events[0].driven_by == "gateway" and log.events[0].policy_version == 3
    await s1.chat(list(QUESTION), tools, None)

    after = make_table(tok, log, [])  # the restarted gateway
    resumed = await after.get("ga_0")
    assert log.scans == 1 and len(resumed.transcript.turns()) == 1
    # another gateway opens a group after the scan: a call for it scans again and finds it
    [late] = await make_table(tok, log, []).open_group(OpenSessionsRequest(n=1, uid="gc"))
    assert (await after.get("gc_0")).group.uid == "gc" and log.scans == 2
    assert (await after.get("gb_0")).group.uid == "gb"  # a candidate of the second scan
    with pytest.raises(SessionNotFoundError, match="group ga has 1 sessions"):
        await after.get("ga_1")
    with pytest.raises(SessionNotFoundError, match="no open gateway session gz_0"):
        await after.get("gz_0")
    async with resumed.lock:
        await resumed.abort("done")
    after.settle(resumed)
    with pytest.raises(SessionClosedError):
        await after.get("ga_0")
