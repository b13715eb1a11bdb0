"""Anthropic's Messages API on the gateway, driven by the real Anthropic SDK: an agent that
speaks ``/v1/messages`` (plain and streamed) makes the same trajectory, token for token, as
the OpenAI-SDK agent of test_gateway.py, a repeated request (or one whose stream the client
dropped) is answered from the log, and
what the gateway cannot honour comes back as Anthropic's errors; each session's trace
rebuilt from the turn log names the replica of each turn.

The replica is test_gateway.py's scripted engine (a test double: the small real models
cannot emit tool calls): a calculator call first, the answer once a tool response is in the
prompt. With thinking, the script forces Qwen3's reasoning before the call and the answer
(``<think>…</think>``): it comes back as thinking blocks, plain and streamed, and the
blocks echoed back align with the logged turns. The same agent across a gateway SIGKILL
between its two calls (slow: the gateway is a real process, started again on its port)
makes the same trajectory, nothing sampled twice.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import anthropic
import httpx
import pytest

from rolloutbus.consumers.log_replay import replay_turns
from rolloutbus.monitoring.session_traces import read_traces
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.topics import Topics
from tests.gateway.processes import gateway_processes, gateway_stack
from tests.gateway.test_gateway import (
    ANSWER,
    CALL,
    QUESTION,
    ROW,
    _check_agent_trajectory,
    _config,
    _engine,
    _ids,
    openai_agent,
)
from tests.pipeline import read_topic
from tests.source_tree import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import anthropic_agent  # noqa: E402

_client = anthropic_agent.client_for
_request = anthropic_agent.request


def _run_agent(
    client: anthropic.Anthropic,
    *,
    stream: bool,
    calculator: Callable[..., str] = openai_agent.calculator,
    **fields,
) -> tuple[list[dict], list]:
    """examples/anthropic_agent.py's loop: ask, run the calculator on the model's call,
    answer; the history and the replies."""
    return anthropic_agent.run_agent(
        client, QUESTION, tools={"calculator": calculator}, stream=stream, **fields
    )


def test_the_example_anthropic_agent_trains_through_the_gateway(kafka_bootstrap, tok, capsys):
    """examples/anthropic_agent.py as its docstring runs it (streamed, a group of 2): each
    session answers, is finished with its reward, and becomes the exact trajectory."""
    make_config = functools.partial(_config, kafka_bootstrap)
    with gateway_stack(_engine(tok), make_config) as (cfg, gateway):
        argv = [gateway.url, QUESTION, "--answer", "126", "-n", "2", "--stream"]
        assert anthropic_agent.main(argv) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    uid = printed[0]["session"].rsplit("_", 1)[0]
    records = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    assert [(p["answer"], p["reward"]) for p in printed] == [(ANSWER, 1.0)] * 2
    assert sorted(t["session_id"] for t in records) == [0, 1]
    for record in records:
        _check_agent_trajectory(tok, record, reward=1.0)


def _check_replies(tok, replies) -> None:
    call_reply, answer_reply = replies
    assert call_reply.stop_reason == "tool_use"
    [call] = [b for b in call_reply.content if b.type == "tool_use"]
    assert call.name == "calculator" and call.input == {"expression": "18 * 7"}
    assert call_reply.usage.output_tokens == len(_ids(tok, CALL))
    assert answer_reply.stop_reason == "end_turn"
    assert [b.type for b in answer_reply.content] == ["text"]
    assert answer_reply.content[0].text == ANSWER


def test_an_anthropic_sdk_agent_makes_the_openai_agents_trajectory(kafka_bootstrap, tok):
    engine = _engine(tok)
    make_config = functools.partial(_config, kafka_bootstrap)
    with gateway_stack(engine, make_config) as (cfg, gateway):
        plain, streamed = openai_agent.open_sessions(gateway.url, 2, row=ROW)
        uid = plain["id"].rsplit("_", 1)[0]
        with _client(gateway.url, plain["id"]) as client:
            history, replies = _run_agent(client, stream=False)
            _check_replies(tok, replies)
            calls = len(engine.calls)
            again = client.messages.create(**_request(history[:-1]))  # a retried request
        assert again.content[0].text == ANSWER and len(engine.calls) == calls

        _disconnect_mid_stream(gateway.url, streamed["id"])
        calls = len(engine.calls)
        with _client(gateway.url, streamed["id"]) as client:
            _, streamed_replies = _run_agent(client, stream=True)
        _check_replies(tok, streamed_replies)
        assert len(engine.calls) == calls + 1  # the dropped stream's turn came from the log
        _errors_an_sdk_sees(gateway.url, plain["id"], uid)
        openai_agent.finish(gateway.url, plain["id"], None)  # the row's scorer
        openai_agent.finish(gateway.url, streamed["id"], 0.5)
    records = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    traces = read_traces(cfg, uid)
    by_session = {t["session_id"]: t for t in records}
    _check_agent_trajectory(tok, by_session[0], reward=1.0)
    _check_agent_trajectory(tok, by_session[1], reward=0.5)
    _check_traces(traces, cfg.replicas.urls[0])


THINKING = {"type": "enabled", "budget_tokens": 1024}
REASONED_CALL = f"<think>\nI should use the calculator.\n</think>\n\n{CALL}"
REASONED_ANSWER = f"<think>\nThe calculator says 126.\n</think>\n\n{ANSWER}"


def test_an_anthropic_sdk_agent_with_thinking_gets_thinking_blocks(kafka_bootstrap, tok):
    # scripted replies that reason first, as Qwen3 does (tiny-qwen3 cannot be made to)
    engine = _engine(tok, REASONED_CALL, REASONED_ANSWER)
    make_config = functools.partial(_config, kafka_bootstrap)
    with gateway_stack(engine, make_config) as (cfg, gateway):
        plain, streamed = openai_agent.open_sessions(gateway.url, 2, row=ROW)
        uid = plain["id"].rsplit("_", 1)[0]
        for session, stream in ((plain, False), (streamed, True)):
            with _client(gateway.url, session["id"]) as client:
                history, replies = _run_agent(
                    client, stream=stream, thinking=THINKING, max_tokens=2048
                )
                _check_reasoned_replies(replies)
                retried = _request(history[:-1], thinking=THINKING, max_tokens=2048)
                with client.messages.stream(**retried) as events:  # answered from the log
                    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            assert deltas[0] == "thinking_delta" and "signature_delta" in deltas
            openai_agent.finish(gateway.url, session["id"], None)
    records = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    assert len(engine.calls) == 4, "an echoed thinking block did not align with its turn"
    assert sorted(t["session_id"] for t in records) == [0, 1]  # one segment each
    for record in records:
        _check_agent_trajectory(
            tok, record, reward=1.0, call_text=REASONED_CALL, answer_text=REASONED_ANSWER
        )


def _check_reasoned_replies(replies) -> None:
    call_reply, answer_reply = replies
    assert [b.type for b in call_reply.content] == ["thinking", "tool_use"]
    assert call_reply.content[0].thinking == "I should use the calculator."
    assert call_reply.content[0].signature and call_reply.stop_reason == "tool_use"
    assert [b.type for b in answer_reply.content] == ["thinking", "text"]
    assert answer_reply.content[0].thinking == "The calculator says 126."
    assert answer_reply.content[1].text == ANSWER


@pytest.mark.slow
def test_an_anthropic_sdk_agent_across_a_gateway_sigkill(kafka_bootstrap, tok, tmp_path):
    engine = _engine(tok)
    make_config = functools.partial(_config, kafka_bootstrap)
    with gateway_processes(engine, make_config, tmp_path) as (cfg, procs):
        url = procs.url
        procs.start_gateway()
        [session] = openai_agent.open_sessions(url, 1, row=ROW)
        uid = session["id"].rsplit("_", 1)[0]

        def crash_then_calculate(expression: str) -> str:
            procs.crash_and_restart_gateway()  # between the tool_use and its tool_result
            return openai_agent.calculator(expression)

        with _client(url, session["id"]) as client:
            _, replies = _run_agent(client, stream=False, calculator=crash_then_calculate)
        _check_replies(tok, replies)
        openai_agent.finish(url, session["id"], None)
    assert procs.starts == 2
    [record] = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    events = [
        decode_turn_event(m.value()) for m in read_topic(cfg, Topics.from_config(cfg.kafka).turns)
    ]
    _check_agent_trajectory(tok, record, reward=1.0)  # token for token, as without the kill
    assert len(engine.calls) == 2, "a turn was sampled twice"
    starts = [e for e in events if e.uid == uid and e.type == "session_started"]
    assert [e.resumed_from for e in starts] == [None, starts[0].attempt]  # resumed from the log


def _check_traces(traces, replica_url: str) -> None:
    """Each session's trace from the turn log: one finished attempt whose two generate
    spans name the replica that sampled them."""
    assert sorted((t.session_id, t.status) for t in traces) == [(0, "finished"), (1, "finished")]
    for attempt in traces:
        generates = [s for s in attempt.spans if s.name == "generate"]
        assert len(generates) == 2, attempt.spans
        assert all(replica_url in str(s.attributes["replica"]) for s in generates)
        assert all(s.start_s <= s.end_s for s in attempt.spans)


def _disconnect_mid_stream(gateway_url: str, session: str) -> None:
    """A client that reads the first event of a streamed first turn, then hangs up."""
    url = f"{gateway_url}/sessions/{session}/v1/messages"
    body = {**_request([{"role": "user", "content": QUESTION}]), "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        first = next(response.iter_lines())
    assert first == "event: message_start"


def _errors_an_sdk_sees(gateway_url: str, session: str, uid: str) -> None:
    with _client(gateway_url, session) as client, _client(gateway_url, f"{uid}_99") as stray:
        _refused_requests(client, stray)


def _refused_requests(client: anthropic.Anthropic, stray: anthropic.Anthropic) -> None:
    history = [{"role": "user", "content": QUESTION}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            **_request(history), tool_choice={"type": "tool", "name": "calculator"}
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "tool_choice" in refused.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            **_request(
                [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "url", "url": "http://x/y.png"},
                            }
                        ],
                    }
                ]
            )
        )
    with pytest.raises(anthropic.NotFoundError) as unknown:
        stray.messages.create(**_request(history))
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
