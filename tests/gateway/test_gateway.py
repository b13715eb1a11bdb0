"""The gateway on real parts: the example OpenAI-SDK agent (examples/openai_agent.py) calls
it over HTTP, every call becomes a turn on the test broker's turn log, and the turns fold
into trajectories with the right masks and logprobs.

The replica is the scripted engine behind the replica's own HTTP server (a test double:
the small real models cannot emit tool calls): a prompt without a tool response gets a
calculator call (logprob -0.25 per token), one with a tool response gets the answer
(-0.75 per token), both ending with ``<|im_end|>``.

- in-process gateway, trajectories by the offline replay of the turn log (the replay
  buffer's own fold): two agent sessions (one scored by the row's scorer, one rewarded by
  the agent), one streamed call then aborted, the errors an SDK sees, the sampling fields
  the session does not apply, and an idle session failed so its group is released;
- processes (slow): the gateway is SIGKILLed while the agent runs its tool and restarted;
  the agent's next call resumes the session from the log (nothing sampled twice), a
  session worker started meanwhile leaves the gateway's group alone, and the trainer
  client receives the group from the real replay buffer.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import httpx
import openai
import pytest

from rolloutbus.config import Config
from rolloutbus.consumers.log_replay import replay_turns
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.streams.agent_loop.continuous_token import get_builder
from rolloutbus.topics import Topics
from tests.gateway.processes import gateway_config, gateway_processes, gateway_stack
from tests.pipeline import read_topic, receive_groups, running, spawn
from tests.source_tree import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import openai_agent  # noqa: E402

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'
ANSWER = "18 * 7 is 126."
LP_CALL, LP_ANSWER = -0.25, -0.75
QUESTION = "What is 18 * 7?"
# a dataset row as a dispatcher would publish it (the agent gets the question from it)
ROW = {
    "data_source": "rolloutbus/arithmetic",
    "prompt": [{"role": "user", "content": QUESTION}],
    "reward_model": {"ground_truth": "126"},
}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


def _engine(tok, call_text: str = CALL, answer_text: str = ANSWER) -> ScriptedEngine:
    call, answer = _ids(tok, call_text), _ids(tok, answer_text)

    def script(prompt_ids: list[int]) -> ScriptedTurn:
        if "<tool_response>" in tok.decode(prompt_ids):
            return ScriptedTurn(answer, [LP_ANSWER] * len(answer))
        return ScriptedTurn(call, [LP_CALL] * len(call))

    return ScriptedEngine(
        script, tokenizer=tok, eos_token_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>")})
    )


def _config(bootstrap: str, replica_url: str, **gateway) -> Config:
    """The agent tests' config: budgets for a tool call, its response and the answer."""
    rollout = {"prompt_length": 1024, "response_length": 256}
    return gateway_config(bootstrap, replica_url, "gw", rollout=rollout, gateway=gateway)


def _check_agent_trajectory(
    tok, t, *, reward: float, call_text: str = CALL, answer_text: str = ANSWER
) -> None:
    """Prompt = the template's render of [system, user] with the tool; response = A1 ‖ O ‖ A2:
    mask 1 and the replica's logprobs on A1 and A2, mask 0 and 0.0 on the tool's turn."""
    call, answer = _ids(tok, call_text), _ids(tok, answer_text)
    messages = [
        {"role": "system", "content": openai_agent.SYSTEM},
        {"role": "user", "content": QUESTION},
    ]
    assert t["prompts"] == get_builder(tok).build_initial_tokens(
        messages, tools=[openai_agent.CALCULATOR_TOOL]
    )
    responses, mask, logprobs = t["responses"], t["response_mask"], t["rollout_log_probs"]
    n_obs = len(responses) - len(call) - len(answer)
    assert responses[: len(call)] == call and responses[-len(answer) :] == answer
    assert tok.decode(responses[len(call) : -len(answer)]) == (
        "\n<|im_start|>user\n<tool_response>\n126\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert mask == [1] * len(call) + [0] * n_obs + [1] * len(answer)
    assert logprobs == pytest.approx(
        [LP_CALL] * len(call) + [0.0] * n_obs + [LP_ANSWER] * len(answer)
    )
    assert t["reward_score"] == reward and t["agent_name"] == "gateway"
    assert t["status"] == "completed" and t["num_turns"] == 4


def test_an_openai_sdk_agent_becomes_trajectories(kafka_bootstrap, tok):
    engine = _engine(tok)
    with gateway_stack(engine, functools.partial(_config, kafka_bootstrap)) as (cfg, gateway):
        sessions = openai_agent.open_sessions(gateway.url, 3, row=ROW)
        uid = sessions[0]["id"].rsplit("_", 1)[0]
        first, second, third = sessions
        assert first["base_url"] == f"{gateway.url}/sessions/{first['id']}/v1"

        answer = openai_agent.run_agent(first["base_url"], QUESTION)
        assert answer == ANSWER
        scored = openai_agent.finish(gateway.url, first["id"], None)  # the row's scorer
        assert scored["rewards"] == [1.0]
        openai_agent.run_agent(second["base_url"], QUESTION)
        openai_agent.finish(gateway.url, second["id"], 0.5)

        _streamed_call_then_abort(tok, gateway.url, third)
        _errors_an_sdk_sees(gateway.url, first, uid)
    records = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    assert len(engine.calls) == 5  # 2 + 2 + 1 streamed; the repeated request sampled nothing
    by_session = {t["session_id"]: t for t in records}
    assert sorted(by_session) == [0, 1, 2]
    _check_agent_trajectory(tok, by_session[0], reward=1.0)
    _check_agent_trajectory(tok, by_session[1], reward=0.5)
    assert by_session[2]["status"] == "failed" and "the sandbox died" in by_session[2]["error"]


def _streamed_call_then_abort(tok, gateway_url: str, session: dict) -> None:
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    chunks = list(
        client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[openai_agent.CALCULATOR_TOOL],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [
        c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []
    ]
    assert [c.function.name for c in calls] == ["calculator"]
    assert json.loads(calls[0].function.arguments) == {"expression": "18 * 7"}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(_ids(tok, CALL))
    # the same request again (a retry), on /v1 with the session in a header, with a
    # temperature the session does not sample with
    by_header = openai.OpenAI(
        base_url=f"{gateway_url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Session-Id": session["id"]},
    )
    raw = by_header.chat.completions.with_raw_response.create(
        model="policy",
        messages=messages,
        tools=[openai_agent.CALCULATOR_TOOL],
        temperature=0.2,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert raw.headers["X-Rolloutbus-Ignored"] == "temperature"
    again = raw.parse()
    assert again.choices[0].message.tool_calls[0].id == calls[0].id  # answered from the log
    assert [lp.logprob for lp in again.choices[0].logprobs.content] == [LP_CALL] * len(
        _ids(tok, CALL)
    )
    assert again.choices[0].token_ids == _ids(tok, CALL)
    metrics = httpx.get(f"{gateway_url}/metrics").text
    assert 'rolloutbus_gateway_turns_total{outcome="repeated"}' in metrics
    assert 'rolloutbus_sessions_turn_events_total{type="generation"}' in metrics
    status = httpx.get(f"{gateway_url}/v1/sessions/{session['id']}").json()
    assert (status["state"], status["turns"], status["segments"]) == ("open", 1, 1)
    response = httpx.post(
        f"{gateway_url}/v1/sessions/{session['id']}/abort", json={"error": "the sandbox died"}
    )
    assert response.status_code == 200


def _errors_an_sdk_sees(gateway_url: str, finished: dict, uid: str) -> None:
    client = openai.OpenAI(base_url=finished["base_url"], api_key="x", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    with pytest.raises(openai.ConflictError, match="has finished"):
        client.chat.completions.create(model="policy", messages=messages)
    unknown = openai.OpenAI(
        base_url=f"{gateway_url}/sessions/{uid}_7/v1", api_key="x", max_retries=0
    )
    with pytest.raises(openai.NotFoundError, match=f"group {uid} has 3 sessions"):
        unknown.chat.completions.create(model="policy", messages=messages)
    never = openai.OpenAI(
        base_url=f"{gateway_url}/sessions/nosuch_0/v1", api_key="x", max_retries=0
    )
    with pytest.raises(openai.NotFoundError, match="no open gateway session nosuch_0"):
        never.chat.completions.create(model="policy", messages=messages)  # after a scan
    with pytest.raises(openai.BadRequestError, match="stop strings"):
        client.completions.create(model="policy", prompt=QUESTION, stop=["\n"])
    response = httpx.post(f"{gateway_url}/v1/sessions", json={"n": 1, "uid": "a_b"})
    assert response.status_code == 400 and "uid 'a_b'" in response.json()["error"]["message"]
    # a finish without a completion is refused, and the session stays open (not resumed)
    [empty] = openai_agent.open_sessions(gateway_url, 1)
    response = httpx.post(f"{gateway_url}/v1/sessions/{empty['id']}/finish", json={"reward": 1})
    assert response.status_code == 400 and "abort it instead" in response.text
    assert httpx.get(f"{gateway_url}/v1/sessions/{empty['id']}").json()["attempt"]
    assert httpx.post(f"{gateway_url}/v1/sessions/{empty['id']}/abort", json={}).status_code == 200
    response = httpx.get(f"{gateway_url}/v1/sessions/{empty['id']}")
    assert response.status_code == 409 and "has failed" in response.text


def test_an_idle_session_is_failed_so_its_group_is_released(kafka_bootstrap, tok):
    idle = functools.partial(_config, kafka_bootstrap, session_idle_timeout_s=1.0)
    with gateway_stack(_engine(tok), idle) as (cfg, gateway):
        [session] = openai_agent.open_sessions(gateway.url, 1)
        deadline = time.monotonic() + 60
        while session["id"] in gateway.sessions.open and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session["id"] not in gateway.sessions.open
    uid = session["id"].rsplit("_", 1)[0]
    [t] = [t for t in replay_turns(cfg).trajectories if t.uid == uid]
    assert t.status == "failed" and "gateway.session_idle_timeout_s" in t.error


@pytest.mark.slow
def test_a_gateway_restart_mid_session_resumes_from_the_log(kafka_bootstrap, tok, tmp_path):
    engine = _engine(tok)
    make_config = functools.partial(_config, kafka_bootstrap)
    with gateway_processes(engine, make_config, tmp_path) as (cfg, procs):
        url = procs.url
        buffer = spawn(["replay-buffer", "run"], procs.config, tmp_path / "replay.log")
        with running([buffer]):
            procs.start_gateway()
            sessions = openai_agent.open_sessions(url, 2, row=ROW)
            uid = sessions[0]["id"].rsplit("_", 1)[0]

            def restart_then_calculate(expression: str) -> str:
                procs.crash_and_restart_gateway()
                procs.start_session_worker()  # scans the turn log with the group in it
                return openai_agent.calculator(expression)

            tools = {"calculator": restart_then_calculate}
            assert openai_agent.run_agent(sessions[0]["base_url"], QUESTION, tools=tools) == ANSWER
            assert openai_agent.run_agent(sessions[1]["base_url"], QUESTION) == ANSWER
            for session in sessions:
                openai_agent.finish(url, session["id"], None)
            groups = receive_groups(cfg, {uid}, timeout_s=240)
    rows = sorted(groups[uid].batch.to_pylist(), key=lambda r: r["session_id"])
    assert [r["session_id"] for r in rows] == [0, 1]
    for row in rows:
        _check_agent_trajectory(tok, row, reward=1.0)
    assert len(engine.calls) == 4, "a turn was sampled twice, or a session worker ran the group"
    events = [
        decode_turn_event(m.value()) for m in read_topic(cfg, Topics.from_config(cfg.kafka).turns)
    ]
    mine = [e for e in events if e.uid == uid]
    starts = [e for e in mine if e.type == "session_started"]
    assert {e.agent_name for e in starts} == {"gateway"}  # no session worker's attempt
    resumed = [e for e in starts if e.resumed_from]
    assert sorted(e.session_id for e in resumed) == [0, 1]  # both came back from the log
    replayed = [e for e in mine if e.type == "generation" and e.attempt == resumed[0].attempt]
    original = [e for e in mine if e.type == "generation" and e.attempt == resumed[0].resumed_from]
    assert replayed[0].engine_request_id == original[0].engine_request_id  # not sampled again
