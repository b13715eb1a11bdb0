"""``stream: true`` on the gateway streams the reply as the replica samples it, on OpenAI's
and on Anthropic's API, with the real SDKs, and the turn is logged as an unstreamed one.

The replica is the embedded one with tiny-qwen3 (a real model, streamed token by token),
sampling with a fixed seed. A gate holds the engine's decode thread after a few tokens of a
streamed call until the test opens it, so what reaches the client meanwhile was sent
before the turn ended: the order of events is asserted, not timings. A call that is not
streamed, or not gated, decodes straight through. Checked:

- OpenAI's ``stream=True``: text arrives while the engine is held and the turn is not yet
  logged; the streamed text is the unstreamed reply; the trajectory equals an unstreamed
  session's, token for token;
- the same with the Anthropic SDK's ``messages.stream``;
- a client that hangs up mid-stream: the turn is sampled to its end and logged once, and
  the retried request is answered from the log (no second engine call);
- Anthropic's thinking where the chat template's generation prompt opens the think (a
  template double, the scripted engine): the reply's start is the thinking block;
- (no broker) the text deltas: whole characters, and nothing of a tool call.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from rolloutbus.config import Config
from rolloutbus.consumers.log_replay import replay_turns
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.replica.scripted import ScriptedEngine, ScriptedTurn
from rolloutbus.replica.server import replica_in_thread
from rolloutbus.streams.gateway import gateway_in_thread
from rolloutbus.streams.gateway.streaming import ReplyText
from tests.gateway.processes import gateway_config, gateway_stack
from tests.gateway.templates import open_think_template

GATE_AT = 6  # tokens a gated call samples before its engine waits for the test
GATE_WAIT_S = 120.0  # seconds; only a gateway that does not stream waits this long
TURN_TOKENS = 24  # each reply's length (max_tokens): the text goes on after the gate
SAMPLING = {"temperature": 1.0, "seed": 7}  # the group's: every session samples alike
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


# the engine held mid-turn while the client has text and no turn is logged, then let go
HELD_WITH_TEXT = ["engine held", "client has text mid-turn, 0 turns logged", "gate opened"]


class Gate:
    """Wraps the engine's ``submit``: counts calls; an armed call's decode thread waits
    after its ``GATE_AT``-th token until ``open()``, noting the order of what happened."""

    def __init__(self, engine: Any):
        self.calls = 0
        self.order: list[str] = []
        self._armed = False
        self._opened, self._held = threading.Event(), threading.Event()
        submit = engine.submit

        async def gated(request: Any, on_token: Any = None) -> Any:
            self.calls += 1
            armed, self._armed = self._armed, False
            sampled = 0

            def on(token: int, logprob: float, version: Any) -> None:
                nonlocal sampled
                if on_token is not None:  # handed to the replica's stream first
                    on_token(token, logprob, version)
                sampled += 1
                if armed and sampled == GATE_AT:
                    self.order.append("engine held")
                    self._held.set()
                    if not self._opened.wait(GATE_WAIT_S):
                        self.order.append("gate timed out")

            return await submit(request, on)

        engine.submit = gated  # the instance's: the replica server still sees a DecodeEngine

    def arm(self) -> None:
        self.order = []
        self._armed = True
        self._opened.clear()
        self._held.clear()

    def client_has_text(self, turns_logged: Callable[[], int]) -> None:
        """The client got text: with the engine held mid-turn, note the turns logged, then
        let it go on (a gateway that does not stream never gets here before the gate gives
        up)."""
        self._held.wait(GATE_WAIT_S)
        self.order.append(f"client has text mid-turn, {turns_logged()} turns logged")
        self.open()

    def open(self) -> None:
        self.order.append("gate opened")
        self._opened.set()


@pytest.fixture(scope="module")
def replica():
    cfg = Config.model_validate({"model": {"name": "tiny-qwen3"}, "replica_server": {"port": 0}})
    with replica_in_thread(cfg) as handle:
        yield handle, Gate(handle.engine)


@pytest.fixture
def gateway(kafka_bootstrap, replica):
    handle, gate = replica
    cfg = gateway_config(kafka_bootstrap, handle.url, "gws")
    ensure_topics(cfg.kafka)
    with gateway_in_thread(cfg) as running:
        yield cfg, running.url, gate


def _open(url: str, n: int) -> list[dict]:
    body = {"n": n, "sampling_params": SAMPLING}
    response = httpx.post(f"{url}/v1/sessions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["sessions"]


def _turns(url: str, session: dict) -> int:
    return httpx.get(f"{url}/v1/sessions/{session['id']}", timeout=60).json()["turns"]


def _trajectories(cfg: Config, url: str, sessions: list[dict]) -> list[dict]:
    for session in sessions:
        httpx.post(f"{url}/v1/sessions/{session['id']}/finish", json={"reward": 1.0}, timeout=60)
    uid = sessions[0]["id"].rsplit("_", 1)[0]
    found = [t.model_dump() for t in replay_turns(cfg).trajectories if t.uid == uid]
    return sorted(found, key=lambda t: t["session_id"])


def _same_tokens(trajectories: list[dict]) -> None:
    first, *others = trajectories
    assert first["response_mask"] == [1] * len(first["responses"]) and first["responses"]
    for other in others:
        for column in ("prompts", "responses", "response_mask", "rollout_log_probs", "num_turns"):
            assert other[column] == first[column], column


def _openai(session: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)


def _chat(session: dict, **fields: Any) -> Any:
    return _openai(session).chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=TURN_TOKENS, **fields
    )


def test_openai_stream_sends_text_before_the_turn_ends_and_logs_the_same_turn(gateway):
    cfg, url, gate = gateway
    plain, streamed = _open(url, 2)
    reply = _chat(plain).choices[0].message.content
    gate.arm()
    texts, finish = [], []
    for chunk in _chat(streamed, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage.completion_tokens == TURN_TOKENS
            continue
        delta = chunk.choices[0].delta
        if delta.content and not "".join(texts):  # the first text (after the role's chunk)
            gate.client_has_text(lambda: _turns(url, streamed))
        texts.append(delta.content or "")
        finish.append(chunk.choices[0].finish_reason)
    assert gate.order == HELD_WITH_TEXT
    assert "".join(texts) == reply and finish[-1] == "length"
    _same_tokens(_trajectories(cfg, url, [plain, streamed]))


def test_anthropic_stream_sends_text_before_the_turn_ends_and_logs_the_same_turn(gateway):
    cfg, url, gate = gateway
    plain, streamed = _open(url, 2)
    request = {"model": "policy", "max_tokens": TURN_TOKENS, "messages": MESSAGES}
    root = url + "/sessions/{}"
    with anthropic.Anthropic(base_url=root.format(plain["id"]), api_key="x") as client:
        reply = client.messages.create(**request)
    gate.arm()
    texts = []
    with (
        anthropic.Anthropic(base_url=root.format(streamed["id"]), api_key="x") as client,
        client.messages.stream(**request) as stream,
    ):
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                if not texts:
                    gate.client_has_text(lambda: _turns(url, streamed))
                texts.append(event.delta.text)
        final = stream.get_final_message()
    assert gate.order == HELD_WITH_TEXT
    assert "".join(texts) == final.content[0].text == reply.content[0].text
    assert final.stop_reason == reply.stop_reason == "max_tokens"
    assert final.usage.output_tokens == TURN_TOKENS
    _same_tokens(_trajectories(cfg, url, [plain, streamed]))


def test_a_client_that_hangs_up_mid_stream_gets_the_turn_from_the_log(gateway):
    cfg, url, gate = gateway
    plain, dropped = _open(url, 2)
    reply = _chat(plain).choices[0].message.content
    gate.arm()
    stream = _chat(dropped, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # hangs up while the engine is held, mid-turn
    calls = gate.calls
    gate.open()
    again = _chat(dropped)  # the SDK's retry: waits for the turn, then gets it from the log
    assert again.choices[0].message.content == reply
    assert gate.calls == calls, "the retried request was sampled again"
    assert _turns(url, dropped) == 1
    _same_tokens(_trajectories(cfg, url, [plain, dropped]))


def test_streamed_text_is_whole_characters_up_to_a_tool_call(tok):
    """No broker: a reply fed token by token, as a replica streams it."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = "Sea 𝄞 and foam,\n" + call
    tokens = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert any(tok.decode([t]).endswith("\ufffd") for t in tokens)  # 𝄞 spans tokens
    reply = ReplyText(tok, "hermes")
    deltas = [reply.add([token]) for token in tokens]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == "Sea 𝄞 and foam,"  # the call and the whitespace before it wait
    assert reply.rest("Sea 𝄞 and foam,") == ""  # what the hermes parser makes the content
    plain = ReplyText(tok, "hermes")
    assert "".join(plain.add([t]) for t in tok.encode("a <b> c ", add_special_tokens=False))
    assert plain.sent == "a <b> c" and plain.rest("a <b> c") == ""


def test_anthropic_thinking_where_the_template_opens_the_think(kafka_bootstrap, tok):
    """The chat template is a test double (Qwen3's with Qwen3-thinking-2507's generation
    prompt, which opens the think) and the replica the scripted engine (a test double): its
    reply starts inside the reasoning, as such a model's does. Plain and streamed, the
    reasoning is a thinking block; echoed back, it extends the logged tokens."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = tok.encode("A poem about waves.\n</think>\n\nThe sea.", add_special_tokens=False)
    turn = ScriptedTurn([*sampled, end], [-0.5] * (len(sampled) + 1))
    engine = ScriptedEngine(lambda _: turn, tokenizer=tok, eos_token_ids=frozenset({end}))
    template = {"chat_template": open_think_template(tok)}  # every render of the gateway's
    data = {"apply_chat_template_kwargs": template}
    make_config = functools.partial(gateway_config, kafka_bootstrap, topic_prefix="gws", data=data)
    with gateway_stack(engine, make_config) as (_, running):
        [session] = _open(running.url, 1)
        root = f"{running.url}/sessions/{session['id']}"
        thinking = {"type": "enabled", "budget_tokens": 1024}
        with anthropic.Anthropic(base_url=root, api_key="x", max_retries=0) as client:
            plain = client.messages.create(
                model="policy", max_tokens=64, messages=MESSAGES, thinking=thinking
            )
            echoed = {"role": "assistant", "content": [b.model_dump() for b in plain.content]}
            history = [*MESSAGES, echoed, {"role": "user", "content": "Another."}]
            request = {"model": "policy", "max_tokens": 64, "messages": history}
            with client.messages.stream(**request, thinking=thinking) as stream:
                deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
                final = stream.get_final_message()
    for message in (plain, final):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "A poem about waves."
        assert message.content[1].text == "The sea."
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    first, second = (call.prompt_ids for call in engine.calls)
    assert second[: len(first) + len(turn.token_ids)] == first + turn.token_ids
